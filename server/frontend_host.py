"""The engine's side of `tether-server serve --frontends N`: front-end processes for gRPC, this process for the work.

Why: one Python process serving 128 clients spends most of its one GIL on gRPC's own callbacks, not on the models
(BENCHMARKS.md, "The request path on the H200"). With front ends, HTTP/2, TLS, authentication and call limits run in
N processes of their own (tether.server.frontend) that share the port through SO_REUSEPORT, and this process, the
engine, keeps the models, the sessions, the batcher and the service's handlers, reached over one Unix socket per
front end with frames written once per event-loop iteration (tether.server.frontend_wire). Each call runs here as
it would under grpc.aio: the same handler of tether.server.service, `CALLER` set to the identity the front end
authenticated, `context.abort` ending the client's call with the same status, details and trailing metadata.

Contract: `start_frontends(service, "host:port", n, tls=None)` returns `(handle, port)` once every front end
listens (port 0: the first picks a free port, the others join it). The handle has ServerHandle's methods (start,
stop, wait_for_termination), so `serve` treats both alike; front ends take calls as soon as they listen.
- The call limits are split: each front end takes ceil(max_streams / n) streams and ceil(max_calls_per_key / n)
  calls per key (a client's connection stays on one front end). Sessions per key are the engine's and are not split.
- A front end that dies is started again on the same port; its calls end UNAVAILABLE for their clients and their
  sessions stay held, as after any dropped connection. With `serve --engines E`, one started after another engine
  died routes to the live engines alone (it is given every engine's socket; a dead one's refuses). The front ends
  end when the engine's socket closes, so none outlives an engine that crashed.
- The socket lives in a private directory (mode 0700) that is removed at stop.

    handle, port = start_frontends(service, "0.0.0.0:50051", 4)
    handle.start(); ...; handle.stop(grace=5.0).wait()
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path

import grpc
from google.protobuf.message import DecodeError

from tether.server.auth import CALLER, PEER
from tether.server.call_inbox import CALL_INBOX, CallInbox
from tether.server.frontend_wire import (
    MAX_FRAME,
    METHODS,
    VERDICT_FRAMES,
    Consumed,
    Credit,
    FrameError,
    Framer,
    Kind,
    Outbox,
    VerdictFrame,
    credit,
    dump,
    dump_metadata,
    load,
    read_count,
    read_credit,
)
from tether.server.rpc_server import Servable, TLSFiles, event_loop
from tether.v1 import tether_pb2 as pb

MESSAGES = {m.name: (getattr(pb, m.input_type.name), m) for m in METHODS.values()}
START_TIMEOUT_S = 60.0  # a front end that has not said HELLO by then failed to start
RESTART_PAUSE_S = 1.0  # between a front end's death and its replacement (a crash loop costs little)

log = logging.getLogger("tether.server")


class Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str, metadata):
        super().__init__(details)
        self.code, self.details, self.metadata = code, details, metadata


class CallContext:
    """What the service's handlers use of grpc.aio's ServicerContext, for a call carried by a front end."""

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata=()) -> None:
        raise Aborted(code, details, trailing_metadata)


class EngineCall:
    """One client call, run here on the service's handler (its requests read through a CallInbox)."""

    def __init__(self, conn: FrontendConnection, call_id: int, method: str, caller: str, peer: str = ""):
        self.conn, self.id, self.method, self.caller, self.peer = conn, call_id, method, caller, peer
        self.inbox = CallInbox(self)
        self.reply_credit = Credit()
        self.requests_taken = Consumed()
        self.task: asyncio.Task | None = None

    async def _one(self, cls):
        payload = await self.inbox.next()
        if payload is None:
            raise Aborted(grpc.StatusCode.INTERNAL, "the call ended before its request", ())
        return _parse(cls, payload)

    async def _stream(self, cls):
        while (payload := await self.inbox.next()) is not None:
            yield _parse(cls, payload)

    async def _reply(self, message) -> None:
        await self.reply_credit.take()
        self._send(message)

    def _send(self, message) -> None:
        if isinstance(message, VerdictFrame):  # a round's reply: the front end encodes its delta
            self.conn.outbox.send(self.id, Kind.VERDICT, message.payload)
        else:
            self.conn.outbox.send(self.id, Kind.REPLY, message.SerializeToString())

    # ---- what its CallInbox needs (tether.server.call_inbox.InboxCall) ----

    def has_reply_credit(self) -> bool:
        return self.reply_credit.n > 0

    def send_reply(self, message) -> None:
        self.reply_credit.n -= 1
        self._send(message)

    def consumed(self) -> None:
        if n := self.requests_taken.one():
            self.conn.outbox.send(self.id, Kind.CREDIT, credit(n))

    async def run(self, service: Servable) -> None:
        send = self.conn.outbox.send
        try:
            CALLER.set(self.caller)
            PEER.set(self.peer)
            VERDICT_FRAMES.set(True)
            CALL_INBOX.set(self.inbox)
            if self.method not in METHODS:
                raise Aborted(grpc.StatusCode.UNIMPLEMENTED, f"no method {self.method}", ())
            cls, m = MESSAGES[self.method]
            handler = getattr(service, self.method)
            request = self._stream(cls) if m.client_streaming else await self._one(cls)
            if m.server_streaming:
                async for reply in handler(request, CallContext()):
                    await self._reply(reply)
            else:
                await self._reply(await handler(request, CallContext()))
            send(self.id, Kind.END)
        except asyncio.CancelledError:
            pass  # the client went away (CANCEL), its front end died, or the engine is stopping
        except Exception as e:  # as grpc.aio does: the call fails, the server goes on
            if not isinstance(e, Aborted):
                log.exception("internal error in %s", self.method, extra={"event": "error"})
                e = Aborted(grpc.StatusCode.UNKNOWN, f"Unexpected {type(e).__name__}", ())
            code = e.code if isinstance(e.code, grpc.StatusCode) else grpc.StatusCode.UNKNOWN
            send(
                self.id,
                Kind.ABORT,
                dump({"code": code.value[0], "details": e.details, "metadata": dump_metadata(e.metadata)}),
            )
        finally:
            self.conn.calls.pop(self.id, None)


def _parse(cls, payload: bytes):
    try:
        return cls.FromString(payload)
    except DecodeError:
        raise Aborted(grpc.StatusCode.INTERNAL, "Exception deserializing request!", ()) from None


class FrontendConnection(asyncio.Protocol):
    """The engine's end of one front end's socket."""

    def __init__(self, host: FrontendHost):
        self.host = host
        # Messages are bounded by max_message_bytes, which may be set above the default frame limit.
        self.framer = Framer(max(MAX_FRAME, host.service.config.max_message_bytes + 4096))
        self.calls: dict[int, EngineCall] = {}
        self.pid = 0
        self.transport: asyncio.Transport | None = None
        self.outbox: Outbox | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        self.outbox = Outbox(transport, self.host.loop)
        self.outbox.send(0, Kind.CONFIG, dump(self.host.frontend_config()))

    def data_received(self, data: bytes) -> None:
        try:
            for call_id, kind, payload in self.framer.feed(data):
                self._frame(call_id, kind, payload)
        except FrameError as e:
            log.error("dropping front end %d: %s", self.pid, e)
            self.transport.close()

    def _frame(self, call_id: int, kind: Kind, payload: bytes) -> None:
        if call_id == 0:
            if kind == Kind.DELTA_BYTES:
                self.host.service.delta_bytes_sent(read_count(payload))
            elif kind == Kind.HELLO:
                self.host.hello(self, load(payload))
            else:
                raise FrameError(f"unexpected {kind.name} on the link")
            return
        if kind == Kind.CALL:
            if call_id in self.calls:
                raise FrameError(f"call {call_id} opened twice")
            head = load(payload)
            call = self.calls[call_id] = EngineCall(
                self, call_id, str(head.get("method")), str(head.get("caller")), str(head.get("peer", ""))
            )
            call.task = self.host.loop.create_task(call.run(self.host.service))
            return
        call = self.calls.get(call_id)
        if call is None:
            return  # a frame for a call that has ended here (they cross)
        if kind == Kind.REQUEST:
            call.inbox.offer(payload)
        elif kind == Kind.HALF_CLOSE:
            call.inbox.offer(None)
        elif kind == Kind.CANCEL:
            call.task.cancel()
        elif kind == Kind.CREDIT:
            call.reply_credit.add(read_credit(payload))
        else:
            raise FrameError(f"{kind.name} is not a frame a front end sends for a call")

    def connection_lost(self, exc: Exception | None) -> None:
        for call in list(self.calls.values()):
            call.task.cancel()
        self.host.lost(self)


class FrontendHost:
    """The engine's socket, its front-end processes and their supervision (all on the gRPC event loop)."""

    def __init__(
        self,
        service: Servable,
        address: str,
        n: int,
        tls: TLSFiles | None,
        logs: tuple[str, str],
        engines: tuple[str, ...] = (),
    ):
        c = service.config
        self.service, self.address, self.n, self.tls = service, address, n, tls
        self.engines = engines  # the other engine processes' sockets (serve --engines): front ends link to them too
        self.loop = event_loop()
        self.limits = {
            "max_message_bytes": c.max_message_bytes,
            "api_keys": sorted(c.api_keys),
            "max_calls_per_key": math.ceil(c.max_calls_per_key / n),
            "max_streams": math.ceil(c.max_streams / n),
            "log_format": logs[0],
            "log_level": logs[1],
        }
        self.dir = Path(tempfile.mkdtemp(prefix="tether-engine-"))  # mode 0700: this user's alone
        self.socket = str(self.dir / "engine.sock")
        self.procs: list[subprocess.Popen] = []
        self.connections: dict[int, FrontendConnection] = {}  # by pid, once it said HELLO
        self.hellos: dict[int, dict] = {}  # by pid: what each front end said
        self.hello_seen = asyncio.Event()
        self.port = 0
        self.stopping = False
        self.grace: float | None = None  # what stop() gives the calls in flight (for a front end linked after it)
        self._server: asyncio.AbstractServer | None = None
        self._watch: asyncio.Task | None = None

    def frontend_config(self) -> dict:
        tls = {"cert": self.tls.cert, "key": self.tls.key, "client_ca": self.tls.client_ca} if self.tls else None
        return {"address": self.address, "tls": tls, **self.limits}

    def hello(self, conn: FrontendConnection, info: dict) -> None:
        conn.pid = int(info.get("pid", 0))
        if info.get("port"):
            self.connections[conn.pid] = conn
            if self.stopping:  # started again while stop() ran: it missed the STOP the others were sent
                conn.outbox.send(0, Kind.STOP, dump({"grace": self.grace}))
        self.hellos[conn.pid] = info
        self.hello_seen.set()

    def lost(self, conn: FrontendConnection) -> None:
        if self.connections.get(conn.pid) is conn:
            del self.connections[conn.pid]

    def _spawn(self) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "tether.server.frontend", "--engine", self.socket]
        for path in self.engines:
            cmd += ["--engine", path]
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, close_fds=True)
        self.procs.append(proc)
        return proc

    async def _started(self, proc: subprocess.Popen) -> int:
        """Wait for `proc`'s HELLO; the port it bound."""
        async with asyncio.timeout(START_TIMEOUT_S):
            while (info := self.hellos.pop(proc.pid, None)) is None:
                if proc.poll() is not None:
                    raise OSError(f"a front end exited with status {proc.returncode} before it listened")
                self.hello_seen.clear()
                try:
                    await asyncio.wait_for(self.hello_seen.wait(), 0.5)  # and look at the process now and then
                except TimeoutError:
                    pass
        if not info.get("port"):
            raise OSError(info.get("error") or f"a front end could not listen on {self.address}")
        return int(info["port"])

    async def start(self) -> int:
        self._server = await self.loop.create_unix_server(lambda: FrontendConnection(self), self.socket)
        os.chmod(self.socket, 0o600)
        self.port = await self._started(self._spawn())
        host = self.address.rsplit(":", 1)[0]
        self.address = f"{host}:{self.port}"  # the others (and any restarted one) join the port the first bound
        for proc in [self._spawn() for _ in range(self.n - 1)]:
            await self._started(proc)
        self._watch = asyncio.create_task(self._supervise())
        return self.port

    async def _supervise(self) -> None:
        while not self.stopping:
            await asyncio.sleep(RESTART_PAUSE_S)
            for proc in [p for p in self.procs if p.poll() is not None]:
                if self.stopping:
                    return
                self.procs.remove(proc)
                log.warning(
                    "front end %d exited with status %s; starting another",
                    proc.pid,
                    proc.returncode,
                    extra={"event": "frontend_restart"},
                )
                proc = self._spawn()
                try:
                    await self._started(proc)
                except (OSError, TimeoutError) as e:
                    log.error("a front end failed to start again: %s", e)
                    proc.kill()  # alive but never linked: the next pass starts another
                    proc.wait()

    async def stop(self, grace: float | None) -> None:
        """Front ends stop taking calls and give those in flight `grace` seconds; then every call here ends."""
        self.stopping, self.grace = True, grace
        if self._watch is not None:
            self._watch.cancel()
        for conn in list(self.connections.values()):
            conn.outbox.send(0, Kind.STOP, dump({"grace": grace}))
        deadline = self.loop.time() + (grace or 0) + 10
        while any(p.poll() is None for p in self.procs) and self.loop.time() < deadline:
            await asyncio.sleep(0.05)
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()  # reaped: no zombie, and its returncode says it was killed
        for conn in list(self.connections.values()):
            conn.transport.close()
        if self._server is not None:
            self._server.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs if p.poll() is None]


class FrontendsHandle:
    """ServerHandle's shape (tether.server.rpc_server) for an engine with front-end processes."""

    def __init__(self, host: FrontendHost):
        self.host, self.service, self.loop = host, host.service, host.loop
        self._housekeeping: asyncio.Task | None = None
        self._stopped: threading.Event | None = None
        self._terminated = threading.Event()

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def start(self) -> None:
        async def start():
            self._housekeeping = asyncio.create_task(self.service.housekeeping())

        self._call(start())

    def stop(self, grace: float | None = None) -> threading.Event:
        if self._stopped is None:
            self._stopped = threading.Event()
            try:
                if self._housekeeping is not None:
                    self.loop.call_soon_threadsafe(self._housekeeping.cancel)
                self._call(self.host.stop(grace))
                self.service.stop_work()
                self._call(self._release())
            finally:
                self._stopped.set()
                self._terminated.set()
        return self._stopped

    async def _release(self) -> None:
        await asyncio.sleep(0)  # claims released by finished work (call_soon_threadsafe) run first
        self.service.release_all()

    def wait_for_termination(self) -> None:
        self._terminated.wait()

    def pids(self) -> list[int]:
        """The front ends' process ids (for a bench that adds up the server's CPU time)."""
        return self.host.pids()


def start_frontends(
    service: Servable,
    address: str,
    n: int,
    *,
    tls: TLSFiles | None = None,
    engines: Sequence[str] = (),
    log_format: str = "text",
    log_level: str = "warning",
) -> tuple[FrontendsHandle, int]:
    if n < 1:
        raise ValueError(f"front ends: at least 1, got {n}")
    host = FrontendHost(service, address, n, tls, (log_format, log_level), tuple(engines))
    try:
        port = asyncio.run_coroutine_threadsafe(host.start(), host.loop).result()
    except BaseException:
        asyncio.run_coroutine_threadsafe(host.stop(None), host.loop).result()
        raise
    return FrontendsHandle(host), port
