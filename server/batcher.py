"""The round scheduler: rounds from many sessions that arrive within a short window run as one target forward.

Contract:
- `RoundBatcher(target, window_s, max_batch)`: `submit(verifier, tree)` returns a Future; a worker thread takes the
  first waiting round, gathers whatever else arrives within `window_s` (up to `max_batch`), and verifies them as
  one batch (tether.server.rounds.verify_batch, deltas in host memory for the encoder). If the batch as a whole
  fails, each round is verified on its own, so one bad round fails alone.
- `warm_up(target, pool)`: every kernel variant and step graph a server needs, run once before it listens.
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future

import torch

from tether.server.rounds import verify_batch
from tether.server.verifier import SequenceVerifier
from tether.shared.model import Transformer
from tether.shared.speculative import DraftTree


@torch.inference_mode()
def warm_up(target: Transformer, pool, sizes: tuple[int, ...] = (1, 4, 8, 16, 32), absorb_max: int = 64) -> None:
    """Run every kernel variant a server will need once, so Triton compiles (and autotunes) them before the first
    client instead of inside its open or round deadline (a compile there costs seconds: an outage on a healthy
    link). Covered, for short and split-K contexts: prefills with and without a cached prefix; batched verify
    rounds of every tile class in `sizes` (chains and a branching tree), each sequence alone and all together
    (one split or several); the same trees verified one sequence at a time (the batcher's fallback); and a
    resync's absorb, a causal chain of up to `absorb_max` offline tokens. tests/kernels/test_kernel_variants.py
    checks that a session launches nothing else."""
    vocab, room = target.cfg.vocab_size, target.cfg.max_seq_len
    grow = 2 * max(*sizes, absorb_max) + 2
    lens = [n for n in (24, 600) if n + grow <= room]  # 600: past moda_backend's VERIFY_MIN_PREFIX
    vers = [SequenceVerifier(target, None, capacity=n + grow, pool=pool) for n in lens]
    try:
        for v, n in zip(vers, lens, strict=True):
            v.open([(7 * i + 1) % vocab for i in range(n)])
        for n in sizes if vers else ():
            tree = DraftTree(
                tokens=torch.arange(n) % vocab, parents=torch.arange(n) // 2 - (torch.arange(n) == 0).long()
            )
            chain = DraftTree.chain(1 % vocab, [i % vocab for i in range(n - 1)])
            for t in (chain, tree):
                for batch in [[(v, t)] for v in vers] + [[(v, t) for v in vers]]:
                    verify_batch(target, batch)
                    for v, n0 in zip(vers, lens, strict=True):
                        v.cache.truncate(n0)
                for v, n0 in zip(vers, lens, strict=True):
                    v.verify(t)
                    v.cache.truncate(n0)
        for n in sorted({*sizes, absorb_max}) if vers else ():
            for v, n0 in zip(vers, lens, strict=True):
                v.absorb(n0, [i % vocab for i in range(n)], rewind=False)
                v.cache.truncate(n0)
    finally:
        for v in vers:
            v.release()


class RoundBatcher:
    def __init__(self, target: Transformer, *, window_s: float = 0.002, max_batch: int = 32, on_batch=None):
        self.target, self.window_s, self.max_batch = target, window_s, max_batch
        self.on_batch = on_batch  # called with each batch's size (metrics)
        self.inbox: queue.Queue = queue.Queue()
        self.worker = threading.Thread(target=self._run, name="tether-batcher", daemon=True)
        self.worker.start()

    def submit(self, verifier: SequenceVerifier, tree: DraftTree) -> Future:
        fut: Future = Future()
        self.inbox.put((verifier, tree, fut))
        return fut

    def close(self) -> None:
        self.inbox.put(None)

    def _run(self) -> None:
        while (first := self.inbox.get()) is not None:
            batch = [first]
            deadline = time.monotonic() + self.window_s
            while len(batch) < self.max_batch:
                try:
                    item = self.inbox.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                if item is None:
                    self.inbox.put(None)  # stop after this batch
                    break
                batch.append(item)
            if self.on_batch:
                self.on_batch(len(batch))
            try:
                results = verify_batch(self.target, [(v, t) for v, t, _ in batch], host_deltas=True)
            except Exception:
                # Nothing was committed: verify each on its own so one bad round fails alone.
                for v, t, fut in batch:
                    try:
                        fut.set_result(v.verify(t))
                    except Exception as e:
                        fut.set_exception(e)
                continue
            for (_, _, fut), result in zip(batch, results, strict=True):
                if isinstance(result, Exception):
                    fut.set_exception(result)
                else:
                    fut.set_result(result)
