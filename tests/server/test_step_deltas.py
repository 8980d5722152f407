"""A step's deltas and VERDICT frames made once for the whole step (issue #44) equal what the per-round path made:
StepDeltas' rows are the row-by-row slices, bit for bit; verdict_frames' payloads are verdict_frame's, byte for
byte, on mixed steps (rows of different sizes, tree rounds, rows of two steps, deltas of no step); the batcher's
deltas on the gathering path are the bits the verifier's own deltas round to; and the batcher finishes rounds that
share a step function in one call, each outcome in its place."""

import threading

import numpy as np
import pytest
import torch
from tiny_models import tiny_moa_drafter, tiny_target

from tether.server import frontend_wire as wire
from tether.server.batcher import RoundBatcher, Together
from tether.server.rounds import verify_batch
from tether.server.step_deltas import RowDelta, StepDeltas
from tether.server.stream_rounds import verdict_frames_of
from tether.server.verifier import SequenceVerifier
from tether.shared.codecs import bf16_bits
from tether.shared.drafter_config import POSITION_AXIS, ArrayDelta
from tether.shared.speculative import DraftTree, Verdict
from tether.shared.wire import Codec


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


def test_verdict_frames_are_verdict_frames_bytes_on_a_mixed_step():
    """Rows of every size, chain and tree rounds, both codecs, rows of two steps interleaved and a delta of no step
    (strided, as a torch delta's bits are): each payload is the one verdict_frame makes for that row alone."""
    rng = np.random.default_rng(7)
    T = 6
    steps = []
    for sizes in ([1, 3, 2, 1, 4], [2, 2, 2]):
        bits = step_bits(len(sizes) * T, rng)
        steps.append(StepDeltas(bits, [(40 + b, [9 + j for j in range(n)], [b * T + j for j in range(n)])
                                       for b, n in enumerate(sizes)]))  # fmt: skip
    loose = ArrayDelta(5, [1, 2], {"lsa": step_bits(8, rng)["lsa"][::4], "tli_k": step_bits(8, rng)["tli_k"][:, 2:4]})
    mixed = [*steps[0].deltas[:3], steps[1].deltas[0], loose, *steps[0].deltas[3:], *steps[1].deltas[1:]]
    rows = []
    for i, d in enumerate(mixed):
        path = tuple(range(1, d.n)) if i % 2 else ()  # a tree round's accepted nodes, the root left out
        codec = Codec.RAW if i % 3 == 0 else Codec.FP16_SHUFFLE_ZSTD
        rows.append((i + 1, d.n - 1, 30 + i, path, d, codec))
    frames = wire.verdict_frames(rows)
    assert [f.payload for f in frames] == [wire.verdict_frame(*row).payload for row in rows]
    # And the front end makes of each the reply the engine would have made in process.
    for f, row in zip(frames, rows, strict=True):
        assert wire.verdict_message(f.payload) == wire.verdict_message(wire.verdict_frame(*row).payload)
    assert wire.verdict_frames([]) == []


def test_verdict_frames_of_fails_a_row_that_cannot_be_framed_alone():
    """One row whose delta no frame can carry (not bfloat16 bits): its outcome is the error, the step's other rows
    are framed as ever."""
    rng = np.random.default_rng(3)
    step = StepDeltas(step_bits(4, rng), [(3, [1], [0]), (8, [2, 3], [1, 2])])
    bad = ArrayDelta(5, [4], {"lsa": np.zeros((1, 12), np.float32)})
    rows = [((1, Codec.RAW, False), (Verdict([0], 1), step.deltas[0])),
            ((2, Codec.RAW, False), (Verdict([0], 4), bad)),
            ((3, Codec.RAW, True), (Verdict([0, 2], 7), step.deltas[1]))]  # fmt: skip
    out = verdict_frames_of(rows)
    assert out[0] == (rows[0][1][0], wire.verdict_frame(1, 0, 1, (), step.deltas[0], Codec.RAW))
    assert isinstance(out[1], Exception)
    assert out[2] == (rows[2][1][0], wire.verdict_frame(3, 1, 7, [2], step.deltas[1], Codec.RAW))


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


def test_rounds_that_share_a_step_function_are_finished_in_one_call(monkeypatch):
    """Together: one call per step with every round that names the step function, in submission order, each
    outcome back to its own round; a per-round finish and a row's own error are left as they were; a step function
    that raises fails its rounds only."""
    from tether.server import batcher as batcher_module

    started, gate = threading.Event(), threading.Event()

    def fake_verify_batch(target, items, host_deltas=False):
        started.set()
        gate.wait(10)  # the first step holds the worker until the others are queued: they share the next step
        return [ValueError(f"bad {v}") if v == 3 else ("verdict", v) for v, _ in items]

    monkeypatch.setattr(batcher_module, "verify_batch", fake_verify_batch)
    calls = []

    def framed(rows):
        calls.append([arg for arg, _ in rows])
        return [("framed", arg, result[1]) for arg, result in rows]

    def broken(rows):
        raise RuntimeError("framing failed")

    tree = DraftTree.chain(0, [])
    b = RoundBatcher(None, max_batch=8, max_tokens=64)
    first = b.submit(0, tree, Together(framed, "a"))
    assert started.wait(10)
    rest = [b.submit(1, tree, Together(framed, "b")), b.submit(2, tree, lambda r: ("alone", r[1])),
            b.submit(3, tree, Together(framed, "c")), b.submit(4, tree, Together(broken, "d")),
            b.submit(5, tree, Together(framed, "e"))]  # fmt: skip
    gate.set()
    b.close()
    assert first.result(10) == ("framed", "a", 0)
    assert rest[0].result(10) == ("framed", "b", 1)
    assert rest[1].result(10) == ("alone", 2)
    with pytest.raises(ValueError, match="bad 3"):
        rest[2].result(10)
    with pytest.raises(RuntimeError, match="framing failed"):
        rest[3].result(10)
    assert rest[4].result(10) == ("framed", "e", 5)
    assert calls == [["a"], ["b", "e"]]  # row 3 failed before its finish; one call for the step's framed rounds
    b.worker.join(10)
