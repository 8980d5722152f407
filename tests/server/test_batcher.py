"""Batched verification of rounds from many sessions equals verifying each on its own."""

import random
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from tiny_models import tiny_moa_drafter, tiny_target

from tether.server.batcher import RoundBatcher
from tether.server.kv_pool import KVPool
from tether.server.rounds import verify_batch
from tether.server.verifier import SequenceVerifier
from tether.shared.drafter_config import ArrayDelta
from tether.shared.speculative import DraftTree
from tether.shared.wire import bf16_to_f32

VOCAB = 7


def setup():
    target = tiny_target(vocab_size=VOCAB)
    return target, tiny_moa_drafter(target)


def rounds_for(seed: int):
    """A session: a prompt and a few random draft chains (or trees) of different sizes."""
    rng = random.Random(seed)
    prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(3, 20))]
    drafts = [[rng.randrange(VOCAB) for _ in range(rng.randrange(0, 7))] for _ in range(4)]
    return prompt, drafts


def run(target, drafter, seed, batch_fn, pool=None):
    prompt, drafts = rounds_for(seed)
    ver = SequenceVerifier(target, drafter, capacity=64, pool=pool)
    root, _ = ver.open(prompt)
    out = []
    for d in drafts:
        verdict, delta = batch_fn(ver, DraftTree.chain(root, d))
        out.append((verdict.path, verdict.bonus, in_bf16(delta, "lsa"), in_bf16(delta, "tli_k")))
        root = verdict.bonus
    return out


def in_bf16(delta, name: str) -> torch.Tensor:
    """A delta's tensor as the wire carries it, in fp32: the batcher's are bfloat16 bits already (ArrayDelta, made
    for the whole step at once), a verifier's own torch tensors are rounded to bfloat16 as encode_delta rounds."""
    if isinstance(delta, ArrayDelta):
        return torch.from_numpy(bf16_to_f32(delta.tensors[name]))
    return delta.tensors[name].to(torch.bfloat16).float()


def same(a, b):
    assert len(a) == len(b)
    for (pa, ba, la, ka), (pb, bb, lb, kb) in zip(a, b, strict=True):
        assert pa == pb and ba == bb
        # Both in bfloat16, what the wire carries: within one bfloat16 step of each other (as tests/server/test_step).
        torch.testing.assert_close(la, lb, rtol=8e-3, atol=1e-5)
        torch.testing.assert_close(ka, kb, rtol=8e-3, atol=1e-5)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_32_concurrent_sessions_batched_equal_sequential(paged):
    target, drafter = setup()
    # Block size 5: rounds straddle block edges; 32 sessions x <= 44 positions fit in 300 blocks.
    kv = KVPool(target.cfg, num_blocks=300, block_size=5) if paged else None
    sequential = [run(target, drafter, s, lambda v, t: v.verify(t)) for s in range(32)]
    batches = []
    batcher = RoundBatcher(target, window_s=0.05, max_batch=32, on_batch=lambda n, _s: batches.append(n))
    try:
        with ThreadPoolExecutor(32) as pool:
            batched = list(pool.map(lambda s: run(target, drafter, s, lambda v, t: batcher.submit(v, t).result(), kv),
                                    range(32)))  # fmt: skip
    finally:
        batcher.close()
    for a, b in zip(sequential, batched, strict=True):
        same(a, b)
    assert max(batches) > 1  # rounds really were verified together


def test_ragged_trees_in_one_forward_match_single_verification():
    target, drafter = setup()
    tree = DraftTree(tokens=torch.tensor([1, 2, 3, 4, 5]), parents=torch.tensor([-1, 0, 0, 1, 3]))
    vers = [SequenceVerifier(target, drafter, capacity=64) for _ in range(3)]
    singles = [SequenceVerifier(target, drafter, capacity=64) for _ in range(3)]
    items = []
    for i, (v, s) in enumerate(zip(vers, singles, strict=True)):
        prompt = list(range(1, 3 + 4 * i))
        prompt = [t % VOCAB for t in prompt]
        r1, _ = v.open(prompt)
        s.open(prompt)
        items.append((v, tree if i != 1 else DraftTree.chain(r1, [0, 1])))
    batched = verify_batch(target, items)
    for (v, t), s, (verdict, delta) in zip(items, singles, batched, strict=True):
        single_verdict, single_delta = s.verify(t)
        assert verdict.path == single_verdict.path and verdict.bonus == single_verdict.bonus
        torch.testing.assert_close(delta.tensors["lsa"], single_delta.tensors["lsa"], rtol=1e-4, atol=1e-4)
        assert v.length == s.length
        torch.testing.assert_close(v.cache.k[:, :, : v.length], s.cache.k[:, :, : s.length], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_chunked_prefill_equals_one_forward(paged):
    """open() prefills in chunks (here of 5 positions, not a divisor of the prompt): the same first token, the same
    delta for every prompt position, the same cache, and the same verdict after it."""
    target, drafter = setup()
    prompt = [(3 * i + 1) % VOCAB for i in range(23)]
    results = []
    for chunk in (5, 4096):
        kv = KVPool(target.cfg, num_blocks=20, block_size=5) if paged else None
        ver = SequenceVerifier(target, drafter, capacity=64, pool=kv, prefill_chunk=chunk)
        first, delta = ver.open(prompt)
        verdict, after = ver.verify(DraftTree.chain(first, [1, 2, 3]))
        k = ver.cache.rows(0)[0] if paged else ver.cache.k[0, 0, : ver.length]
        results.append((first, delta, verdict, after, k))
    (f1, d1, v1, a1, k1), (f2, d2, v2, a2, k2) = results
    assert f1 == f2 and v1.path == v2.path and v1.bonus == v2.bonus
    assert d1.start == d2.start and d1.tokens == d2.tokens == prompt
    for name in d2.tensors:
        torch.testing.assert_close(d1.tensors[name], d2.tensors[name], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(a1.tensors[name], a2.tensors[name], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k1, k2, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="prefill_chunk"):
        SequenceVerifier(target, drafter, capacity=64, prefill_chunk=0)


def test_continuous_batching_takes_what_waits_oldest_first_within_the_step_shape(monkeypatch):
    """While a step runs, rounds queue; the next step takes every waiting round that fits (rows x largest tree, to a
    power of two, <= max_tokens), oldest first; one left out is first in the step after; close() finishes them all."""
    from tether.server import batcher as batcher_module

    started, gate, steps = threading.Event(), threading.Event(), []

    def fake_verify_batch(target, items, host_deltas=False):
        steps.append([len(t) for _, t in items])
        started.set()
        gate.wait(10)  # the first step holds the worker until every later round is queued
        return [("done", v) for v, _ in items]

    monkeypatch.setattr(batcher_module, "verify_batch", fake_verify_batch)
    b = RoundBatcher(None, max_batch=4, max_tokens=32)
    tree = lambda n: DraftTree.chain(0, [0] * (n - 1))  # noqa: E731
    futures = [b.submit(0, tree(2))]
    assert started.wait(10)  # the worker has taken the first round into its step
    futures += [b.submit(i, tree(n)) for i, n in enumerate([2, 2, 2, 16, 2, 2], start=1)]
    b.close()
    gate.set()
    assert [f.result(10) for f in futures] == [("done", i) for i in range(7)]
    # 3 x 2 tokens fit; 16 would make 4 x 16 = 64 > 32; then 16 + 2 (2 x 16 = 32); then the last 2.
    assert steps == [[2], [2, 2, 2], [16, 2], [2]]


def test_rounds_submitted_from_a_loop_are_settled_there_a_step_at_a_time(monkeypatch):
    """submit_here: each round's asyncio Future gets its outcome (finish's result, or the exception of its row or of
    its finish) on the loop that submitted it, in one call per step; the concurrent Future has the same outcome; a
    Future its awaiter cancelled is left alone."""
    import asyncio

    from tether.server import batcher as batcher_module

    started, gate = threading.Event(), threading.Event()

    def fake_verify_batch(target, items, host_deltas=False):
        started.set()
        gate.wait(10)  # the first step holds the worker until every other round is queued: they share the next step
        return [ValueError(f"bad {v}") if v == 2 else ("done", v) for v, _ in items]

    monkeypatch.setattr(batcher_module, "verify_batch", fake_verify_batch)
    calls = []
    real_deliver = batcher_module._deliver
    monkeypatch.setattr(
        batcher_module, "_deliver", lambda outcomes: (calls.append(len(outcomes)), real_deliver(outcomes))
    )

    def finish(result):
        if result[1] == 3:
            raise RuntimeError("encoding failed")
        return ("finished",) + result

    async def main():
        b = RoundBatcher(None, max_batch=8, max_tokens=64)
        first = b.submit_here(0, DraftTree.chain(0, []), finish)
        assert started.wait(10)  # the worker has taken round 0 into a step of its own
        rest = [b.submit_here(i, DraftTree.chain(0, []), finish) for i in range(1, 5)]
        rest[-1][1].cancel()  # its client went away
        gate.set()
        b.close()
        assert await first[1] == ("finished", "done", 0)
        assert await rest[0][1] == ("finished", "done", 1)
        with pytest.raises(ValueError, match="bad 2"):
            await rest[1][1]
        with pytest.raises(RuntimeError, match="encoding failed"):
            await rest[2][1]
        assert rest[3][0].result(10) == ("finished", "done", 4) and rest[3][1].cancelled()
        assert rest[2][0].exception(10) is not None
        b.worker.join(10)

    asyncio.run(main())
    assert calls == [1, 4]  # round 0's step, then the other four's, one call each


def test_a_step_is_finished_before_the_next_step_starts(monkeypatch):
    """The worker encodes a step's replies itself before it takes the next step, so rounds that arrive meanwhile
    wait and join one larger step instead of a step each (the back-pressure that lets batches grow when the host
    is the bound). Round 0's finish waits for a second step to begin; it must give up waiting, not see one."""
    from tether.server import batcher as batcher_module

    log, started, second = [], threading.Event(), threading.Event()

    def fake_verify_batch(target, items, host_deltas=False):
        log.append(("step", [v for v, _ in items]))
        if len(log) > 1:
            second.set()
        started.set()
        return [("done", v) for v, _ in items]

    def finish(result):
        if result[1] == 0:
            assert rest_queued.wait(10)
            second.wait(1.0)  # bounded: a separate finishing thread would see the next step start here
        log.append(("finish", result[1]))
        return result

    monkeypatch.setattr(batcher_module, "verify_batch", fake_verify_batch)
    rest_queued = threading.Event()
    b = RoundBatcher(None, max_batch=8, max_tokens=64)
    first = b.submit(0, DraftTree.chain(0, []), finish)
    assert started.wait(10)
    rest = [b.submit(i, DraftTree.chain(0, []), finish) for i in range(1, 4)]
    rest_queued.set()
    assert [f.result(10) for f in [first, *rest]] == [("done", i) for i in range(4)]
    b.close()
    b.worker.join(10)
    assert log == [("step", [0]), ("finish", 0), ("step", [1, 2, 3]), ("finish", 1), ("finish", 2), ("finish", 3)]
