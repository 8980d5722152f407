"""One step's KV deltas on the host, gathered once for the whole step: each round's delta is a view of it.

Why: the batcher's thread holds the engine's one GIL for every round it answers (issue #44). A delta made row by
row (a fancy index, a dict, a dataclass, and for a front end's VERDICT frame a copy of each strided tensor) cost
microseconds a round there. Here every tensor is gathered once for the step, in the order the rows' own C-order
bits follow each other: a row's tensor is then a contiguous slice, and its bits in a VERDICT frame one slice of
one `tobytes` of the step (tether.server.frontend_wire.verdict_frames).

Contract:
- `StepDeltas(bits, rows)`: `bits` {name: uint16 array of bfloat16 bits, a position axis (POSITION_AXIS[name])
  holding every position the step computed}; `rows` [(start, tokens, positions)]: each row's sequence position,
  its emitted tokens, and the indices along that axis of its delta's positions, in order. `deltas[i]` is row i's
  delta, a RowDelta: an ArrayDelta (what encode_delta and verdict_frame take) whose tensors are C-contiguous views
  of the step's `flat` arrays; `flat[name]` is every row's tensor in C order, one after another, row i's from
  `offsets[name][i]` (in elements).
- Bits only (tether.shared.codecs.bf16_bits makes them of a tensor): no torch here.

    step = StepDeltas({"lsa": lsa_bits, "tli_k": k_bits}, [(17, [5, 9], [0, 1]), (40, [3], [6])])
    step.deltas[1].tensors["tli_k"]   # [N, 1, Hkv, D], a view of step.flat["tli_k"]
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import numpy as np

from tether.shared.drafter_config import POSITION_AXIS, ArrayDelta


class RowDelta(ArrayDelta):
    """One row of a StepDeltas: start, tokens, and its tensors as views of the step's (made when read)."""

    def __init__(self, step: StepDeltas, row: int, start: int, tokens: list[int]):
        self.step, self.row, self.start, self.tokens = step, row, start, tokens

    @property
    def tensors(self) -> dict[str, np.ndarray]:  # type: ignore[override]
        return self.step.tensors_of(self.row)


class StepDeltas:
    def __init__(self, bits: dict[str, np.ndarray], rows: Sequence[tuple[int, list[int], Sequence[int]]]):
        R = len(rows)
        self.sizes = np.fromiter((len(pos) for _, _, pos in rows), np.int64, R)  # [R]
        at = np.fromiter((p for _, _, pos in rows for p in pos), np.int64, int(self.sizes.sum()))  # [P]
        self.first = np.zeros(R, np.int64)  # [R]: where each row's positions begin among the step's P
        np.cumsum(self.sizes[:-1], out=self.first[1:])
        # Every row's positions, gathered once per tensor (positions on their own axis): [..., P, ...]
        self.picked = {name: a.take(at, axis=POSITION_AXIS.get(name, 0)) for name, a in bits.items()}
        self.deltas = [RowDelta(self, i, start, tokens) for i, (start, tokens, _) in enumerate(rows)]
        self._orders: dict[int, np.ndarray] = {}

    def tensors_of(self, row: int) -> dict[str, np.ndarray]:
        """Row `row`'s tensors: views of the step's, its positions on each tensor's axis."""
        f = int(self.first[row])
        span = slice(f, f + int(self.sizes[row]))
        return {name: a[(slice(None),) * POSITION_AXIS.get(name, 0) + (span,)] for name, a in self.picked.items()}

    def row_bits(self, name: str) -> tuple[bytes, list[int]]:
        """Tensor `name` of every row, each in its own C order, one after another: (the bytes, row i's first byte
        at [i], the end at [R]). One copy for the step: of `picked` itself where the rows are runs of it in C order
        (its positions axis leads), else through one gather of its rows in that order (`_row_order`)."""
        a = self.picked[name]
        axis = POSITION_AXIS.get(name, 0)
        per_position = a.itemsize * (a.size // max(a.shape[axis], 1))  # bytes of one position of one row
        sizes = self.sizes.tolist()
        ends = list(itertools.accumulate((n * per_position for n in sizes), initial=0))
        if axis == 0 or all(a.shape[i] == 1 for i in range(axis)):
            return a.tobytes(), ends
        A = math.prod(a.shape[:axis])
        grid = a.reshape(A * a.shape[axis], -1)  # [(a, position), rest]
        return grid[self._row_order(A)].tobytes(), ends

    def _row_order(self, A: int) -> np.ndarray:
        """The rows of a [A, P] grid (a leading index, a position) in the order the rows' own C orders follow each
        other: by row, then a, then position. [A * P]"""
        order = self._orders.get(A)
        if order is None:
            row_of = np.repeat(np.arange(len(self.sizes)), self.sizes)  # [P]
            key = row_of[None, :] * A + np.arange(A)[:, None]  # [A, P]: a stable sort keeps positions in order
            order = self._orders[A] = np.argsort(key.ravel(), kind="stable")
        return order
