"""Authentication and per-caller limits, as a grpc.aio interceptor in front of every tether.v1.Tether call.

Contract:
- With API keys configured, a Tether call needs `authorization: Bearer KEY` metadata for one of them; otherwise
  it ends UNAUTHENTICATED (REASON_UNAUTHENTICATED) before its handler runs or reads a single request message,
  so nothing a stranger sends is parsed, stored or logged. grpc.health.v1 and reflection stay open (load
  balancers and probes call them without keys).
- The caller's identity, a sha256 of its key ("" without authentication), is `CALLER.get()` inside handlers.
  Identities, never keys, are what sessions are bound to and what logs may show (a prefix). `work_owner()` is
  whose queued model work a call counts against (tether.server.model_work): the identity, or without
  authentication the host of the caller's peer (`PEER`, set here or by the front end that carried the call).
  `http_callers(asgi, keys)` sets the same two for each HTTP request of the OpenAI-compatible API (its bearer key's
  identity, its client's host), so an HTTP client's queued work is bounded like a gRPC caller's, not pooled with
  every other HTTP client's.
- Calls in flight per caller are bounded (`max_calls_per_key`, with authentication), and Session and Generate
  streams over all callers (`max_streams`): past either, a call ends RESOURCE_EXHAUSTED (REASON_CAPACITY, with
  retry advice) at once. Idle streams are the stream handlers' business (tether.server.service).

    server = grpc.aio.server(interceptors=[AuthInterceptor(keys, max_streams=4096)])
"""

from __future__ import annotations

import collections
import contextvars
import hashlib
import hmac
import logging
from collections.abc import Callable

import grpc

from tether.server.errors import Reason, RequestError, status_metadata

CALLER: contextvars.ContextVar[str] = contextvars.ContextVar("tether_caller", default="")
PEER: contextvars.ContextVar[str] = contextvars.ContextVar("tether_peer", default="")  # the caller's host
PROTECTED = "/tether.v1.Tether/"
STREAMS = {PROTECTED + "Session", PROTECTED + "Generate"}  # long-lived calls, bounded over all callers
FULL_RETRY_S = 1.0  # retry advice when the call limits are reached

log = logging.getLogger("tether.server")


def identity(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def peer_host(peer: str) -> str:
    """The host part of a gRPC peer ("ipv4:10.0.0.7:41234" -> "ipv4:10.0.0.7", "ipv6:[::1]:5000" ->
    "ipv6:[::1]"): a client's connections all count as that client. Anything else (a Unix socket) whole."""
    kind, _, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6") and rest.rpartition(":")[0]:
        return f"{kind}:{rest.rpartition(':')[0]}"
    return peer


def work_owner() -> str:
    """Whose queued model work this call counts against: its key's identity, else its host ("host " + PEER)."""
    return CALLER.get() or "host " + PEER.get()


def http_callers(asgi: Callable, api_keys: frozenset[str]) -> Callable:
    """ASGI middleware: each HTTP request runs with CALLER (the identity of a valid bearer key, else "") and PEER
    ("http:" + the client's host) set, as a gRPC call does. Whether the key is valid is the app's to answer (401)."""
    keys = [(k.encode(), identity(k)) for k in api_keys]

    async def app(scope, receive, send):
        if scope["type"] == "http":
            client = scope.get("client")
            PEER.set("http:" + (client[0] if client else "unknown"))
            auth = next((v for k, v in scope.get("headers", ()) if k == b"authorization"), b"")
            key = auth[7:].strip() if auth[:7].lower() == b"bearer " else b""
            CALLER.set(next((ident for k, ident in keys if key and hmac.compare_digest(k, key)), ""))
        await asgi(scope, receive, send)

    return app


class AuthInterceptor(grpc.aio.ServerInterceptor):
    def __init__(
        self,
        api_keys: frozenset[str],
        *,
        max_calls_per_key: int = 512,
        max_streams: int = 4096,
        on_refused: Callable[[RequestError], None] | None = None,
    ):
        # Compared as bytes: hmac.compare_digest refuses str with non-ASCII characters, which callers may send.
        self.keys = [k.encode() for k in api_keys]
        self.max_calls_per_key, self.max_streams = max_calls_per_key, max_streams
        self.on_refused = on_refused  # metrics
        self.calls: collections.Counter[str] = collections.Counter()  # in flight, per identity (event loop only)
        self.streams = 0

    def _caller(self, metadata) -> str | None:
        """The caller's identity, or None when keys are required and it has no valid one."""
        if not self.keys:
            return ""
        auth = next((v for k, v in metadata or () if k == "authorization"), "")
        if isinstance(auth, bytes) or not auth.startswith("Bearer "):
            return None
        key = auth.removeprefix("Bearer ").strip().encode()
        # Every key is compared, so the time taken does not tell which one came close.
        matched = [hmac.compare_digest(key, k) for k in self.keys]
        return identity(key.decode()) if any(matched) else None

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or not details.method.startswith(PROTECTED):
            return handler
        caller = self._caller(details.invocation_metadata)
        if caller is None:
            error = RequestError(Reason.REASON_UNAUTHENTICATED, "missing or unknown API key (authorization: Bearer)")
            return _refusing(handler, error)
        stream = details.method in STREAMS
        if self.keys and self.calls[caller] >= self.max_calls_per_key:
            return _refusing(
                handler,
                RequestError(
                    Reason.REASON_CAPACITY,
                    f"this key has {self.max_calls_per_key} calls in flight",
                    retry_after_s=FULL_RETRY_S,
                ),
            )
        if stream and self.streams >= self.max_streams:
            return _refusing(
                handler,
                RequestError(
                    Reason.REASON_CAPACITY, f"the server holds {self.max_streams} streams", retry_after_s=FULL_RETRY_S
                ),
            )
        return _counted(handler, self, caller, stream)

    def _enter(self, caller: str, stream: bool, context) -> None:
        CALLER.set(caller)
        PEER.set(peer_host(context.peer() or ""))
        self.calls[caller] += 1
        self.streams += stream

    def _exit(self, caller: str, stream: bool) -> None:
        self.calls[caller] -= 1
        if not self.calls[caller]:
            del self.calls[caller]
        self.streams -= stream


def _refusing(handler: grpc.RpcMethodHandler, error: RequestError) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that ends the call with `error` before reading anything."""

    async def abort(request, context):
        await context.abort(error.code, error.message, status_metadata(error))

    async def abort_stream(request, context):
        await context.abort(error.code, error.message, status_metadata(error))
        yield  # an async generator, as a streaming handler must be

    log.info("call refused", extra={"event": "refused", "reason": error.reason_name})
    return _same_kind(handler, abort, abort_stream)


def _counted(handler: grpc.RpcMethodHandler, auth: AuthInterceptor, caller: str, stream: bool):
    """`handler` with the caller's identity set and its call counted while it runs."""
    inner = handler.unary_unary or handler.unary_stream or handler.stream_unary or handler.stream_stream

    async def call(request, context):
        auth._enter(caller, stream, context)
        try:
            return await inner(request, context)
        finally:
            auth._exit(caller, stream)

    async def call_stream(request, context):
        auth._enter(caller, stream, context)
        try:
            async for reply in inner(request, context):
                yield reply
        finally:
            auth._exit(caller, stream)

    return _same_kind(handler, call, call_stream)


def _same_kind(handler: grpc.RpcMethodHandler, unary_reply, streaming_reply) -> grpc.RpcMethodHandler:
    des, ser = handler.request_deserializer, handler.response_serializer
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(unary_reply, des, ser)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(unary_reply, des, ser)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(streaming_reply, des, ser)
    return grpc.stream_stream_rpc_method_handler(streaming_reply, des, ser)
