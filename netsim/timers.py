"""Event loops whose timers fire on time: the proxy's latency and bandwidth are timers, so their precision is the
link's.

Why: on Linux asyncio waits in epoll_wait, whose timeout counts whole milliseconds, rounded up. A timer due in 10
microseconds fires after ~1.1 ms, one due in 5.3 ms after ~6.2. The proxy sleeps twice a chunk (its latency, then
its serialization time under a bandwidth cap, often a few microseconds), so a link set to a 10 ms round trip took
~12-13 ms, and the extra counted against whatever ran over it (bench/link.py's round trip "overhead").

Contract: `new_event_loop()` is asyncio.new_event_loop() with a selector that waits with microsecond timeouts:
before a timed wait, it waits on the epoll descriptor itself with select() (microseconds), and epoll then only
collects what is ready. Where the platform selector is not epoll (kqueue takes a timespec already), it is asyncio's
loop unchanged, and past select()'s FD_SETSIZE the wait is epoll's own. Events, ordering and everything
else about the loop are asyncio's own; only how long a timed wait lasts changes.

    loop = timers.new_event_loop()           # NetSimThread's loop
    asyncio.Runner(loop_factory=timers.new_event_loop).run(main())   # the CLI's

Measured by bench/netsim_rtt.py (round trips through the proxy against what the link was set to).
"""

from __future__ import annotations

import asyncio
import select
import selectors

FD_SETSIZE = 1024  # select()'s limit on descriptor numbers (glibc)


class MicrosecondEpollSelector(getattr(selectors, "EpollSelector", selectors.DefaultSelector)):
    """epoll, waiting out a timeout in microseconds first (epoll_wait counts milliseconds, rounding up)."""

    def select(self, timeout: float | None = None):
        if timeout is not None and timeout > 0 and self.fileno() < FD_SETSIZE:
            # The epoll descriptor is readable once epoll holds a ready event; select() returns then, or at the
            # timeout, or on a signal (which asyncio's wake-up descriptor makes an event anyway).
            select.select([self.fileno()], [], [], timeout)
            timeout = 0
        return super().select(timeout)


def uses_microseconds() -> bool:
    """Whether new_event_loop() waits in microseconds here (Linux: epoll); elsewhere it is asyncio's own loop."""
    epoll = getattr(selectors, "EpollSelector", None)
    return epoll is not None and selectors.DefaultSelector is epoll


def new_event_loop() -> asyncio.AbstractEventLoop:
    """An event loop for the proxy: asyncio's selector loop with timers precise to tens of microseconds on Linux."""
    if not uses_microseconds():
        return asyncio.new_event_loop()
    return asyncio.SelectorEventLoop(MicrosecondEpollSelector())
