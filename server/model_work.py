"""Work a call hands to the model threads or to the batcher: dropped once its caller has gone, bounded per caller,
waited for when the server stops.

Why: a call's model work used to run whatever became of the call. A client could queue rebuilds (a Resync with the
history: a prefill of up to thousands of positions each) with a deadline of milliseconds and leave, and the model
threads then spent minutes on prefills nobody waited for while live callers queued behind them.

Contract (`ModelWork(threads, max_per_caller)`, one per service; everything but the threads on its event loop):
- `submit(fn, *args, stoppable=False)` queues fn(*args) for a model thread and returns its Future. It is counted
  against the calling caller (tether.server.auth.work_owner: its key's identity, or without authentication its
  peer's host) until it ends; a caller with `max_per_caller` calls already waiting for or holding a model thread is
  refused before anything is queued: RequestError(REASON_CAPACITY, retry advice). With `stoppable`, fn is also
  given `stop=`, a callable that turns true once the caller has gone (a prefill asks it between chunks:
  tether.server.verifier.SequenceVerifier.open).
- `wait(work, claim=None, here=None)` awaits work from `submit` or a batcher round (`here`: the round's asyncio
  Future, tether.server.batcher.RoundBatcher.submit_here). If the call is cancelled meanwhile (its client cancelled,
  its deadline passed, its stream or front end closed), the work is cancelled too: work not yet started never
  starts (a model thread and the batcher both take work through concurrent.futures.Future's
  `set_running_or_notify_cancel`), so its claim on a session is released at once (a session that claim created,
  never answered, is retired with its KV: tether.server.sessions.Claim). Work already running keeps the session
  claimed until it ends; a stoppable one ends at its next check.
- A caller that is no coroutine (a round taken from its frame) uses `track(work)` for what `wait` does on the
  way in, and `drop(work, claim)` for what it does when its caller goes away; its work is a batcher round's
  RoundTicket (tether.server.round_ticket), which these take as they take a Future.
- `stop_work()` waits for everything handed over (the server is stopping); `close()` ends the threads.

    work = ModelWork(threads=2, max_per_caller=128)
    first, delta = await work.wait(work.submit(verifier.open, prompt, stoppable=True), claim)
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import functools
import threading
from collections.abc import Callable
from typing import Any

from tether.server.auth import work_owner
from tether.server.errors import Reason, RequestError
from tether.server.round_ticket import RoundTicket
from tether.server.sessions import Claim

Work = concurrent.futures.Future | RoundTicket  # what track, drop and stop_work take

QUEUE_RETRY_S = 1.0  # retry advice to a caller over its queued model work (a prefill takes up to about a second)


class ModelWork:
    def __init__(self, threads: int, max_per_caller: int):
        if threads < 1 or max_per_caller < 1:
            raise ValueError(f"model work needs a thread and room for a call ({threads=}, {max_per_caller=})")
        self.max_per_caller = max_per_caller
        self.executor = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="tether-model")
        self._lock = threading.Lock()  # the done callbacks run on the model threads
        self._inflight: set[Work] = set()  # handed over, not ended (waited for at stop)
        self._per_caller: collections.Counter[str] = collections.Counter()  # submitted, not ended
        self._gone: dict[concurrent.futures.Future, threading.Event] = {}  # a stoppable job's stop signal

    def queued(self, owner: str) -> int:
        """How many calls of `owner` wait for or hold a model thread."""
        with self._lock:
            return self._per_caller[owner]

    def submit(self, fn: Callable, *args, stoppable: bool = False) -> concurrent.futures.Future:
        owner = work_owner()
        with self._lock:
            if self._per_caller[owner] >= self.max_per_caller:
                raise RequestError(
                    Reason.REASON_CAPACITY,
                    f"this caller has {self.max_per_caller} calls waiting for the model",
                    retry_after_s=QUEUE_RETRY_S,
                )
            self._per_caller[owner] += 1
        gone = threading.Event()
        job = functools.partial(fn, *args, stop=gone.is_set) if stoppable else functools.partial(fn, *args)
        try:
            work = self.executor.submit(job)
        except BaseException:
            self._ended(owner, None)
            raise
        if stoppable:
            with self._lock:
                self._gone[work] = gone
        work.add_done_callback(functools.partial(self._ended, owner))
        return work

    def _ended(self, owner: str, work: concurrent.futures.Future | None) -> None:
        with self._lock:
            self._per_caller[owner] -= 1
            if not self._per_caller[owner]:
                del self._per_caller[owner]
            self._gone.pop(work, None)

    async def wait(
        self, work: concurrent.futures.Future, claim: Claim | None = None, here: asyncio.Future | None = None
    ) -> Any:
        """The result of `work` (from `here`, its outcome on this loop, when the batcher gave one)."""
        self.track(work)
        # A wrapped Future is shielded (cancelling it would cancel `work` from the loop's side, after the fact);
        # `here` is this call's own: cancelling it only tells the batcher nobody waits for it any more.
        result = asyncio.wrap_future(work) if here is None else here
        try:
            return await (asyncio.shield(result) if here is None else here)
        except asyncio.CancelledError:
            result.add_done_callback(lambda f: f.cancelled() or f.exception())  # nobody awaits it now: no warning
            self.drop(work, claim)
            raise

    def drop(self, work: Work, claim: Claim | None = None) -> None:
        """Its caller has gone: `work` never starts if it has not (a stoppable job is told to stop), and `claim` is
        released at once if it never started, else when it ends."""
        self._caller_gone(work)
        if claim is not None:
            claim.hand_over(work)

    def _caller_gone(self, work: Work) -> None:
        """Drop `work` if it has not started; tell it to stop if it is stoppable and has."""
        if work.cancel():
            return
        with self._lock:
            gone = self._gone.get(work)
        if gone is not None:
            gone.set()

    def told_to_stop(self) -> int:
        """How many running stoppable jobs have been told that their caller has gone (each stops at its next check)."""
        with self._lock:
            return sum(gone.is_set() for gone in self._gone.values())

    def track(self, work: Work) -> None:
        """Count `work` handed over until it ends (stop_work waits for it); `wait` does this itself."""
        with self._lock:
            self._inflight.add(work)
        work.add_done_callback(self._untrack)

    def _untrack(self, work: Work) -> None:
        with self._lock:
            self._inflight.discard(work)

    def stop_work(self) -> None:
        with self._lock:
            pending = list(self._inflight)
        concurrent.futures.wait([w for w in pending if isinstance(w, concurrent.futures.Future)])
        for ticket in pending:
            if isinstance(ticket, RoundTicket):
                ticket.wait()

    def close(self, wait: bool = True) -> None:
        self.executor.shutdown(wait=wait)
