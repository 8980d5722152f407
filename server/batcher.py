"""The round scheduler: rounds from many sessions that arrive within a short window run as one target forward.

Contract:
- `RoundBatcher(target, window_s, max_batch, max_tokens)`: `submit(verifier, tree, finish=None)` returns a
  Future of the round's (verdict, delta), or of `finish((verdict, delta))` when given: the service's encoding of
  the reply, run on the worker thread straight after the step, before it takes the next one. `submit_here(...)`,
  called on an event loop, also returns an asyncio Future that the worker settles with the rest of its step in
  one call on that loop. Finishing on the worker, not on a thread of its own, is what lets batches grow under
  load: the server's host work shares one GIL, and a finishing thread competing with the worker for it had the
  worker start a step for every few rounds that arrived, each step's fixed host cost paid again (on the H200 at
  128 clients: 11 rounds a step and 2,000 rounds/s, against 63 and 3,650 finished here).
  The worker runs continuous batching, as vLLM's scheduler does per iteration: whenever it is
  free it takes every round waiting, oldest first, as long as the step stays within `max_batch` rows and
  `max_tokens` rows x tokens (the largest step bucket), and verifies them as one step
  (tether.server.rounds.verify_batch, deltas in host memory for the encoder); rounds arriving meanwhile join the
  next step, and a round left out is first in the next. `window_s` > 0 waits that long for more rounds before
  each step. If the batch as a whole fails, each round is verified on its own, so one bad round fails alone.
  A round whose Future was cancelled before the worker took it for a step (its caller went away:
  tether.server.model_work) is dropped there and never reaches the model; once taken it runs to the step's end.
- A `finish` is a callable of one round's (verdict, delta), or `Together(step_finish, arg)`: the rounds of a step
  whose finishes share `step_finish` are finished by one call, `step_finish([(arg, (verdict, delta)), ...])`,
  which returns each round's outcome (its reply, or the Exception that is its error) in order. A front end's
  VERDICT frames are made this way for the whole step (tether.server.frontend_wire.verdict_frames): what a round
  costs the batcher's thread beyond its share of the step is what cannot be shared.
- `warm_up(target, pool, drafter=None)`: every kernel variant and step graph a server needs, run once before it
  listens.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from tether.server.round_ticket import RoundTicket
from tether.server.rounds import verify_batch
from tether.server.step import StepConfig
from tether.server.verifier import SequenceVerifier
from tether.shared.model import Transformer
from tether.shared.speculative import DraftTree


@torch.inference_mode()
def warm_up(
    target: Transformer, pool, sizes: tuple[int, ...] = (1, 4, 8, 16, 32), absorb_max: int = 64, drafter=None
) -> None:
    """Run every kernel variant a server will need once, so Triton compiles (and autotunes) them before the first
    client instead of inside its open or round deadline (a compile there costs seconds: an outage on a healthy
    link). Covered, for short and split-K contexts: prefills with and without a cached prefix; batched verify
    rounds of every tile class in `sizes` (chains and a branching tree), each sequence alone and all together
    (one split or several); the same trees verified one sequence at a time (the batcher's fallback); and a
    resync's absorb, a causal chain of up to `absorb_max` offline tokens. tests/kernels/test_kernel_variants.py
    checks that a session launches nothing else. With the served `drafter`, the rounds are the batcher's own
    (host deltas), so the drafter's server part is captured beside each step graph they use too."""
    vocab, room = target.cfg.vocab_size, target.cfg.max_seq_len
    grow = 2 * max(*sizes, absorb_max) + 2
    lens = [n for n in (24, 600) if n + grow <= room]  # 600: past moda_backend's VERIFY_MIN_PREFIX
    vers = [SequenceVerifier(target, drafter, capacity=n + grow, pool=pool) for n in lens]
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
                    verify_batch(target, batch, host_deltas=True)
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


StepFinish = Callable[[list[tuple[Any, tuple]]], list[Any]]  # [(arg, (verdict, delta))] -> each round's outcome


@dataclass(frozen=True, slots=True)
class Together:
    """A round's finish made with the other rounds of its step that have the same `step` (see the module's
    contract); `arg` is what this round adds to it."""

    step: StepFinish
    arg: Any


Finish = Callable[[tuple], Any] | Together


class RoundBatcher:
    def __init__(
        self,
        target: Transformer,
        *,
        window_s: float = 0.0,
        max_batch: int = 128,
        max_tokens: int = StepConfig.max_bucket_tokens,
        on_batch=None,
    ):
        self.target, self.window_s = target, window_s  # window_s: extra wait for more rounds before a step
        self.max_batch = max_batch  # rounds per step at most
        self.max_tokens = max_tokens  # rows x the largest tree (to a power of two) per step at most: a step bucket
        self.on_batch = on_batch  # called with each batch's size and its seconds on this thread (metrics)
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._next: collections.deque = collections.deque()  # taken from the inbox, left for the next step
        self.worker = threading.Thread(target=self._run, name="tether-batcher", daemon=True)
        self.worker.start()

    def submit(self, verifier: SequenceVerifier, tree: DraftTree, finish: Finish | None = None) -> Future:
        fut: Future = Future()
        self.inbox.put((verifier, tree, (fut, finish, None)))
        return fut

    def submit_here(
        self, verifier: SequenceVerifier, tree: DraftTree, finish: Finish | None = None
    ) -> tuple[Future, asyncio.Future]:
        """`submit` from a coroutine: the same Future (done when the worker threads are through with the verifier)
        and an asyncio Future of this event loop with the same outcome. The worker settles the asyncio Futures of
        one step's rounds on their loop in one call, where a wrapped Future wakes the loop once per round (a pipe
        write on this thread and a read on the loop's, for every round)."""
        fut: Future = Future()
        here = asyncio.get_running_loop().create_future()
        self.inbox.put((verifier, tree, (fut, finish, (here.get_loop(), functools.partial(_settle_future, here)))))
        return fut, here

    def submit_to(
        self,
        verifier: SequenceVerifier,
        tree: DraftTree,
        finish: Finish | None,
        loop: asyncio.AbstractEventLoop,
        answer: Callable[[Any], None],
    ) -> RoundTicket:
        """`submit` for a caller on `loop` that is no coroutine (a round taken from its frame): `answer(outcome)`
        runs on that loop with the rest of the step's, the outcome being `finish`'s result or the exception
        raised. The handle is a RoundTicket, not a Future: the outcome travels through `answer` alone. A round
        cancelled before its step (through the ticket) is never answered."""
        ticket = RoundTicket()
        self.inbox.put((verifier, tree, (ticket, finish, (loop, answer))))
        return ticket

    def close(self) -> None:
        self.inbox.put(None)

    def _fits(self, rows: int, longest: int) -> bool:
        """Whether a step of `rows` rounds, the largest of `longest` tokens, stays within one step bucket."""
        return rows <= self.max_batch and rows * (1 << (longest - 1).bit_length()) <= self.max_tokens

    def _take(self, timeout: float | None):
        """The oldest round not yet verified (None: closing); waits up to `timeout` (None: forever, 0: not at all)."""
        if self._next:
            return self._next.popleft()
        if timeout == 0:
            return self.inbox.get_nowait()
        return self.inbox.get(timeout=timeout)

    def _batch(self, first) -> tuple[list, bool]:
        """`first` and every round already waiting that fits one step with it, oldest first (continuous batching:
        a round that arrives while a step runs joins the next step), each marked running as it is taken, those
        cancelled meanwhile dropped. Returns the batch and whether close() came."""
        batch, longest = [first], len(first[1])
        deadline = time.monotonic() + self.window_s
        while True:
            try:
                item = self._take(max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                return batch, False
            if item is None:
                return batch, True
            grown = max(longest, len(item[1]))
            if not self._fits(len(batch) + 1, grown):
                self._next.appendleft(item)
                return batch, False
            if _taken(item):
                batch.append(item)
                longest = grown

    def _run(self) -> None:
        closing = False
        while not closing or self._next:
            first = self._take(None)
            if first is None:
                closing = True
                continue
            if not _taken(first):
                continue
            batch, closed = self._batch(first)
            closing = closing or closed
            t0 = time.perf_counter()
            try:
                results = verify_batch(self.target, [(v, t) for v, t, _ in batch], host_deltas=True)
                if self.on_batch:
                    self.on_batch(len(batch), time.perf_counter() - t0)
            except Exception:
                # Nothing was committed: verify each on its own so one bad round fails alone.
                results = []
                for v, t, _ in batch:
                    try:
                        results.append(v.verify(t))
                    except Exception as e:
                        results.append(e)
            _finish([(done, result) for (_, _, done), result in zip(batch, results, strict=True)])


def _taken(item) -> bool:
    """Marks a waiting round as running; False (drop it) when its caller cancelled it first."""
    return item[2][0].set_running_or_notify_cancel()


def _finish(step: list) -> None:
    """A step's rounds, finished and answered in order (their futures' results or errors); the outcomes for each
    event loop delivered in one call on it."""
    outcomes = [result for _, result in step]
    together: dict[StepFinish, list[int]] = {}
    for i, ((_, finish, _), result) in enumerate(step):
        if finish is None or isinstance(result, Exception):
            continue
        if type(finish) is Together:
            together.setdefault(finish.step, []).append(i)
            continue
        try:
            outcomes[i] = finish(result)
        except Exception as e:
            outcomes[i] = e
    for step_finish, rows in together.items():
        try:
            made = step_finish([(step[i][0][1].arg, step[i][1]) for i in rows])
        except Exception as e:
            made = [e] * len(rows)
        for i, outcome in zip(rows, made, strict=True):
            outcomes[i] = outcome
    settle: dict[asyncio.AbstractEventLoop, list] = {}
    for ((fut, _, on_loop), _), result in zip(step, outcomes, strict=True):
        if type(fut) is RoundTicket:
            fut.settle()
        elif isinstance(result, Exception):
            fut.set_exception(result)
        else:
            fut.set_result(result)
        if on_loop is not None:
            loop, deliver = on_loop
            settle.setdefault(loop, []).append((deliver, result))
    for loop, outcomes_here in settle.items():
        try:
            loop.call_soon_threadsafe(_deliver, outcomes_here)
        except RuntimeError:  # the loop has closed: nobody is waiting any more
            pass


def _deliver(outcomes: list[tuple[Callable[[Any], None], Any]]) -> None:
    """On the loop: each round's outcome to whoever waits for it there."""
    for deliver, result in outcomes:
        deliver(result)


def _settle_future(here: asyncio.Future, result: Any) -> None:
    """An asyncio Future's outcome (an exception is raised to its awaiter), unless it was cancelled."""
    if here.cancelled():
        return
    if isinstance(result, Exception):
        here.set_exception(result)
    else:
        here.set_result(result)
