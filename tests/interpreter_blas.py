"""Whether Triton's interpreter can show a kernel's batch invariance on this CPU.

The interpreter runs tl.dot as numpy's matrix product, and numpy's BLAS may give a row other bits at another place in
a tile: OpenBLAS's Haswell kernel does (rows 6-15 of each 16 differ from rows 0-5 in the last bit). A kernel that is
placement-independent on a GPU then cannot show it through the interpreter here, and the tests of that property skip,
saying why. On a CPU whose BLAS computes a tile's rows alike (where CI ran them so far) they run.

    pytestmark = pytest.mark.skipif(not blas_rows_placed_alike(), reason=BLAS_ROWS_REASON)
"""

import numpy as np

BLAS_ROWS_REASON = "numpy's BLAS on this CPU computes a row's bits by its place in a tile"


def blas_rows_placed_alike() -> bool:
    """One row alone at the top of a [64, 128] tile, then at every other place: the same bits each time."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((128, 128), dtype=np.float32)
    a = np.zeros((64, 128), np.float32)
    a[0, :48] = rng.standard_normal(48, dtype=np.float32)
    return all(np.array_equal((np.roll(a, p, 0) @ w)[p], (a @ w)[0]) for p in range(64))
