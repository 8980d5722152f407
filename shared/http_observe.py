"""What the HTTP API says about each request: one log line, an observer's metrics, and a 500 in one line for a bug.

Contract:
- `RequestRecord`: one request's facts, filled in as it goes (the route fills the generation's): method, path,
  status, prompt and completion tokens, time to first token, duration, and `session` (the response's id,
  `chatcmpl-...` / `cmpl-...`, that a client sees; empty for requests that generated nothing).
- `HttpObserver` (a Protocol): `observe(record)` once per request when it has ended (streams: when the stream
  ends). tether.server.metrics implements it with Prometheus series; the edge has none.
- `Observed(app, observer, log)` wraps an ASGI app: it puts the record in the scope (`record_of(scope)`), takes the
  status from the response, and when the app returns (or raises, or is cancelled by a disconnect) writes one INFO
  line `METHOD PATH STATUS ...` with the record's fields as structured `extra` (event "http_request") and calls
  the observer. An exception the app lets out is a bug: one ERROR line (its type and message; the traceback at
  DEBUG), and a 500 in OpenAI's shape if the response had not started. `path_label(path)` maps paths onto the
  routes' few names for metric labels (anything else is "other": a label per path would grow without bound).

    asgi = Observed(starlette_app, observer, logging.getLogger("tether.http"))
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import Protocol

ROUTES = ("/health", "/v1/models", "/v1/completions", "/v1/chat/completions")
_SCOPE_KEY = "tether.record"
_INTERNAL = json.dumps(
    {"error": {"message": "internal server error", "type": "server_error", "param": None, "code": "internal_error"}}
).encode()


@dataclass
class RequestRecord:
    method: str
    path: str
    started: float = field(default_factory=time.perf_counter)
    status: int = 0  # 0 until the response starts (a client that went away first: logged as 499)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    ttft_s: float | None = None  # from the request's arrival to its first generated token
    duration_s: float = 0.0
    session: str = ""  # the response's id, when it generated

    def first_token(self) -> None:
        if self.ttft_s is None:
            self.ttft_s = time.perf_counter() - self.started


class HttpObserver(Protocol):
    def observe(self, record: RequestRecord) -> None: ...


def path_label(path: str) -> str:
    if path in ROUTES:
        return path
    return "/v1/models/{model}" if path.startswith("/v1/models/") else "other"


def record_of(scope: dict) -> RequestRecord | None:
    return scope.get(_SCOPE_KEY)


class Observed:
    """An ASGI app wrapped with a record, a log line and an observer per request (see the module docstring)."""

    def __init__(self, app, observer: HttpObserver | None, log: logging.Logger):
        self.app, self.observer, self.log = app, observer, log

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        record = RequestRecord(scope["method"], scope["path"])
        scope[_SCOPE_KEY] = record

        async def sending(message) -> None:
            if message["type"] == "http.response.start":
                record.status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except Exception as e:
            self.log.error(
                "internal error in %s %s: %s: %s",
                record.method,
                path_label(record.path),
                type(e).__name__,
                " ".join(str(e).split())[:300],
            )
            self.log.debug("the internal error's traceback", exc_info=True)
            if record.status == 0:
                await sending(
                    {
                        "type": "http.response.start",
                        "status": 500,
                        "headers": [
                            (b"content-type", b"application/json"),
                            (b"content-length", str(len(_INTERNAL)).encode()),
                        ],
                    }
                )
                await send({"type": "http.response.body", "body": _INTERNAL})
        finally:
            self._ended(record)

    def _ended(self, record: RequestRecord) -> None:
        record.duration_s = time.perf_counter() - record.started
        record.status = record.status or 499
        ttft = f"{record.ttft_s * 1e3:.1f}" if record.ttft_s is not None else "-"
        self.log.info(
            "%s %s %d %d+%d tokens ttft %s ms %.1f ms %s",
            record.method,
            record.path,
            record.status,
            record.prompt_tokens,
            record.completion_tokens,
            ttft,
            record.duration_s * 1e3,
            record.session or "-",
            extra={
                "event": "http_request",
                "method": record.method,
                "path": record.path,
                "status": record.status,
                "prompt_tokens": record.prompt_tokens,
                "completion_tokens": record.completion_tokens,
                "ttft_ms": None if record.ttft_s is None else round(record.ttft_s * 1e3, 1),
                "duration_ms": round(record.duration_s * 1e3, 1),
                "session": record.session,
            },
        )
        if self.observer is not None:
            try:
                self.observer.observe(record)
            except Exception as e:  # metrics must never fail a request
                self.log.error("HTTP metrics: %s: %s", type(e).__name__, e)
