"""A Session stream's idle limit, kept by one timer per stream rather than one per message.

Contract: `IdleWatch(idle_s)` is made inside the stream's handler task. The handler brackets each wait for the
client's next message with `reading()` / `read()`; once the stream has waited `idle_s` seconds in one read, the
watch cancels the handler task, and `expired(error)` tells the handler that this cancellation was the watch's (the
task's cancel is then withdrawn) rather than the client going away. `close()` stops the timer.

Why not `asyncio.timeout` around each read: that creates, schedules and cancels a timer per message, ~5-10 us each
on a busy server's one event loop (BENCHMARKS.md, "Where a round's host time goes"), where a stream's timer here is
re-armed at most once per `idle_s`.

    watch = IdleWatch(120.0)
    try:
        watch.reading(); message = await anext(messages); watch.read()
    except asyncio.CancelledError:
        if not watch.expired(): raise
        ...  # answer REASON_STREAM_IDLE
    finally:
        watch.close()
"""

from __future__ import annotations

import asyncio


class IdleWatch:
    def __init__(self, idle_s: float):
        self.idle_s = idle_s
        self.loop = asyncio.get_running_loop()
        self.task = asyncio.current_task()
        self.since: float | None = None  # when the read in progress began; None between reads
        self.fired = False
        self.timer = self.loop.call_later(idle_s, self._check)

    def reading(self) -> None:
        self.since = self.loop.time()

    def read(self) -> None:
        self.since = None

    def _check(self) -> None:
        now = self.loop.time()
        if self.since is not None and now - self.since >= self.idle_s:
            self.fired = True
            self.task.cancel()
            return
        # Not reading, or reading for less than the limit: look again when this read would reach it.
        self.timer = self.loop.call_at((self.since if self.since is not None else now) + self.idle_s, self._check)

    def expired(self) -> bool:
        """Whether the cancellation being handled is this watch's; if so it is withdrawn from the task."""
        if not self.fired:
            return False
        self.task.uncancel()
        return True

    def close(self) -> None:
        self.timer.cancel()
