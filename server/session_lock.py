"""A session's hold, taken in order by its handlers, and without waiting by a round started from its frame.

Why not asyncio.Lock: a round taken straight from a front end's frame (tether.server.call_inbox) starts from a plain
callback on the event loop, not from a coroutine, so it must take a free session at once or leave the message to the
stream's handler; asyncio.Lock offers no such acquire.

Contract (everything on one event loop, as asyncio.Lock):
- `await lock.acquire()` waits its turn, first come first served; `release()` hands the hold straight to the oldest
  waiter still waiting, so a `try_acquire()` never takes a session from under a handler that was waiting for it.
- `try_acquire()` takes the lock if nobody holds it and returns whether it did.
- A waiter cancelled after the hold was handed to it passes it on (no hold is ever lost).

    lock = SessionLock()
    await lock.acquire(); ...; lock.release()
    if lock.try_acquire(): ...; lock.release()
"""

from __future__ import annotations

import asyncio
import collections


class SessionLock:
    def __init__(self):
        self._held = False
        self._waiters: collections.deque[asyncio.Future] = collections.deque()  # oldest first

    def locked(self) -> bool:
        return self._held

    def try_acquire(self) -> bool:
        if self._held:
            return False
        self._held = True
        return True

    async def acquire(self) -> None:
        if self.try_acquire():
            return
        turn = asyncio.get_running_loop().create_future()
        self._waiters.append(turn)
        try:
            await turn  # release() hands the hold over with this result: it stays held throughout
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():
                self.release()  # handed over as this waiter was cancelled: the next one gets it
            else:
                self._waiters.remove(turn)
            raise

    def release(self) -> None:
        if not self._held:
            raise RuntimeError("SessionLock released while not held")
        while self._waiters:
            turn = self._waiters.popleft()
            if not turn.done():
                turn.set_result(None)
                return
        self._held = False
