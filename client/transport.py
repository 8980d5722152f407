"""The client's end of the wire: the replicas it talks to, one Session stream, what the server's refusals mean to the
session, and the one backoff policy every retry follows.

Contract:
- `open_channel(address, keepalive_s=..., tls_ca=...)`: keepalive pings to notice dead links, prompt reconnects
  (the session's own backoff paces attempts), TLS or mTLS when certificates are given.
- `Replicas(server, first, keepalive_s=..., tls_ca=...)`: the endpoints of a `--server` list (HOST:PORT, comma
  separated) and the channel and stub of the one in use, number `first` modulo their count to begin with (the
  session passes its affinity key, which spreads clients over the list); `failover()` moves to the next.
- `SessionStream(stub, metadata)`: one Session stream whose replies a reader thread queues, stamped with their
  arrival time, so `request` (or `send`, then `receive`) can wait with a deadline; a missing reply, a broken or
  closed stream raise LinkDown (or what the status says), and an inline Error what `refused` makes of it.
- The exceptions the session loop acts on, chosen by `refused` from the typed reason first and the status code
  second, never from the message: ServerBusy (the server is full: back off as advised, draft alone, retry),
  SessionLost (resync with the full history; SessionFull: the session has no room left, so forget it first),
  LinkDown (an outage), BadMessage (a message the client refused: a lost round), ServerError (a refusal retrying
  will not fix; FormatNotOffered: the server does not stream the client part in the form this client drafts with).
  `typed(e)` maps any failed call to one of them. Those of an outage carry a `cause` (tether.client.outage.Cause,
  from the status and reason too): what a user reads, gRPC's own text staying in the message for the debug log.
- `first_contact(call, backoff, address=, tls=, deadline=)`: a command's first call (GetModelInfo), retried until
  `deadline` while a server may still be starting. On its first UNAVAILABLE the address is looked at (`diagnose`:
  the socket's errno and the first bytes that answer, never gRPC's message text): something that is not a gRPC
  server, or a TLS / plaintext mismatch, ends it at once as `Unreachable` with its `Hint`; nothing listening is
  retried and ends so at the deadline; a gRPC server without tether's service (UNIMPLEMENTED) ends it at once.
  `Unreachable` is a ServerError whose text is one line a user can act on.
- `Backoff(initial_s, max_s, jitter, rng)`: exponential backoff with jitter, or the server's retry advice when that
  is longer. `wait(error)` is the next pause, `failed(error)` that pause with the delay doubled (up to max_s) for
  the one after, `reset()` starts over; `retry(call, ...)` calls until it returns, pausing after each transient
  failure, within a number of attempts or a deadline. The connect loop, the weight download and the reconnect
  path all use it; `fresh()` gives a second run of the same policy over the same random stream. A download (the
  client part, a server's tokenizer) is retried DOWNLOAD_ATTEMPTS times in a row, each resuming where the cache
  stops.

    stream = SessionStream(stub, metadata)
    reply = stream.request(pb.ClientMessage(round=...), timeout=5.0)
    info = Backoff(0.2, 5.0, 0.2, random.Random(0)).retry(lambda: stub.GetModelInfo(req), deadline=t0 + 10)

Tests: tests/client/test_transport.py (Backoff, diagnose against a closed port, an HTTP/1.1 listener and TLS /
plaintext gRPC servers), tests/e2e (test_chaos, test_capacity, test_failover),
tests/client/test_hostile_server.py.
"""

from __future__ import annotations

import queue
import random
import re
import socket
import ssl
import threading
import time
from collections.abc import Callable, Collection
from enum import StrEnum
from pathlib import Path
from typing import TypeVar

import grpc

from tether.client.errors import ServerDataError
from tether.client.outage import Cause
from tether.client.refusals import LOST, Refusal
from tether.v1 import tether_pb2 as pb
from tether.v1 import tether_pb2_grpc

T = TypeVar("T")
DOWNLOAD_ATTEMPTS = 20  # a download a flaky link breaks resumes where the cache stops, this many times in a row


class LinkDown(Exception):
    """The server did not answer in time, or the connection broke; `cause` says which, for people
    (tether.client.outage), and `waited_s` how long a stalled reply was waited for."""

    cause = Cause.FAILED
    waited_s = 0.0

    def __init__(self, *args: object, cause: Cause | None = None, waited_s: float = 0.0):
        super().__init__(*args)
        if cause is not None:
            self.cause = cause
        self.waited_s = waited_s


class ServerBusy(LinkDown):
    """The server is full right now (sessions, KV memory, streams, this key's quota): like an outage, the client
    drafts alone and tries again, after at least `retry_after_s` (the server's advice)."""

    cause = Cause.BUSY

    def __init__(self, refusal: Refusal):
        super().__init__(f"server busy ({refusal.reason_name}): {refusal.message}")
        self.retry_after_s = refusal.retry_after_s


class SessionLost(Exception):
    """The server no longer holds the session (restart, eviction, lease): resync with the full history."""

    cause = Cause.SESSION_LOST


class SessionFull(SessionLost):
    """The server's session has no room left (REASON_SESSION_FULL: a chat past the server's max_new_tokens): the
    client forgets it and resyncs, which rebuilds a session from the full history."""

    cause = Cause.SESSION_FULL


class BadMessage(ServerDataError, LinkDown):
    """A message from the server the client refused (a KV delta or verdict the session does not allow): the round
    or resync is lost as if the link had dropped, so the client drafts alone and resyncs later."""

    cause = Cause.INVALID


class ServerError(RuntimeError):
    """The server refused a request for a reason reconnecting will not fix."""

    def __init__(self, code: int | grpc.StatusCode, message: str, reason: int = pb.REASON_UNSPECIFIED):
        name = code.name if isinstance(code, grpc.StatusCode) else _code_name(code)
        super().__init__(f"{name}: {message}")
        self.code = name
        self.reason = reason  # a tether.v1.ErrorReason value


class FormatNotOffered(ServerError):
    """The server does not stream the client part in the form this client drafts with (an ONNX precision an older
    server, or one without the export, does not list in ModelInfo.client_part_formats)."""

    def __init__(self, message: str):
        super().__init__(grpc.StatusCode.FAILED_PRECONDITION, message)


class Hint(StrEnum):
    """What answers at a server's address when the first call cannot reach it (`diagnose`)."""

    UNRESOLVED = "unresolved"  # the host name does not resolve
    NOTHING_LISTENING = "nothing listening"  # the connection is refused: no server on that port (yet)
    NOT_GRPC = "not gRPC"  # something answers that speaks neither HTTP/2 nor TLS: an HTTP/1 server, another service
    TLS_SERVER = "TLS server"  # the client dialled plaintext, the server speaks TLS
    PLAINTEXT_SERVER = "plaintext server"  # the client dialled TLS, the server speaks plaintext HTTP/2
    CERTIFICATE = "certificate"  # TLS both ways, and the handshake still fails: the CA, host name or client cert
    NOT_TETHER = "not tether"  # a gRPC server without tether.v1.Tether (UNIMPLEMENTED)


_ADVICE = {
    Hint.UNRESOLVED: "{a}: the host name does not resolve",
    Hint.NOTHING_LISTENING: "nothing is listening at {a} (connection refused): is tether-server running, and on "
    "that port?",
    Hint.NOT_GRPC: "{a} answers, but not with gRPC (an HTTP server?): check --server's port (tether-server's gRPC "
    "port, 50051 unless told otherwise, not its --http-port)",
    Hint.TLS_SERVER: "{a} speaks TLS and this client dialled it in plaintext: pass --tls-ca (the CA that signed the "
    "server's certificate)",
    Hint.PLAINTEXT_SERVER: "{a} speaks plaintext and this client dialled it with TLS: leave out --tls-ca (or serve "
    "with --tls-cert and --tls-key)",
    Hint.CERTIFICATE: "the TLS handshake with {a} fails: its certificate is not signed by --tls-ca or not issued to "
    "that host name, or it wants a client certificate (--tls-cert, --tls-key)",
    Hint.NOT_TETHER: "{a} is a gRPC server, but not tether-server (it does not serve tether.v1.Tether)",
}


class Unreachable(ServerError):
    """The server could not be reached at the start; `hint` says what answers at `address` instead."""

    def __init__(self, address: str, hint: Hint):
        super().__init__(grpc.StatusCode.UNAVAILABLE, _ADVICE[hint].format(a=address))
        self.address, self.hint = address, hint

    def __str__(self) -> str:
        return _ADVICE[self.hint].format(a=self.address)


def _code_name(value: int) -> str:
    return next((c.name for c in grpc.StatusCode if c.value[0] == value), str(value))


_TRANSIENT = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNKNOWN,
}
_CAUSES = {grpc.StatusCode.UNAVAILABLE: Cause.UNREACHABLE, grpc.StatusCode.DEADLINE_EXCEEDED: Cause.STALLED}


def refused(r: Refusal) -> Exception:
    """The exception the session loop acts on for a refusal: by its reason first, then by its status code."""
    if r.retryable:
        return ServerBusy(r)
    if r.reason == pb.REASON_SESSION_FULL:
        return SessionFull(r.message)
    if r.reason in LOST or r.code == grpc.StatusCode.NOT_FOUND:
        return SessionLost(r.message)
    if r.code in _TRANSIENT:
        return LinkDown(f"{r.code.name}: {r.message}", cause=_CAUSES.get(r.code, Cause.FAILED))
    return ServerError(r.code, r.message, r.reason)


def rpc_error(e: grpc.RpcError) -> Exception:
    return refused(Refusal.of_rpc_error(e))


def typed(e: Exception) -> Exception:
    """The exception the session acts on for a failed call: a gRPC error by its refusal, a stream that broke
    mid-download (ConnectionError) as LinkDown, anything else as it is."""
    if isinstance(e, grpc.RpcError):
        return rpc_error(e)
    if isinstance(e, ConnectionError):
        return LinkDown(str(e), cause=Cause.BROKEN)
    return e


class Backoff:
    """Exponential backoff with jitter, and the server's retry advice; see the module docstring."""

    def __init__(self, initial_s: float, max_s: float, jitter: float, rng: random.Random):
        self.initial_s, self.max_s, self.jitter, self.rng = initial_s, max_s, jitter, rng
        self.delay = initial_s

    def fresh(self) -> Backoff:
        return Backoff(self.initial_s, self.max_s, self.jitter, self.rng)

    def reset(self) -> None:
        self.delay = self.initial_s

    def _jittered(self, delay: float) -> float:
        return delay * (1 + self.rng.uniform(-self.jitter, self.jitter))

    def wait(self, error: Exception | None = None) -> float:
        """The pause before the next try: the delay, jittered, or longer when a full server advises it."""
        advised = error.retry_after_s if isinstance(error, ServerBusy) else 0.0
        return max(self._jittered(self.delay), self._jittered(advised))

    def failed(self, error: Exception | None = None) -> float:
        """`wait(error)`; the delay after it doubles, up to max_s."""
        pause = self.wait(error)
        self.delay = min(self.delay * 2, self.max_s)
        return pause

    def retry(
        self,
        call: Callable[[], T],
        *,
        transient: tuple[type[Exception], ...] = (LinkDown,),
        attempts: int = 0,
        deadline: float | None = None,
        on_retry: Callable[[Exception], None] | None = None,
        give_up: Callable[[Exception], Exception] = typed,
    ) -> T:
        """`call()` until it returns. A failed call (a gRPC error, a broken stream, LinkDown) whose `typed` error is
        `transient` pauses (`failed`) and is tried again, unless it was try number `attempts` (0: no limit) or the
        next would start past `deadline` (time.monotonic()); then, and for any other failure of those kinds,
        `give_up(the exception raised)` is raised. Other exceptions pass through at once."""
        tries = 0
        while True:
            try:
                return call()
            except (grpc.RpcError, ConnectionError, LinkDown) as e:
                err = typed(e)
                tries += 1
                late = deadline is not None and time.monotonic() + self.delay > deadline
                if not isinstance(err, transient) or tries == attempts or late:
                    raise give_up(e) from None
                if on_retry is not None:
                    on_retry(err)
                time.sleep(self.failed(err))


def first_contact(
    call: Callable[[], T],
    backoff: Backoff,
    *,
    address: str,
    tls: bool,
    deadline: float,
    on_wait: Callable[[Hint], None] | None = None,
) -> T:
    """`call()`, a command's first call to `address` (see the module docstring); `on_wait(hint)` when it keeps
    trying a server that is not listening yet."""
    found: list[Hint | None] = []  # what diagnose saw, once

    def attempt() -> T:
        try:
            return call()
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                raise Unreachable(address, Hint.NOT_TETHER) from None
            if e.code() == grpc.StatusCode.UNAVAILABLE and not found:
                found.append(diagnose(address, tls=tls))
                if found[0] not in (None, Hint.NOTHING_LISTENING):
                    raise Unreachable(address, found[0]) from None
                if found[0] is not None and on_wait is not None:
                    on_wait(found[0])
            raise

    def give_up(e: Exception) -> Exception:
        if found and found[0] is not None:
            return Unreachable(address, found[0])
        if isinstance(e, grpc.RpcError):
            return ServerError(e.code(), f"{address}: {e.details()}")
        return typed(e)

    return backoff.retry(attempt, deadline=deadline, give_up=give_up)


# The HTTP/2 client preface and an empty SETTINGS frame: a gRPC (HTTP/2) server answers with a SETTINGS frame.
_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
_H2_SETTINGS = 0x04  # the frame type at byte 3 of a frame header


def diagnose(address: str, *, tls: bool, timeout_s: float = 2.0) -> Hint | None:
    """What answers at `address` (HOST:PORT) for a client that dialled it with TLS or not; None when nothing
    certain can be said (no answer in time, or an HTTP/2 server the client should be able to talk to)."""
    m = _ENDPOINT.match(address)
    if m is None:
        return None
    host, port = m.group(1).strip("[]"), int(m.group(2))
    try:
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return Hint.UNRESOLVED
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            sock.sendall(_H2_PREFACE)
            first = sock.recv(16)
    except ConnectionRefusedError:
        return Hint.NOTHING_LISTENING
    except ConnectionError:
        first = b""  # reset on the preface: a TLS server may do that; the handshake below tells
    except OSError:
        return None  # no route, or no answer in time: nothing certain
    if len(first) >= 9 and first[3] == _H2_SETTINGS:
        return Hint.PLAINTEXT_SERVER if tls else None
    if _speaks_tls(host, port, timeout_s):
        return Hint.CERTIFICATE if tls else Hint.TLS_SERVER
    # Only bytes that answered say "not gRPC" (an HTTP/1 server's status line or error page); a reset or a close
    # with no answer is a link down (a proxy cut, a server restarting), retried as an outage.
    return Hint.NOT_GRPC if first else None


def _speaks_tls(host: str, port: int, timeout_s: float) -> bool:
    """Whether a TLS handshake (nothing verified) gets a TLS answer: it completes, or the peer sends an alert."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    ctx.set_alpn_protocols(["h2"])
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as raw, ctx.wrap_socket(raw) as sock:
            return sock.version() is not None
    except ssl.SSLError as e:
        # OpenSSL's reason code names an alert the peer sent (SSLV3_ALERT_..., TLSV13_ALERT_...): a TLS server that
        # refused us; other reasons (WRONG_VERSION_NUMBER, ...) mean the bytes that came back were not TLS.
        return "ALERT" in (e.reason or "")
    except OSError:
        return False


class SessionStream:
    """One Session stream; replies are read by a thread so a round can wait with a deadline, and stamped with the
    time they arrived (`arrived_at` of the last one received), so a round's wait is measured even when the client
    was busy drafting ahead while it came."""

    def __init__(self, stub, metadata: tuple):
        self.outbox: queue.Queue = queue.Queue()
        self.inbox: queue.Queue = queue.Queue()
        self.arrived_at = 0.0  # time.monotonic() when the reply last received arrived
        self.call = stub.Session(iter(self.outbox.get, None), metadata=metadata)
        threading.Thread(target=self._read, daemon=True, name="tether-stream").start()

    def _read(self) -> None:
        try:
            for msg in self.call:
                self.inbox.put((time.monotonic(), msg))
            self.inbox.put((time.monotonic(), LinkDown("the server closed the stream", cause=Cause.CLOSED)))
        except grpc.RpcError as e:
            self.inbox.put((time.monotonic(), rpc_error(e)))

    def send(self, msg: pb.ClientMessage) -> None:
        self.outbox.put(msg)

    def request(self, msg: pb.ClientMessage, timeout: float) -> pb.ServerMessage:
        self.send(msg)
        return self.receive(timeout)

    def has_reply(self, stale: Collection[int] = ()) -> bool:
        """Whether a reply is waiting that `receive(..., stale=stale)` would return or raise at once (a stale
        round's refusal, which it passes over, does not count)."""
        with self.inbox.mutex:
            return any(not _is_stale(reply, stale) for _, reply in self.inbox.queue)

    def receive(self, timeout: float, since: float | None = None, stale: Collection[int] = ()) -> pb.ServerMessage:
        """The next reply, waited for until `timeout` s after `since` (a time.monotonic(); default: now): a reply
        that came in meanwhile is taken even when that time has passed. `stale`: overlapping rounds of those numbers
        were sent on guesses that did not hold; their REASON_STALE_ROUND refusals are passed over, once each."""
        deadline = time.monotonic() + timeout if since is None else since + timeout
        stale = set(stale)
        while True:
            try:
                self.arrived_at, reply = self.inbox.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise LinkDown(f"no answer within {timeout:.1f} s", cause=Cause.STALLED, waited_s=timeout) from None
            if isinstance(reply, Exception):
                raise reply
            if reply.WhichOneof("body") != "error":
                return reply
            if _is_stale(reply, stale):
                stale.discard(reply.error.round)
                continue
            raise refused(Refusal.of_inline(reply.error))

    def close(self) -> None:
        self.outbox.put(None)
        self.call.cancel()


def _is_stale(reply: pb.ServerMessage | Exception, stale: Collection[int]) -> bool:
    """Whether `reply` is the REASON_STALE_ROUND refusal of one of the overlapping rounds numbered in `stale`."""
    return (
        bool(stale)
        and isinstance(reply, pb.ServerMessage)
        and reply.WhichOneof("body") == "error"
        and reply.error.reason == pb.REASON_STALE_ROUND
        and reply.error.round in stale
    )


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


_ENDPOINT = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+):([0-9]{1,5})$")


def parse_endpoints(server: str) -> list[str]:
    """The HOST:PORT addresses of a --server list (comma-separated), each checked: gRPC would read a bare host as
    port 443 and a typo as a name to resolve, and the user would wait for a timeout instead of reading why."""
    addresses = [e.strip() for e in server.split(",") if e.strip()]
    if not addresses:
        raise ValueError("--server needs at least one HOST:PORT")
    for a in addresses:
        m = _ENDPOINT.match(a)
        if m is None or not 0 < int(m.group(2)) < 65536:
            raise ValueError(
                f"--server {a!r} is not HOST:PORT (for example 127.0.0.1:50051 or [::1]:50051; "
                f"tether-server listens on 50051 unless told otherwise)"
            )
    return addresses


class Replicas:
    """The endpoints of a --server list and the channel to the one in use; see the module docstring."""

    def __init__(
        self, server: str, first: int, *, keepalive_s: float, tls_ca: str = "", tls_cert: str = "", tls_key: str = ""
    ):
        self.addresses = parse_endpoints(server)
        self.index = first % len(self.addresses)
        self._channel_args = {"keepalive_s": keepalive_s, "tls_ca": tls_ca, "tls_cert": tls_cert, "tls_key": tls_key}
        self._connect()

    def _connect(self) -> None:
        self.channel = open_channel(self.address, **self._channel_args)
        self.stub = tether_pb2_grpc.TetherStub(self.channel)

    @property
    def address(self) -> str:
        return self.addresses[self.index]

    def failover(self) -> str:
        """Close the channel in use and open one to the next replica; returns its address."""
        self.channel.close()
        self.index = (self.index + 1) % len(self.addresses)
        self._connect()
        return self.address

    def close(self) -> None:
        self.channel.close()
