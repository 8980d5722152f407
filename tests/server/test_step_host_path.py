"""The step's host path, vectorised over the step (issue #44): what the batcher does per step on the host equals
what it did row by row. `slice_deltas` gathers every row's accepted positions once per tensor (fp32 converted
after the gather) where it sliced or gathered each row on its own; `KVPool.accept` skips rows whose path is a
chain prefix (nothing moves) where it listed every row's slots. The references below are the row-by-row code."""

import numpy as np
import pytest
import torch
from tiny_models import tiny_target

from tether.server.kv_pool import KVPool
from tether.server.rounds import slice_deltas
from tether.shared.drafter import POSITION_AXIS
from tether.shared.wire import f32_to_bf16


def slice_row_by_row(tensors: dict[str, torch.Tensor], T: int, rows) -> list[tuple[int, list[int], dict]]:
    """slice_deltas as it was: the whole tensor converted, then a view (contiguous path) or a take per row."""
    bits = {k: t.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.bfloat16
            else f32_to_bf16(t.float().numpy()) for k, t in tensors.items()}  # fmt: skip
    out = []
    for b, start, path, tokens in rows:
        idx = [b * T + j for j in path]
        out.append((start, list(tokens), {k: np.take(a, idx, axis=POSITION_AXIS[k]) for k, a in bits.items()}))
    return out


def every_token(B: int, T: int, dtype: torch.dtype, g: torch.Generator) -> dict[str, torch.Tensor]:
    """Tensors shaped like a MoA server part's over B * T positions (lsa: axis 0; tli_k / tli_v: axis 1)."""
    n = B * T
    return {"lsa": torch.randn(n, 12, generator=g).to(dtype), "tli_k": torch.randn(3, n, 2, 4, generator=g).to(dtype),
            "tli_v": torch.randn(3, n, 2, 4, generator=g).to(dtype)}  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_slice_deltas_equals_the_row_by_row_slices(dtype):
    g = torch.Generator().manual_seed(0)
    B, T = 9, 8
    tensors = every_token(B, T, dtype, g)
    tensors["lsa"][5] = float("nan")  # NaN stays the canonical NaN either way
    # Mixed rows: chain prefixes of every length, tree paths with gaps, rows left out, starts of any size.
    paths = {0: [0], 1: [0, 1, 2], 2: [0, 1, 2, 3, 4, 5, 6, 7], 3: [0, 2, 5], 5: [0, 3], 6: [0, 1], 8: [0, 4, 6, 7]}
    rows = [(b, 17 * b + 3, path, [100 + b + j for j in path]) for b, path in paths.items()]
    got = slice_deltas(tensors, T, rows)
    want = slice_row_by_row(tensors, T, rows)
    assert len(got) == len(want)
    for d, (start, tokens, parts) in zip(got, want, strict=True):
        assert (d.start, d.tokens) == (start, tokens)
        assert d.tensors.keys() == parts.keys()
        for k, a in parts.items():
            assert d.tensors[k].dtype == np.uint16 and d.tensors[k].shape == a.shape
            assert d.tensors[k].tobytes() == a.tobytes()  # the bits the wire sends, in C order


def test_slice_deltas_of_no_rows():
    assert slice_deltas(every_token(2, 4, torch.float32, torch.Generator().manual_seed(1)), 4, []) == []


def pool_with_rows(paths: list[list[int]]):
    """A pool and one sequence per path, each with 5 committed rows and 8 pending rows of distinct K/V."""
    target = tiny_target(vocab_size=50, max_seq_len=64)
    pool = KVPool(target.cfg, num_blocks=64, block_size=4, device="cpu", dtype=torch.float32)
    caches = []
    for _ in paths:
        c = pool.sequence(32)
        c.reserve(13)
        c.length = 5
        caches.append(c)
    pool.k.copy_(torch.randn(pool.k.shape, generator=torch.Generator().manual_seed(2)))
    pool.v.copy_(-pool.k)
    return pool, caches


def accept_row_by_row(pool, caches, paths) -> None:
    """KVPool.accept as it was: every row's slots listed, the moved ones copied at once."""
    src, dst = [], []
    for c, path in zip(caches, paths, strict=True):
        for s, d in zip(*c.accept_slots(path), strict=True):
            if s != d:
                src.append(s)
                dst.append(d)
    if src:
        pool.copy_slots(torch.tensor(src), torch.tensor(dst))
    for c, path in zip(caches, paths, strict=True):
        c.commit(len(path))


def test_accept_equals_the_row_by_row_accept():
    paths = [[0], [0, 1, 2], [], [0, 2, 3], [0, 1, 2, 3, 4, 5, 6, 7], [1, 4], [0, 1, 5]]
    pool_a, caches_a = pool_with_rows(paths)
    pool_b, caches_b = pool_with_rows(paths)
    pool_a.accept(caches_a, paths)
    accept_row_by_row(pool_b, caches_b, paths)
    assert torch.equal(pool_a.k, pool_b.k) and torch.equal(pool_a.v, pool_b.v)
    assert [(c.length, c.blocks) for c in caches_a] == [(c.length, c.blocks) for c in caches_b]
    assert pool_a.free_blocks == pool_b.free_blocks


# Past the 16 rows written (a prefix and a tree path), not increasing, negative.
@pytest.mark.parametrize("path", [list(range(12)), [0, 2, 11], [0, 0], [1, 0], [-1, 0]])
def test_accept_refuses_what_it_refused(path):
    pool, caches = pool_with_rows([[0], path])
    with pytest.raises(ValueError):
        pool.accept(caches, [[0], path])
    caches[1].release()
    with pytest.raises(RuntimeError, match="released"):
        pool.accept(caches[1:], [[0]])
