"""A round's handle for a caller that is no coroutine (a round taken from its frame): the part of
concurrent.futures.Future that the batcher, ModelWork and a session's Claim use, at a fraction of its cost.

Why: a round taken from its frame made a concurrent Future (a Condition, a waiter list and a callback list), was
tracked through two of its done callbacks, and was settled under its Condition: about a tenth of the engine's event
loop and batcher time a round (issue #44), for a handle whose only uses are "never start me", "I have started" and
"tell these when I end".

Contract (a `RoundTicket` is made on the event loop, started and settled on the batcher's thread):
- `set_running_or_notify_cancel()`: True and running, or False if `cancel()` came first (the batcher drops it).
- `cancel()`: True if the round had not started (it never will), False once it has.
- `settle()`: the round has ended (its outcome travels apart: RoundBatcher.submit_to's `answer`); the done callbacks
  run, in the order they were added, on the settling thread; one added after that runs at once.
- `wait()`: blocks until it is settled or cancelled (ModelWork.stop_work, at the server's stop).
One lock for all tickets: each hold is a few bytecodes, and the two threads that take it rarely meet.

    ticket = RoundTicket()
    ticket.add_done_callback(lambda t: release())
    if ticket.set_running_or_notify_cancel(): ...; ticket.settle()
"""

from __future__ import annotations

import threading
from collections.abc import Callable

_LOCK = threading.Lock()
_WAITING, _RUNNING, _ENDED = 0, 1, 2  # _ENDED: settled or cancelled


class RoundTicket:
    __slots__ = ("_state", "_callbacks", "_ended")

    def __init__(self) -> None:
        self._state = _WAITING
        self._callbacks: list[Callable[[RoundTicket], None]] | None = None
        self._ended: threading.Event | None = None  # made only for a wait()

    def set_running_or_notify_cancel(self) -> bool:
        with _LOCK:
            if self._state != _WAITING:
                return False
            self._state = _RUNNING
            return True

    def cancel(self) -> bool:
        with _LOCK:
            if self._state != _WAITING:
                return False
            self._state = _ENDED
        self._run_callbacks()
        return True

    def settle(self) -> None:
        with _LOCK:
            self._state = _ENDED
        self._run_callbacks()

    def done(self) -> bool:
        return self._state == _ENDED

    def add_done_callback(self, fn: Callable[[RoundTicket], None]) -> None:
        with _LOCK:
            if self._state != _ENDED:
                if self._callbacks is None:
                    self._callbacks = []
                self._callbacks.append(fn)
                return
        fn(self)

    def wait(self) -> None:
        with _LOCK:
            if self._state == _ENDED:
                return
            if self._ended is None:
                self._ended = threading.Event()
            ended = self._ended
        ended.wait()

    def _run_callbacks(self) -> None:
        with _LOCK:
            callbacks, self._callbacks = self._callbacks, None
            ended = self._ended
        for fn in callbacks or ():
            fn(self)
        if ended is not None:
            ended.set()
