"""What keeps the HTTP API's connections from taking the process down: a cap on open connections derived from the
file-handle limit, a deadline on every request's head, and logs of repeated errors rate-limited.

Why: uvicorn closes idle keep-alive connections but never one that is half-way through sending a request, and
accepts connections until the process runs out of file handles; the gRPC server on the same process then cannot
accept or dial, and asyncio logs a traceback for every failed accept. So:
- `connection_cap(configured)`: at most `configured` connections, and at most half the file handles the process
  has left (RLIMIT_NOFILE's soft limit minus those open now): the other half stays for gRPC, model files and logs.
- `ConnectionGuard(cap, head_timeout_s)` and `guarded_protocol(guard)`: uvicorn's h11 protocol with two guards. A
  connection past the cap is answered 503 (Retry-After) and closed as soon as it is accepted, so its handle goes
  back at once. A connection must complete each request's head (request line and headers, at most h11's 16 KiB)
  within `head_timeout_s` of starting to wait for it (when it opened, or when its last response ended): otherwise
  it gets 408 and is closed. Bodies are the app's to time (tether.shared.openai_app reads them under a deadline);
  an idle keep-alive connection is uvicorn's to close (timeout_keep_alive). A connection closed with data still
  unsent (a client that stopped reading) is aborted `close_grace_s` later: asyncio's close() would wait for the
  client to read it, holding the handle for as long as the client likes.
- `RateLimitedLog(logger, window_s)`: the first record of each kind per window, then one line saying how many
  were left out. `install_loop_error_log(loop, logger)` routes an event loop's unhandled errors (failed accepts
  among them) through one, as one line each without the traceback, unless the loop has a handler already;
  `limit_logger(name)` does the same for a library's logger (uvicorn's warnings per malformed request).

    guard = ConnectionGuard(connection_cap(1024), head_timeout_s=10)
    config = uvicorn.Config(app, http=guarded_protocol(guard), timeout_keep_alive=5)
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Hashable

from uvicorn.protocols.http.h11_impl import H11Protocol


def _response(status: str, kind: str, code: str, message: str, extra: str = "") -> bytes:
    """A whole HTTP/1.1 response with OpenAI's error body, written before any h11 state exists (or is needed)."""
    body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()
    head = (
        f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\n{extra}Connection: close\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


_BUSY = _response(
    "503 Service Unavailable",
    "server_error",
    "overloaded",
    "too many connections; try again shortly",
    "Retry-After: 1\r\n",
)
_TIMEOUT = _response(
    "408 Request Timeout", "invalid_request_error", "request_timeout", "the request's head did not arrive in time"
)


def connection_cap(configured: int) -> int:
    """At most `configured`, and at most half of the file handles this process has left (see the docstring)."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):
        return configured
    if soft == resource.RLIM_INFINITY:
        return configured
    return max(1, min(configured, (soft - _open_handles()) // 2))


def _open_handles() -> int:
    for where in ("/proc/self/fd", "/dev/fd"):
        try:
            return len(os.listdir(where))
        except OSError:
            continue
    return 0


class RateLimitedLog:
    """Logs the first record of each key per `window_s`; later ones only count, and the next record logged for
    that key says how many were left out (thread-safe)."""

    def __init__(self, logger: logging.Logger, window_s: float = 10.0, clock: Callable[[], float] = time.monotonic):
        self.logger, self.window_s, self.clock = logger, window_s, clock
        self._lock = threading.Lock()
        self._seen: dict[Hashable, tuple[float, int]] = {}  # key -> (when its window opened, records left out)
        self.suppressed = 0  # records left out, over all keys

    def admit(self, key: Hashable) -> int | None:
        """None: leave this record out; else it opens a window, and the number is how many the last one left out."""
        now = self.clock()
        with self._lock:
            opened, left_out = self._seen.get(key, (None, 0))
            if opened is not None and now - opened < self.window_s:
                self._seen[key] = (opened, left_out + 1)
                self.suppressed += 1
                return None
            if len(self._seen) >= 1024:  # keys come from errors' messages: bounded, oldest windows first
                self._seen.pop(next(iter(self._seen)))
            self._seen[key] = (now, 0)
        return left_out

    def log(self, level: int, key: Hashable, message: str, *args) -> bool:
        """True when the record was written."""
        left_out = self.admit(key)
        if left_out is None:
            return False
        if left_out:
            message, args = message + " (and %d more like it in the %.0f s before)", (*args, left_out, self.window_s)
        self.logger.log(level, message, *args)
        return True


def install_loop_error_log(loop: asyncio.AbstractEventLoop, logger: logging.Logger) -> None:
    """`loop`'s unhandled errors as rate-limited one-line records (see the module docstring)."""
    if loop.get_exception_handler() is not None:
        return
    limited = RateLimitedLog(logger)

    def handler(_loop: asyncio.AbstractEventLoop, context: dict) -> None:
        error = context.get("exception")
        message = context.get("message") or "unhandled error in the event loop"
        cause = f"{type(error).__name__}: {error}" if error is not None else ""
        limited.log(logging.ERROR, (message, type(error)), "%s %s", message, cause)

    loop.set_exception_handler(handler)


class _RateFilter(logging.Filter):
    def __init__(self, window_s: float):
        super().__init__()
        self.limited = RateLimitedLog(logging.getLogger("tether.http"), window_s)

    def filter(self, record: logging.LogRecord) -> bool:
        return self.limited.admit(str(record.msg)) is not None


def limit_logger(name: str, window_s: float = 10.0) -> None:
    """At most one record of each message per `window_s` from logger `name` (idempotent)."""
    logger = logging.getLogger(name)
    if not any(isinstance(f, _RateFilter) for f in logger.filters):
        logger.addFilter(_RateFilter(window_s))


class ConnectionGuard:
    """The open connections of one HTTP server, their cap and the head deadline (event loop only)."""

    def __init__(self, cap: int, head_timeout_s: float, log: logging.Logger | None = None, close_grace_s: float = 10):
        self.cap, self.head_timeout_s, self.close_grace_s = cap, head_timeout_s, close_grace_s
        self.open = 0  # connections held now
        self.refused = 0  # connections closed at once for being past the cap
        self.timed_out = 0  # connections closed for a head that did not arrive in time
        self._log = RateLimitedLog(log or logging.getLogger("tether.http"))

    def refuse(self) -> None:
        self.refused += 1
        self._log.log(logging.WARNING, "cap", "HTTP connection refused: %d open, the cap is %d", self.open, self.cap)

    def timeout(self) -> None:
        self.timed_out += 1
        self._log.log(logging.INFO, "head", "HTTP connection closed: no request head within %g s", self.head_timeout_s)


class _ClosingTransport:
    """A transport as uvicorn sees it, whose close() becomes an abort if the connection has not ended
    `guard.close_grace_s` later (data the client does not read keeps it open otherwise)."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop, guard: ConnectionGuard):
        self._transport, self._loop, self._guard = transport, loop, guard
        self._abort: asyncio.TimerHandle | None = None

    def close(self) -> None:
        self._transport.close()
        if self._abort is None:  # abort() of a transport already gone does nothing
            self._abort = self._loop.call_later(self._guard.close_grace_s, self._transport.abort)

    def __getattr__(self, name: str):
        return getattr(self._transport, name)


def guarded_protocol(guard: ConnectionGuard) -> type[H11Protocol]:
    """uvicorn's h11 protocol under `guard` (see the module docstring)."""

    class GuardedH11Protocol(H11Protocol):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            self._head_timer: asyncio.TimerHandle | None = None
            self._refused = guard.open >= guard.cap
            if self._refused:
                guard.refuse()
                transport.write(_BUSY)
                transport.close()
                return
            guard.open += 1
            super().connection_made(_ClosingTransport(transport, self.loop, guard))  # type: ignore[arg-type]
            self._await_head()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._refused:
                return
            guard.open -= 1
            self._cancel_head()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            cycle = self.cycle
            super().data_received(data)
            if self.cycle is not cycle:  # a request's head is complete
                self._cancel_head()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
                self._await_head()  # keep-alive: the next request's head has a deadline too

        def _await_head(self) -> None:
            self._cancel_head()
            self._head_timer = self.loop.call_later(guard.head_timeout_s, self._head_late, self.cycle)

        def _cancel_head(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_late(self, cycle) -> None:
            self._head_timer = None
            if self.cycle is cycle and not self.transport.is_closing():
                guard.timeout()
                self.transport.write(_TIMEOUT)
                self.transport.close()

    return GuardedH11Protocol
