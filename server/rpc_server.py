"""The process's gRPC server: grpc.aio on one event-loop thread, no thread per stream.

Contract: `make_server(service, "host:port", tls=None, interceptors=())` binds the port ("host:0" picks a free
one) and returns `(handle, port)`, or raises a CommandError (tether.shared.cli_support) whose reason says the port
is in use (by anyone, even a process sharing its port through SO_REUSEPORT: this server binds without that option,
and front ends, which bind with it to share the port among themselves, find it free first) or cannot be bound.
`handle.start()` serves, `handle.stop(grace)` stops taking calls, gives those in flight `grace` seconds (None:
none) and returns a `threading.Event` set once everything has stopped (the model threads' work done, KV given
back). Every server of the process runs on one event loop (`event_loop()`).
Beside tether.v1.Tether it serves grpc.health.v1 (SERVING while up) and reflection.
The service's handlers are coroutines on that loop; model work runs on the service's own threads, so a thousand
idle streams cost a few kilobytes each and health checks answer at once however many streams are open.
Callers outside the loop (the daemon, tests) use only this handle.

    handle, port = make_server(service, "127.0.0.1:0")
    handle.start()
    handle.stop(grace=5.0).wait()
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from tether.server.auth import AuthInterceptor
from tether.shared.cli_support import CommandError, Refusal, address_in_use
from tether.v1 import tether_pb2 as pb
from tether.v1 import tether_pb2_grpc

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Tether"].full_name  # "tether.v1.Tether"
HEALTH_NAME = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name


class Servable(Protocol):
    """What make_server needs of a service (tether.server.service.TetherService)."""

    config: object  # has api_keys, max_calls_per_key, max_streams, max_message_bytes

    async def housekeeping(self) -> None: ...  # periodic upkeep (leases), a task for the server's lifetime

    def stop_work(self) -> None: ...  # wait for the model threads (off the loop)

    def release_all(self) -> None: ...  # give back every session's KV (on the loop, after stop_work)

    def delta_bytes_sent(self, n: int) -> None: ...  # KV delta bytes a front end encoded for this service


@dataclass(frozen=True)
class TLSFiles:
    cert: str  # PEM certificate chain of this server
    key: str  # PEM private key
    client_ca: str = ""  # PEM CA bundle: when given, clients must present a certificate it signed (mTLS)

    def credentials(self) -> grpc.ServerCredentials:
        pair = [(Path(self.key).read_bytes(), Path(self.cert).read_bytes())]
        ca = Path(self.client_ca).read_bytes() if self.client_ca else None
        return grpc.ssl_server_credentials(pair, root_certificates=ca, require_client_auth=ca is not None)


def channel_options(max_message_bytes: int) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        # Edge clients ping every few seconds to notice dead links (tether.client.session keepalive_s); accept
        # that instead of answering GOAWAY "too_many_pings", and ping idle clients ourselves to reap dead ones.
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 1000),
        ("grpc.http2.max_ping_strikes", 0),
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
    ]


_loop: asyncio.AbstractEventLoop | None = None
_loop_lock = threading.Lock()


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop's event loop where it is installed (Linux and macOS), else asyncio's. The engine's loop carries every
    round twice (its request frame in, its verdict out): uvloop's handles, transports and cross-thread wake-ups take
    about half the CPU of asyncio's pure-Python ones."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def event_loop() -> asyncio.AbstractEventLoop:
    """The process's one gRPC event loop, on a daemon thread of its own, started on first use and never closed.
    grpc.aio shares one completion queue per process; with one loop, no event is ever handed to a loop that has
    closed (which a second server, or a test's client, on a loop of its own would risk)."""
    global _loop
    with _loop_lock:
        if _loop is None:
            _loop = new_event_loop()
            threading.Thread(target=_loop.run_forever, name="tether-grpc", daemon=True).start()
        return _loop


class ServerHandle:
    """A grpc.aio server on the process's gRPC event loop."""

    def __init__(self, service: Servable, interceptors: Sequence[grpc.aio.ServerInterceptor]):
        self.service = service
        self.loop = event_loop()
        self._interceptors = list(interceptors)
        self._housekeeping: asyncio.Task | None = None
        self._stopped: threading.Event | None = None
        self.server: grpc.aio.Server = self._call(self._build())

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    async def _build(self) -> grpc.aio.Server:
        c = self.service.config
        self.auth = AuthInterceptor(c.api_keys, max_calls_per_key=c.max_calls_per_key, max_streams=c.max_streams)
        # No SO_REUSEPORT (gRPC's default is on): a second server on a taken port must fail, not split its clients.
        options = [*channel_options(c.max_message_bytes), ("grpc.so_reuseport", 0)]
        server = grpc.aio.server(interceptors=[self.auth, *self._interceptors], options=options)
        tether_pb2_grpc.add_TetherServicer_to_server(self.service, server)
        # grpc.health.v1 (load balancers and Kubernetes probes ask it) and reflection (grpcurl, grpcui).
        self.health = HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection((SERVICE_NAME, HEALTH_NAME, reflection.SERVICE_NAME), server)
        return server

    def bind(self, address: str, tls: TLSFiles | None) -> int:
        check_free(address)  # gRPC's own failure would come with a line of C-core log
        creds = tls.credentials() if tls else None
        try:
            port = self.server.add_secure_port(address, creds) if creds else self.server.add_insecure_port(address)
        except RuntimeError:  # what grpc raises when no address could be bound
            port = 0
        if port == 0:
            raise CommandError(Refusal.CANNOT_LISTEN, f"cannot listen on {address}")
        return port

    def start(self) -> None:
        async def start():
            await self.server.start()
            for name in ("", SERVICE_NAME):
                await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
            self._housekeeping = asyncio.create_task(self.service.housekeeping())

        self._call(start())

    def stop(self, grace: float | None = None) -> threading.Event:
        """Stop serving: refuse new calls, give those in flight `grace` seconds (None: cancel them now), wait for
        the model threads and give back every session's KV. Returns a set event (the old grpc.Server.stop's shape;
        this one has finished when it returns)."""
        if self._stopped is None:
            self._stopped = threading.Event()
            try:
                self._call(self._stop(grace))
                self.service.stop_work()  # handlers were cancelled; their threads' work ends here
                self._call(self._release())
            finally:
                self._stopped.set()
        return self._stopped

    async def _stop(self, grace: float | None) -> None:
        if self._housekeeping is not None:
            self._housekeeping.cancel()
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)

    async def _release(self) -> None:
        await asyncio.sleep(0)  # claims released by finished work (call_soon_threadsafe) run first
        self.service.release_all()

    def wait_for_termination(self) -> None:
        self._call(self.server.wait_for_termination())


def check_free(address: str) -> None:
    """A CommandError when something already listens on `address` ("host:port", "[v6]:port")."""
    host, _, port = address.rpartition(":")
    if port.isdigit() and address_in_use(host, int(port)):
        raise CommandError(
            Refusal.ADDRESS_IN_USE,
            f"{address} is in use by another process: stop it, or listen on another port (0: any free one)",
        )


def make_server(
    service: Servable,
    address: str,
    *,
    tls: TLSFiles | None = None,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
) -> tuple[ServerHandle, int]:
    """A server for `service` bound to `address` ("host:0" picks a free port), over TLS when `tls` is given;
    `interceptors` run after authentication. Returns the handle (not yet serving) and the port. gRPC in front-end
    processes instead is tether.server.launch.listen's choice."""
    handle = ServerHandle(service, interceptors)
    try:
        port = handle.bind(address, tls)
    except BaseException:
        handle.stop(None).wait()
        raise
    return handle, port
