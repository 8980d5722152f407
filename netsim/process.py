"""A netsim proxy in a process of its own, driven from the parent as NetSimThread is.

Purpose: a benchmark that times a Python client must not share that client's interpreter lock with the proxy.
NetSimThread runs the proxy's event loop on a thread of the caller's process, so every chunk it delays and
forwards competes with the client's own Python (drafting, gRPC's callbacks) for one lock, and a round trip through
it costs the client more than a real network would. NetSimProcess runs the same NetSimThread in a spawned child
and forwards each control call over a pipe.

Contract: the methods and properties of NetSimThread (start, port, address, cut, stall, restore, set_link, link,
state, stats, play, wait_done, stop; a context manager), with the same arguments and results, which cross the pipe
pickled. `on_event` is refused: events happen in the child. The child is spawned (not forked: the parent may hold
CUDA or gRPC state that a fork must not copy) and imports only this package; it ends when stop() is called, when
the parent's end of the pipe closes, or with the parent (daemon). A call that fails in the child raises its
exception here.

    with NetSimProcess("127.0.0.1:0", "127.0.0.1:50051", LinkConfig(latency_ms=5)) as sim:
        channel = grpc.insecure_channel(sim.address)
        sim.set_link(latency_ms=25); print(sim.stats().down_bytes)
"""

from __future__ import annotations

import math
import multiprocessing
from collections.abc import Sequence
from multiprocessing.connection import Connection

from tether.netsim.proxy import NetSimThread
from tether.netsim.records import LinkConfig, LinkState, NetSimStats
from tether.netsim.scenario import Scenario

_STOP = "stop"


def _serve(conn: Connection, listen, upstream, link: LinkConfig | None, kwargs: dict) -> None:
    """The child: one NetSimThread, answering (method, args, kwargs) with ("ok", result) or ("error", exception);
    "stop" stops the proxy and answers with its final stats."""
    sim = NetSimThread(listen, upstream, link, **kwargs)
    try:
        sim.start()
    except BaseException as e:  # binding failed: the parent's start() raises it
        conn.send(("error", e))
        return
    conn.send(("ok", (sim.port, sim.address)))
    try:
        while True:
            try:
                name, args, kw = conn.recv()
            except EOFError:  # the parent went away without stop()
                break
            try:
                if name == _STOP:
                    sim.stop()
                    conn.send(("ok", sim.stats()))
                    break
                attr = getattr(sim, name)
                conn.send(("ok", attr(*args, **kw) if callable(attr) else attr))
            except Exception as e:
                conn.send(("error", e))
    finally:
        sim.stop()


class NetSimProcess:
    """NetSimThread's interface, the proxy in a spawned child process (see the module docstring)."""

    def __init__(
        self, listen: str | tuple[str, int], upstream: str | tuple[str, int], link: LinkConfig | None = None, **kwargs
    ):
        """Takes NetSim's arguments, `on_event` excepted."""
        if "on_event" in kwargs:
            raise TypeError("NetSimProcess takes no on_event: events happen in the child process (use NetSimThread)")
        self._args = (listen, upstream, link, kwargs)
        self._conn: Connection | None = None
        self._proc: multiprocessing.process.BaseProcess | None = None
        self._bound: tuple[int, str] | None = None  # (port, address) once started
        self._final: NetSimStats | None = None  # stats() once stopped
        self.timeout_s = 10.0  # how long a call waits for the child's answer

    def start(self, timeout_s: float = 30.0) -> int:
        """Spawn the child and bind; returns the bound port. Binding errors are raised here."""
        if self._proc is not None:
            raise RuntimeError("NetSimProcess already started")
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child, *self._args), name="netsim", daemon=True)
        self._proc.start()
        child.close()
        try:
            self._bound = self._answer(timeout_s)
        except BaseException:
            self._kill()
            raise
        return self.port

    def _answer(self, timeout_s: float):
        if not self._conn.poll(None if math.isinf(timeout_s) else timeout_s):
            raise TimeoutError(f"the netsim process did not answer within {timeout_s} s")
        try:
            status, value = self._conn.recv()
        except EOFError:
            raise RuntimeError("the netsim process ended") from None
        if status == "error":
            raise value
        return value

    def _call(self, name: str, *args, wait_s: float | None = None, **kwargs):
        """The child's answer to sim.name(*args, **kwargs), waited for wait_s (self.timeout_s when None; math.inf:
        as long as it takes). A call left unanswered ends the child: its late answer would pass for the next one's."""
        if self._bound is None or self._final is not None or not self._proc.is_alive():
            raise RuntimeError("NetSimProcess is not running")
        self._conn.send((name, args, kwargs))
        try:
            return self._answer(self.timeout_s if wait_s is None else wait_s)
        except TimeoutError:
            self._kill()
            raise

    def _kill(self) -> None:
        if self._proc is not None and self._proc.is_alive():
            self._proc.kill()
            self._proc.join(self.timeout_s)
        if self._conn is not None:
            self._conn.close()

    @property
    def port(self) -> int:
        return self._bound[0]

    @property
    def address(self) -> str:
        return self._bound[1]

    def cut(self) -> int:
        return self._call("cut")

    def stall(self) -> None:
        self._call("stall")

    def restore(self) -> None:
        self._call("restore")

    def set_link(
        self,
        latency_ms: float | None = None,
        jitter_ms: float | None = None,
        bandwidth_kbps: float | None = None,
        direction: str = "both",
    ) -> None:
        self._call("set_link", latency_ms, jitter_ms, bandwidth_kbps, direction)

    def link(self, direction: str = "up") -> LinkConfig:
        return self._call("link", direction)

    @property
    def state(self) -> LinkState:
        return self._call("state")

    def stats(self) -> NetSimStats:
        """The counts now; after stop(), the final ones."""
        if self._final is not None:
            return self._final
        return self._call("stats")

    def play(self, scenario: Scenario | Sequence[dict]) -> None:
        """Play a scenario in the background, its times counted from now."""
        self._call("play", scenario)

    def wait_done(self, timeout_s: float | None = None) -> bool:
        """Block until a scenario's `end` has played or the proxy stopped; False on timeout."""
        return self._call("wait_done", timeout_s, wait_s=math.inf if timeout_s is None else timeout_s + self.timeout_s)

    def stop(self) -> None:
        """Reset every connection, stop listening, end the child. Idempotent."""
        if self._proc is None or self._final is not None:
            return
        try:
            if self._bound is not None and self._proc.is_alive():
                self._final = self._call(_STOP)
        finally:
            self._kill()

    def __enter__(self) -> NetSimProcess:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
