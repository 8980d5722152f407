"""The client's end of the wire: channels, one Session stream, and what the server's refusals mean to the session.

Contract:
- `open_channel(address, keepalive_s=..., tls_ca=...)`: keepalive pings to notice dead links, prompt reconnects
  (the session's own backoff paces attempts), TLS or mTLS when certificates are given.
- `SessionStream(stub, metadata)`: one Session stream whose replies a reader thread queues, so `request` can wait
  with a deadline; a missing reply, a broken or closed stream raise LinkDown (or what the status says).
- The exceptions the session loop acts on, chosen by `refused` from the typed reason first and the status code
  second, never from the message: ServerBusy (the server is full: back off as advised, draft alone, retry),
  SessionLost (resync with the full history), LinkDown (an outage), BadMessage (a message the client refused:
  a lost round), ServerError (a refusal retrying will not fix).

    stream = SessionStream(stub, metadata)
    reply = stream.request(pb.ClientMessage(round=...), timeout=5.0)
"""

from __future__ import annotations

import queue
import threading
from pathlib import Path

import grpc

from tether.client.errors import ServerDataError
from tether.client.refusals import LOST, Refusal
from tether.v1 import tether_pb2 as pb


class LinkDown(Exception):
    """The server did not answer in time, or the connection broke."""


class ServerBusy(LinkDown):
    """The server is full right now (sessions, KV memory, streams, this key's quota): like an outage, the client
    drafts alone and tries again, after at least `retry_after_s` (the server's advice)."""

    def __init__(self, refusal: Refusal):
        super().__init__(f"server busy ({refusal.reason_name}): {refusal.message}")
        self.retry_after_s = refusal.retry_after_s


class SessionLost(Exception):
    """The server no longer holds the session (restart, eviction, lease): resync with the full history."""


class BadMessage(ServerDataError, LinkDown):
    """A message from the server the client refused (a KV delta or verdict the session does not allow): the round
    or resync is lost as if the link had dropped, so the client drafts alone and resyncs later."""


class ServerError(RuntimeError):
    """The server refused a request for a reason reconnecting will not fix."""

    def __init__(self, code: int | grpc.StatusCode, message: str, reason: int = pb.REASON_UNSPECIFIED):
        name = code.name if isinstance(code, grpc.StatusCode) else _code_name(code)
        super().__init__(f"{name}: {message}")
        self.code = name
        self.reason = reason  # a tether.v1.ErrorReason value


def _code_name(value: int) -> str:
    return next((c.name for c in grpc.StatusCode if c.value[0] == value), str(value))


_TRANSIENT = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
              grpc.StatusCode.ABORTED, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}  # fmt: skip


def refused(r: Refusal) -> Exception:
    """The exception the session loop acts on for a refusal: by its reason first, then by its status code."""
    if r.retryable:
        return ServerBusy(r)
    if r.reason in LOST or r.code == grpc.StatusCode.NOT_FOUND:
        return SessionLost(r.message)
    if r.code in _TRANSIENT:
        return LinkDown(f"{r.code.name}: {r.message}")
    return ServerError(r.code, r.message, r.reason)


def rpc_error(e: grpc.RpcError) -> Exception:
    return refused(Refusal.of_rpc_error(e))


class SessionStream:
    """One Session stream; replies are read by a thread so a round can wait with a deadline."""

    def __init__(self, stub, metadata: tuple):
        self.outbox: queue.Queue = queue.Queue()
        self.inbox: queue.Queue = queue.Queue()
        self.call = stub.Session(iter(self.outbox.get, None), metadata=metadata)
        threading.Thread(target=self._read, daemon=True, name="tether-stream").start()

    def _read(self) -> None:
        try:
            for msg in self.call:
                self.inbox.put(msg)
            self.inbox.put(LinkDown("the server closed the stream"))
        except grpc.RpcError as e:
            self.inbox.put(rpc_error(e))

    def request(self, msg: pb.ClientMessage, timeout: float) -> pb.ServerMessage:
        self.outbox.put(msg)
        return self.receive(timeout)

    def receive(self, timeout: float) -> pb.ServerMessage:
        try:
            reply = self.inbox.get(timeout=timeout)
        except queue.Empty:
            raise LinkDown(f"no answer within {timeout:.1f} s") from None
        if isinstance(reply, Exception):
            raise reply
        return reply

    def close(self) -> None:
        self.outbox.put(None)
        self.call.cancel()


def open_channel(address: str, *, keepalive_s: float, tls_ca: str = "", tls_cert: str = "", tls_key: str = ""):
    """A channel to `address`: our keepalive and reconnect pacing, TLS when `tls_ca` is given (mTLS with a client
    certificate and key)."""
    ms = int(keepalive_s * 1000)
    options = [
        ("grpc.keepalive_time_ms", ms),
        ("grpc.keepalive_timeout_ms", max(1000, ms // 2)),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        # Reconnect promptly once the link is back; our own backoff paces the attempts.
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1000),
        ("grpc.max_receive_message_length", 64 << 20),
        ("grpc.enable_retries", 0),
    ]
    if not tls_ca:
        return grpc.insecure_channel(address, options=options)
    ca = Path(tls_ca).read_bytes()
    key = Path(tls_key).read_bytes() if tls_key else None
    cert = Path(tls_cert).read_bytes() if tls_cert else None
    return grpc.secure_channel(address, grpc.ssl_channel_credentials(ca, key, cert), options=options)
