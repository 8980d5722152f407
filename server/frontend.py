"""A front-end process of `tether-server serve --frontends N`: gRPC in front, the engine behind a Unix socket.

Contract: started by the engine (tether.server.frontend_host), never by hand. It connects to the engine's socket,
takes its CONFIG (the address, TLS files, limits and API keys: over the private socket, so keys never show in a
process listing), binds the address with SO_REUSEPORT beside the other front ends (the kernel spreads connections
over them), and says HELLO with the port it bound. From then on each tether.v1.Tether call is authenticated and
counted here (tether.server.auth, with this front end's share of the call limits) and carried to the engine as
frames (tether.server.frontend_wire): the request messages as the client sent them, the replies as the engine
made them, an abort with its status, details and trailing metadata (the typed reason) as the engine raised it. A
round's verdict comes with its KV delta unencoded and is encoded here into the reply the engine would have sent
(frontend_wire's VERDICT), which takes the delta's encoding off the engine's GIL. grpc.health.v1 (what it says of
the engines: tether.server.engine_health) and reflection are answered here.

With several engines (`serve --engines E`) it links to each engine's socket (`--engine` once per engine, the
serving process's first) and routes every call (class Router): a Session stream that attaches, a Resync and a Close
to the engine whose index the session id carries (tether.shared.ids.engine_of); a stream that opens a session, and
a Generate stream, to the live engine with the fewest calls from this front end; GetModelInfo and FetchWeights to
the first. Only those first messages are parsed here, and only to route; with one engine nothing is. An engine
process that goes away ends its calls UNAVAILABLE (its sessions are lost: clients rebuild them by Resync with their
history, which goes to a live engine); the front end goes on with the others, and one started after an engine died
(a replacement) takes that engine's refused socket for a dead link and routes to the live ones alone.

It stops when the (first) engine says STOP (the calls in flight get the grace the engine passes on) or when its
socket closes (the engine is gone: no grace). SIGINT and SIGTERM are ignored: a terminal's Ctrl-C and a service
manager's SIGTERM reach the whole process group, and it is the engine that decides how the calls end.

    python -m tether.server.frontend --engine /tmp/tether-engine-XXXX/engine.sock [--engine ENGINE_1_SOCKET ...]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import logging
import os
import signal
from collections.abc import Callable

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from tether.server.auth import CALLER, PEER, AuthInterceptor
from tether.server.engine_health import EngineHealth
from tether.server.frontend_wire import (
    METHODS,
    Consumed,
    Credit,
    FrameError,
    Framer,
    Kind,
    Outbox,
    VerdictFrame,
    count,
    credit,
    dump,
    load,
    load_metadata,
    read_credit,
    verdict_message,
)
from tether.server.logs import configure_logging
from tether.server.rpc_server import HEALTH_NAME, SERVICE_NAME, TLSFiles, channel_options, new_event_loop
from tether.shared import wire
from tether.shared.ids import engine_of
from tether.v1 import tether_pb2 as pb

STATUS = {s.value[0]: s for s in grpc.StatusCode}
_END, _LOST = object(), object()

log = logging.getLogger("tether.server.frontend")


class Call:
    """One client call as the engine sees it: replies in, requests out, within the window both ways."""

    def __init__(self, link: EngineLink, call_id: int):
        self.link, self.id = link, call_id
        self.replies: asyncio.Queue = asyncio.Queue()  # bytes, then _END, an abort's dict or _LOST
        self.send_credit = Credit()
        self.consumed = Consumed()
        self.ended = False

    def on_frame(self, kind: Kind, payload: bytes) -> None:
        if kind == Kind.REPLY:
            self.replies.put_nowait(payload)
        elif kind == Kind.END:
            self.ended = True
            self.replies.put_nowait(_END)
        elif kind == Kind.ABORT:
            self.ended = True
            self.replies.put_nowait(load(payload))
        elif kind == Kind.VERDICT:
            self.replies.put_nowait(VerdictFrame(payload))
        elif kind == Kind.CREDIT:
            self.send_credit.add(read_credit(payload))
        else:
            raise FrameError(f"{kind.name} is not a frame the engine sends for a call")

    async def send(self, request: bytes) -> None:
        await self.send_credit.take()
        self.link.outbox.send(self.id, Kind.REQUEST, request)

    def half_close(self) -> None:
        self.link.outbox.send(self.id, Kind.HALF_CLOSE)

    async def next(self, context: grpc.aio.ServicerContext) -> bytes | None:
        """The engine's next reply; None when the call has ended OK. An abort ends the client's call with it."""
        item = await self.replies.get()
        if item is _END:
            return None
        if item is _LOST:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is restarting; retry shortly")
        if isinstance(item, dict):
            code = STATUS.get(item.get("code"), grpc.StatusCode.UNKNOWN)
            await context.abort(code, str(item.get("details", "")), load_metadata(item.get("metadata", [])))
        if isinstance(item, VerdictFrame):
            try:
                item, delta_bytes = verdict_message(item.payload, max_nbytes=self.link.max_message_bytes)
            except FrameError as e:  # the engine's bug: this call fails, the others go on
                log.error("call %d: %s", self.id, e)
                await context.abort(grpc.StatusCode.INTERNAL, "the server could not encode a round's reply")
            self.link.count_delta_bytes(delta_bytes)
        n = self.consumed.one()
        if n:
            self.link.outbox.send(self.id, Kind.CREDIT, credit(n))
        return item

    def finish(self) -> None:
        """The client's call is over here: if the engine is still at it, it cancels its handler."""
        self.link.calls.pop(self.id, None)
        if not self.ended:
            self.ended = True
            self.link.outbox.send(self.id, Kind.CANCEL)


class EngineLink(asyncio.Protocol):
    """This front end's end of the engine's socket."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.framer = Framer()
        self.calls: dict[int, Call] = {}
        self.ids = itertools.count(1)
        self.config: asyncio.Future = loop.create_future()
        self.stop: asyncio.Future = loop.create_future()  # the engine's grace for the calls in flight
        self.outbox: Outbox | None = None
        self.transport: asyncio.Transport | None = None
        self.alive = True  # False once the engine's socket closed: nothing more is routed here
        self.on_lost: Callable[[], None] | None = None  # told when the socket closes (tether.server.engine_health)
        self.max_message_bytes = wire.DEFAULT_MAX_NBYTES  # bounds a verdict's delta: the engine's limit, from CONFIG
        self.delta_bytes = 0  # encoded here since the last DELTA_BYTES frame

    def count_delta_bytes(self, n: int) -> None:
        """Tell the engine, once per event-loop iteration, how many delta bytes this front end encoded (its
        kv_delta metric counts them as if it had)."""
        if not self.delta_bytes:
            self.loop.call_soon(self._report_delta_bytes)
        self.delta_bytes += n

    def _report_delta_bytes(self) -> None:
        n, self.delta_bytes = self.delta_bytes, 0
        if n and not self.transport.is_closing():
            self.outbox.send(0, Kind.DELTA_BYTES, count(n))

    def connection_made(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        self.outbox = Outbox(transport, self.loop)

    def data_received(self, data: bytes) -> None:
        try:
            for call_id, kind, payload in self.framer.feed(data):
                if call_id == 0:
                    self._link_frame(kind, payload)
                elif call := self.calls.get(call_id):
                    call.on_frame(kind, payload)
        except FrameError as e:
            log.error("dropping the engine's socket: %s", e)
            self.transport.close()

    def _link_frame(self, kind: Kind, payload: bytes) -> None:
        if kind == Kind.CONFIG and not self.config.done():
            self.config.set_result(load(payload))
        elif kind == Kind.STOP and not self.stop.done():
            self.stop.set_result(load(payload).get("grace"))
        else:
            raise FrameError(f"unexpected {kind.name} on the link")

    def connection_lost(self, exc: Exception | None) -> None:
        self.alive = False
        if self.on_lost is not None:
            self.on_lost()
        for call in list(self.calls.values()):
            call.replies.put_nowait(_LOST)
        if not self.stop.done():
            self.stop.set_result(None)
        if not self.config.done():
            self.config.set_exception(ConnectionError("the engine closed its socket before sending CONFIG"))

    def open(self, method: str, caller: str, peer: str = "") -> Call:
        call_id = next(self.ids) % 0xFFFFFFFF + 1  # 0 is the link's; ids wrap after 2**32 - 1 calls
        call = self.calls[call_id] = Call(self, call_id)
        self.outbox.send(call_id, Kind.CALL, dump({"method": method, "caller": caller, "peer": peer}))
        return call


class Router:
    """Which engine's link carries a call. The first link is the serving process's: its loss stops this front end,
    so there is always one live link to fall back on."""

    SESSION_NAMED = {"Resync": pb.ResyncRequest, "Close": pb.CloseRequest}  # unary calls naming their session
    FIRST = ("GetModelInfo", "FetchWeights")  # what every engine answers alike, kept on one (its export cache)

    def __init__(self, links: list[EngineLink]):
        self.links = links

    def least_busy(self) -> EngineLink:
        """The live engine with the fewest calls from this front end (the first on a tie)."""
        return min((link for link in self.links if link.alive), key=lambda link: len(link.calls))

    def holding(self, session_id: str) -> EngineLink:
        """The engine whose index `session_id` carries, if it is live; else the least busy (which answers for a
        session it does not hold: NOT_FOUND, or a rebuild from the history a Resync brings)."""
        k = engine_of(session_id, len(self.links))
        return self.links[k] if k is not None and self.links[k].alive else self.least_busy()

    def route(self, method: str, first: bytes | None) -> EngineLink:
        """The link for a call of `method` whose first request is `first` (None: the client sent none)."""
        if len(self.links) == 1 or method in self.FIRST:
            return self.links[0]
        try:
            if method in self.SESSION_NAMED and first is not None:
                return self.holding(self.SESSION_NAMED[method].FromString(first).session_id)
            if method == "Session" and first is not None:
                message = pb.ClientMessage.FromString(first)
                if message.WhichOneof("body") == "attach":
                    return self.holding(message.attach.session_id)
        except DecodeError:
            pass  # the engine it lands on refuses it as it would any malformed request
        return self.least_busy()


def forwarding_handlers(router: Router) -> dict[str, grpc.RpcMethodHandler]:
    """A raw-bytes handler per tether.v1.Tether method that carries the call to its engine."""

    async def pump(call: Call, requests, first: bytes | None = None) -> None:
        try:
            if first is not None:
                await call.send(first)
            async for request in requests:
                await call.send(request)
        except grpc.RpcError:
            return  # the client's side of the call broke: gRPC ends the handler, whose finally cancels the engine's
        call.half_close()

    def make(name: str, client_streaming: bool, server_streaming: bool) -> grpc.RpcMethodHandler:
        async def replies(call: Call, context):
            while (reply := await call.next(context)) is not None:
                yield reply

        async def unary_unary(request: bytes, context) -> bytes:
            call = router.route(name, request).open(name, CALLER.get(), PEER.get())
            try:
                await call.send(request)
                call.half_close()
                reply = await call.next(context)
                if reply is None or await call.next(context) is not None:
                    await context.abort(grpc.StatusCode.INTERNAL, "the engine answered a unary call wrongly")
                return reply
            finally:
                call.finish()

        async def unary_stream(request: bytes, context):
            call = router.route(name, request).open(name, CALLER.get(), PEER.get())
            try:
                await call.send(request)
                call.half_close()
                async for reply in replies(call, context):
                    yield reply
            finally:
                call.finish()

        async def stream_stream(requests, context):
            first = None
            if len(router.links) > 1:  # the first message says which engine: wait for it before opening the call
                requests = aiter(requests)
                try:
                    first = await anext(requests)
                except StopAsyncIteration:
                    pass
            call = router.route(name, first).open(name, CALLER.get(), PEER.get())
            sending = asyncio.ensure_future(pump(call, requests, first))
            try:
                async for reply in replies(call, context):
                    yield reply
            finally:
                sending.cancel()
                call.finish()

        if client_streaming and server_streaming:
            return grpc.stream_stream_rpc_method_handler(stream_stream)
        if server_streaming:
            return grpc.unary_stream_rpc_method_handler(unary_stream)
        if client_streaming:
            raise ValueError(f"{name}: client-streaming calls with one reply are not in tether.v1")
        return grpc.unary_unary_rpc_method_handler(unary_unary)

    return {f"/{SERVICE_NAME}/{m.name}": make(m.name, m.client_streaming, m.server_streaming) for m in METHODS.values()}


class Forwarding(grpc.GenericRpcHandler):
    def __init__(self, handlers: dict[str, grpc.RpcMethodHandler]):
        self.handlers = handlers

    def service(self, handler_call_details):
        return self.handlers.get(handler_call_details.method)


async def link_engine(loop: asyncio.AbstractEventLoop, path: str, first: bool) -> EngineLink:
    """The link to the engine at `path`. An engine after the first whose socket refuses died before this front end
    started (engines are not restarted): its link is dead from the start, and calls go to the others."""
    try:
        return (await loop.create_unix_connection(lambda: EngineLink(loop), path))[1]
    except OSError as e:
        if first:
            raise
        log.warning("engine %s is gone (%s); serving with the others", path, e)
        dead = EngineLink(loop)
        dead.alive = False
        return dead


async def run(engine_sockets: list[str]) -> int:
    """Link to each engine (the first sends CONFIG), listen, say HELLO to each, serve until the first says STOP."""
    loop = asyncio.get_running_loop()
    links = [await link_engine(loop, path, k == 0) for k, path in enumerate(engine_sockets)]
    link = links[0]
    cfg = await link.config
    for each in links:
        each.framer.max_frame = max(each.framer.max_frame, cfg["max_message_bytes"] + 4096)
        each.max_message_bytes = cfg["max_message_bytes"]
    configure_logging(cfg.get("log_format", "text"), cfg.get("log_level", "warning"))
    auth = AuthInterceptor(
        frozenset(cfg["api_keys"]), max_calls_per_key=cfg["max_calls_per_key"], max_streams=cfg["max_streams"]
    )
    options = [*channel_options(cfg["max_message_bytes"]), ("grpc.so_reuseport", 1)]  # the front ends share the port
    server = grpc.aio.server(interceptors=[auth], options=options)
    server.add_generic_rpc_handlers((Forwarding(forwarding_handlers(Router(links))),))
    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection((SERVICE_NAME, HEALTH_NAME, reflection.SERVICE_NAME), server)
    tls = TLSFiles(**cfg["tls"]) if cfg.get("tls") else None
    try:
        if tls:
            port = server.add_secure_port(cfg["address"], tls.credentials())
        else:
            port = server.add_insecure_port(cfg["address"])
    except RuntimeError as e:  # grpc raises when it cannot bind
        log.error("cannot listen on %s: %s", cfg["address"], e)
        port = 0
    if port == 0:
        error = f"cannot listen on {cfg['address']}"
        link.outbox.send(0, Kind.HELLO, dump({"pid": os.getpid(), "port": 0, "error": error}))
        await asyncio.sleep(0)
        for each in links:
            if each.transport is not None:
                each.transport.close()
        return 3
    await server.start()
    capacity = EngineHealth(health, links)
    for each in links:
        each.on_lost = capacity.changed
    await capacity.publish()
    for each in links:
        if each.outbox is not None:
            each.outbox.send(0, Kind.HELLO, dump({"pid": os.getpid(), "port": port}))
    grace = await link.stop
    await health.enter_graceful_shutdown()
    await server.stop(grace)
    for each in links:
        if each.transport is not None:
            each.transport.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="a front end of tether-server serve --frontends N (started by serve)")
    ap.add_argument(
        "--engine",
        required=True,
        action="append",
        help="an engine's Unix socket; once per engine, the serving process's first",
    )
    args = ap.parse_args(argv)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    # The loop is never closed and the interpreter never torn down: nothing is left to save, and gRPC's threads
    # torn down under either can abort the process ("terminate called without an active exception").
    rc = new_event_loop().run_until_complete(run(args.engine))
    logging.shutdown()
    os._exit(rc)


if __name__ == "__main__":
    raise SystemExit(main())
