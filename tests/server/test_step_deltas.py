"""A step's deltas made once for the whole step (issue #44) equal what the per-round path made: StepDeltas' rows
are the row-by-row slices, bit for bit, and the batcher's deltas on the gathering path are the bits the verifier's
own deltas round to."""

import numpy as np
import pytest
import torch
from tiny_models import tiny_moa_drafter, tiny_target

from tether.server.rounds import verify_batch
from tether.server.step_deltas import RowDelta, StepDeltas
from tether.server.verifier import SequenceVerifier
from tether.shared.codecs import bf16_bits
from tether.shared.drafter_config import POSITION_AXIS, ArrayDelta
from tether.shared.speculative import DraftTree


def step_bits(P: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """A MoA server part's tensors over P positions, as bfloat16 bits (lsa: axis 0; tli_k / tli_v: axis 1)."""
    return {
        "lsa": rng.integers(0, 1 << 16, (P, 12), dtype=np.uint16),
        "tli_k": rng.integers(0, 1 << 16, (3, P, 2, 4), dtype=np.uint16),
        "tli_v": rng.integers(0, 1 << 16, (3, P, 2, 4), dtype=np.uint16),
    }


def row_by_row(bits: dict[str, np.ndarray], positions: list[int]) -> dict[str, np.ndarray]:
    """A row's tensors as the per-round path took them: one take per tensor."""
    return {k: np.take(a, positions, axis=POSITION_AXIS[k]) for k, a in bits.items()}


@pytest.mark.parametrize("sizes", [[1, 1, 1, 1], [3, 3], [1, 4, 2, 1, 6], [5]])
def test_step_deltas_rows_are_the_row_by_row_slices(sizes):
    rng = np.random.default_rng(len(sizes))
    T = 8
    bits = step_bits(len(sizes) * T, rng)
    # Each row's accepted positions: a chain prefix for some rows, a tree path with gaps for others.
    rows = []
    for b, n in enumerate(sizes):
        path = list(range(n)) if b % 2 == 0 else sorted(rng.choice(T, n, replace=False).tolist())
        rows.append((17 * b + 3, [100 + b + j for j in range(n)], [b * T + j for j in path]))
    step = StepDeltas(bits, rows)
    for k in bits:
        flat, ends = step.row_bits(k)
        assert len(ends) == len(rows) + 1 and ends[-1] == len(flat)
    for i, (d, (start, tokens, positions)) in enumerate(zip(step.deltas, rows, strict=True)):
        assert isinstance(d, ArrayDelta) and (d.start, d.tokens, d.n) == (start, tokens, len(tokens))
        want = row_by_row(bits, positions)
        assert d.tensors.keys() == want.keys()
        for k, a in want.items():
            assert d.tensors[k].shape == a.shape and d.tensors[k].dtype == np.uint16
            assert d.tensors[k].tobytes() == a.tobytes()
            flat, ends = step.row_bits(k)
            assert flat[ends[i] : ends[i + 1]] == a.tobytes()  # the bits a VERDICT frame carries, in C order


def test_the_batchers_deltas_on_the_gathering_path_are_the_verifiers_own_rounded():
    """verify_batch with host deltas (the batcher's) returns rows of one StepDeltas whose bits are exactly the
    bfloat16 bits of the deltas the same rounds give without (torch tensors, converted per round before): the wire's
    bytes do not change."""
    target = tiny_target(vocab_size=7)
    drafter = tiny_moa_drafter(target)
    trees = [DraftTree.chain(1, [2, 3]), DraftTree(torch.tensor([4, 5, 6, 0]), torch.tensor([-1, 0, 0, 2])),
             DraftTree.chain(0, [])]  # fmt: skip
    got = []
    for host in (False, True):
        vers = [SequenceVerifier(target, drafter, capacity=64) for _ in trees]
        for i, v in enumerate(vers):
            v.open([(3 * j + i) % 7 for j in range(5 + 3 * i)])
        got.append(verify_batch(target, list(zip(vers, trees, strict=True)), host_deltas=host))
    for (v1, d1), (v2, d2) in zip(*got, strict=True):
        assert (v1.path, v1.bonus) == (v2.path, v2.bonus)
        assert type(d2) is RowDelta and (d2.start, d2.tokens) == (d1.start, d1.tokens)
        for k, t in d1.tensors.items():
            assert d2.tensors[k].tobytes() == bf16_bits(t).tobytes()
