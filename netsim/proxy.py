"""The netsim proxy: an asyncio TCP proxy whose link (latency, jitter, bandwidth, cut, stall) changes live.

Purpose: put a misbehaving network between a gRPC client and server on loopback, so tests and the demo can see
what the edge client does when the link is slow, drops (`cut`) or goes silent (`stall`). It copies raw TCP bytes,
so HTTP/2 and TLS pass through untouched.

Contract:
- Every accepted connection gets its own connection to `upstream`. Bytes client->server go "up", server->client
  "down"; each direction is a link of its own with the same model (`LinkConfig`, settable per direction):
  a chunk read at time t is serialized onto the link at the bandwidth cap, behind what the link was given
  before (one serialization queue per direction, shared by all connections, as on one real link), and delivered
  latency + uniform(0, jitter) after its last byte is on, never before the chunk read before it on the same
  connection (no reordering). One timer per chunk (per piece of ~20 ms of the link under a cap), on an event loop
  whose timers wait in microseconds (tether.netsim.timers), so the link's delays are what they were set to.
- `cut()` resets every open connection (RST to both ends; bytes in flight are dropped) and refuses new ones
  (accepted, then reset at once) until `restore()`. `stall()` keeps connections open and new ones are still
  accepted, but nothing is delivered either way (FINs and resets included) until `restore()`, which then delivers
  what was held, in order. Connection setup itself is never delayed or held; only bytes are.
- Reading stops while `max_buffer_bytes` of one direction of one connection are held, so a stalled or slow link
  pushes back on the sender the way a full TCP window does.
- `stats()` counts bytes delivered each way (total and per connection) and connections accepted, refused, reset
  (by `cut`), failed (upstream unreachable) and open. `on_event` sees every state change and connection.
- The values it takes and reports (LinkConfig, LinkState, NetSimEvent, NetSimStats, ConnStats, HOST:PORT
  addresses) are tether.netsim.records'; this module runs the link.
- `NetSim` lives on one asyncio loop and is not thread-safe; `NetSimThread` runs one on a background thread with
  its own loop, and its methods may be called from any thread (sync code, gRPC tests, the demo).

    with NetSimThread("127.0.0.1:0", "127.0.0.1:50051", LinkConfig(latency_ms=40)) as sim:
        channel = grpc.insecure_channel(f"127.0.0.1:{sim.port}")
        sim.cut(); ...; sim.restore(); print(sim.stats().up_bytes)
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import random
import socket
import struct
import threading
from collections import deque
from collections.abc import Callable, Sequence

from tether.netsim import timers
from tether.netsim.records import (
    DIRECTIONS,
    HISTORY,
    ConnStats,
    LinkConfig,
    LinkState,
    NetSimEvent,
    NetSimStats,
    format_address,
    parse_address,
)
from tether.netsim.scenario import Scenario, parse_scenario, play

READ_CHUNK = 64 * 1024  # bytes read from a socket at once (a chunk keeps its arrival time as one unit)
_EOF = object()  # the sender closed its side (FIN): delivered in order, as write_eof()
_RESET = object()  # the sender's side failed (RST, error): delivered in order, as a reset of the whole connection


def _directions(direction: str) -> tuple[str, ...]:
    if direction == "both":
        return DIRECTIONS
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be up, down or both, got {direction!r}")
    return (direction,)


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close abruptly: SO_LINGER 0 makes the kernel send RST, so the far end sees a reset rather than a clean EOF."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass  # already closed
    writer.transport.abort()


async def _sleep_until(loop: asyncio.AbstractEventLoop, when: float) -> None:
    delay = when - loop.time()
    if delay > 0:
        await asyncio.sleep(delay)


class _Broken(Exception):
    """One end of a connection reset or failed: reset the whole connection."""


class _Conn:
    def __init__(self, cid: int, peer: str, opened_s: float, task: asyncio.Task):
        self.id, self.peer, self.opened_s, self.task = cid, peer, opened_s, task
        self.bytes = dict.fromkeys(DIRECTIONS, 0)
        self.closed_s: float | None = None
        self.outcome = "open"
        self.writers: list[asyncio.StreamWriter] = []

    def stats(self) -> ConnStats:
        return ConnStats(
            self.id, self.peer, self.bytes["up"], self.bytes["down"], self.opened_s, self.closed_s, self.outcome
        )


class _Pipe:
    """One direction of one connection: chunks read but not yet delivered, each with its due time."""

    def __init__(self, limit: int):
        self.items: deque[tuple[float, object]] = deque()
        self.held = 0
        self.limit = limit
        self.last_due = 0.0
        self.cond = asyncio.Condition()

    async def put(self, due: float, item: object) -> None:
        async with self.cond:
            await self.cond.wait_for(lambda: self.held < self.limit)
            self.items.append((due, item))
            self.held += len(item) if isinstance(item, bytes) else 0
            self.cond.notify_all()

    async def get(self) -> tuple[float, object]:
        async with self.cond:
            await self.cond.wait_for(lambda: bool(self.items))
            due, item = self.items.popleft()
            self.held -= len(item) if isinstance(item, bytes) else 0
            self.cond.notify_all()
            return due, item


class _Shaper:
    """One direction's serialization queue, shared by every connection: bytes go onto the link at most at its rate."""

    def __init__(self):
        self.free_at = 0.0  # loop time the link finishes sending what it has been given

    def reserve(self, now: float, n: int, bytes_per_s: float) -> float:
        """When `n` bytes handed to the link at `now` are all on it (behind what it was given before)."""
        if bytes_per_s <= 0:
            return now
        self.free_at = max(now, self.free_at) + n / bytes_per_s
        return self.free_at


def _pieces(data: bytes, bytes_per_s: float) -> list[bytes]:
    """Under a cap, a chunk leaves in pieces of ~20 ms of the link, so it trickles out rather than lands whole."""
    if bytes_per_s <= 0:
        return [data]
    size = max(256, int(bytes_per_s / 50))
    return [data[i : i + size] for i in range(0, len(data), size)]


class NetSim:
    """The proxy. Construct, `await start()`, drive with cut/stall/restore/set_link, `await stop()`."""

    def __init__(
        self,
        listen: str | tuple[str, int],
        upstream: str | tuple[str, int],
        link: LinkConfig | None = None,
        *,
        scenario: Scenario | Sequence[dict] | None = None,
        on_event: Callable[[NetSimEvent], None] | None = None,
        seed: int | None = None,
        max_buffer_bytes: int = 4 << 20,
        connect_timeout_s: float = 5.0,
    ):
        """`scenario` plays from start(). `on_event` runs on the proxy's loop: it must not block; an exception
        in it is logged by the loop and otherwise ignored. `seed` fixes the jitter draws. `link` (default: a
        perfect link) applies to both directions."""
        self.listen = parse_address(listen) if isinstance(listen, str) else listen
        self.upstream = parse_address(upstream) if isinstance(upstream, str) else upstream
        self.scenario = scenario if scenario is None or isinstance(scenario, Scenario) else parse_scenario(scenario)
        self.on_event = on_event
        self.max_buffer_bytes = max_buffer_bytes
        self.connect_timeout_s = connect_timeout_s
        self._links = dict.fromkeys(DIRECTIONS, link or LinkConfig())
        self._rng = random.Random(seed)
        self._state = LinkState.NORMAL
        self._flowing = asyncio.Event()  # set unless stalled; deliveries wait on it
        self._flowing.set()
        self._done = asyncio.Event()  # a scenario's `end` played, or stop() ran
        self._shapers = {d: _Shaper() for d in DIRECTIONS}
        self._conns: dict[int, _Conn] = {}
        self._history: deque[_Conn] = deque(maxlen=HISTORY)
        self._ids = itertools.count(1)
        self._bytes = dict.fromkeys(DIRECTIONS, 0)
        self._counts = dict.fromkeys(("accepted", "refused", "reset", "failed"), 0)
        self._tasks: set[asyncio.Task] = set()  # scenario playbacks
        self._server: asyncio.Server | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._t0 = 0.0
        self.port: int | None = None  # the bound port, once started

    # --- lifecycle

    async def start(self) -> int:
        """Bind and start accepting; returns the bound port (the real one when listen's port is 0)."""
        if self._server is not None:
            raise RuntimeError("NetSim already started")
        self._loop = asyncio.get_running_loop()
        self._server = await asyncio.start_server(self._on_client, *self.listen)
        self.port = self._server.sockets[0].getsockname()[1]
        self._t0 = self._loop.time()
        self._emit("listening", address=self.address, upstream=format_address(*self.upstream))
        if self.scenario is not None:
            self.play(self.scenario)
        return self.port

    @property
    def address(self) -> str:
        """HOST:PORT clients should connect to (the bound port)."""
        return format_address(self.listen[0], self.port if self.port is not None else self.listen[1])

    async def stop(self) -> None:
        """Stop listening, stop any scenario, reset every open connection. Idempotent."""
        if self._server is None or not self._server.is_serving():
            return
        self._server.close()
        for task in self._tasks:
            task.cancel()
        conns = list(self._conns.values())
        for conn in conns:
            self._kill(conn, "stopped")
        await asyncio.gather(*self._tasks, *(c.task for c in conns), return_exceptions=True)
        await self._server.wait_closed()
        self._emit("stopped", up_bytes=self._bytes["up"], down_bytes=self._bytes["down"])
        self._done.set()

    async def wait_done(self) -> None:
        """Returns once a scenario's `end` event has played (or the proxy stopped)."""
        await self._done.wait()

    # --- live control (call on the proxy's loop; NetSimThread does that for other threads)

    @property
    def state(self) -> LinkState:
        return self._state

    def link(self, direction: str = "up") -> LinkConfig:
        return self._links[_directions(direction)[0]]

    def cut(self) -> int:
        """Reset every open connection and refuse new ones until restore(); returns how many were reset."""
        self._state = LinkState.CUT
        self._flowing.set()  # nothing is held under a cut: held bytes died with their connections
        conns = list(self._conns.values())
        for conn in conns:
            self._kill(conn, "cut")
        for shaper in self._shapers.values():  # what they were sending died with them
            shaper.free_at = 0.0
        self._counts["reset"] += len(conns)
        self._emit("cut", reset=len(conns))
        return len(conns)

    def stall(self) -> None:
        """Hold every byte (both ways, all connections, new ones too) until restore()."""
        self._state = LinkState.STALL
        self._flowing.clear()
        self._emit("stall", open=len(self._conns))

    def restore(self) -> None:
        """Back to normal: accept connections again, deliver what a stall held."""
        self._state = LinkState.NORMAL
        self._flowing.set()
        self._emit("restore")

    def set_link(
        self,
        latency_ms: float | None = None,
        jitter_ms: float | None = None,
        bandwidth_kbps: float | None = None,
        direction: str = "both",
    ) -> None:
        """Change the given fields of one direction's link ("up", "down") or both; None leaves a field as it is.
        Applies to bytes read from now on (those already scheduled keep their due time)."""
        changes = {"latency_ms": latency_ms, "jitter_ms": jitter_ms, "bandwidth_kbps": bandwidth_kbps}
        changes = {k: v for k, v in changes.items() if v is not None}
        directions = _directions(direction)
        new = {d: dataclasses.replace(self._links[d], **changes) for d in directions}  # validate before applying
        self._links.update(new)
        self._emit("set", direction=direction, **changes)

    def finish(self) -> None:
        """What a scenario's `end` event does: wake wait_done(), so the owner stops the proxy."""
        self._emit("end")
        self._done.set()

    def play(self, scenario: Scenario | Sequence[dict]) -> asyncio.Task:
        """Play a scenario in the background, its times counted from now; stop() cancels it."""
        if not isinstance(scenario, Scenario):
            scenario = parse_scenario(scenario)
        task = asyncio.get_running_loop().create_task(play(self, scenario))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def stats(self) -> NetSimStats:
        conns = sorted([*self._history, *self._conns.values()], key=lambda c: c.id)
        return NetSimStats(
            state=str(self._state),
            elapsed_s=round(self._now(), 6),
            up_bytes=self._bytes["up"],
            down_bytes=self._bytes["down"],
            connections_accepted=self._counts["accepted"],
            connections_refused=self._counts["refused"],
            connections_reset=self._counts["reset"],
            connections_failed=self._counts["failed"],
            connections_open=len(self._conns),
            up=self._links["up"],
            down=self._links["down"],
            connections=tuple(c.stats() for c in conns),
        )

    # --- internals

    def _now(self) -> float:
        return self._loop.time() - self._t0 if self._loop is not None else 0.0

    def _emit(self, kind: str, **detail) -> None:
        if self.on_event is None:
            return
        try:
            self.on_event(NetSimEvent(round(self._now(), 6), kind, detail))
        except Exception as e:  # a broken live view must not take the proxy down
            self._loop.call_exception_handler({"message": f"netsim on_event failed on {kind!r}", "exception": e})

    def _kill(self, conn: _Conn, outcome: str) -> None:
        conn.outcome = outcome
        for w in conn.writers:
            _reset(w)
        conn.task.cancel()

    async def _on_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._counts["accepted"] += 1
        peer = format_address(*writer.get_extra_info("peername")[:2])
        if self._state is LinkState.CUT:
            self._counts["refused"] += 1
            _reset(writer)
            self._emit("refused", peer=peer)
            return
        conn = _Conn(next(self._ids), peer, round(self._now(), 6), asyncio.current_task())
        conn.writers.append(writer)
        self._conns[conn.id] = conn
        try:
            await self._proxy(conn, reader, writer)
        except asyncio.CancelledError:
            if conn.outcome not in ("cut", "stopped"):
                raise  # not ours: let it through
        finally:
            for w in conn.writers:
                if conn.outcome == "closed":
                    w.close()
                else:
                    _reset(w)
            conn.closed_s = round(self._now(), 6)
            self._conns.pop(conn.id, None)
            self._history.append(conn)
            if conn.outcome in ("closed", "peer-reset"):  # cut, failed and stopped report themselves
                self._emit(conn.outcome, conn=conn.id, up_bytes=conn.bytes["up"], down_bytes=conn.bytes["down"])

    async def _proxy(self, conn: _Conn, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            connecting = asyncio.open_connection(*self.upstream)
            up_reader, up_writer = await asyncio.wait_for(connecting, self.connect_timeout_s)
        except (OSError, TimeoutError) as e:
            conn.outcome = "failed"
            self._counts["failed"] += 1
            self._emit("failed", conn=conn.id, peer=conn.peer, error=str(e) or type(e).__name__)
            return
        conn.writers.append(up_writer)
        self._emit("accepted", conn=conn.id, peer=conn.peer)
        try:
            async with asyncio.TaskGroup() as tg:
                for direction, src, dst in (("up", reader, up_writer), ("down", up_reader, writer)):
                    pipe = _Pipe(self.max_buffer_bytes)
                    tg.create_task(self._read(direction, src, pipe))
                    tg.create_task(self._deliver(conn, direction, pipe, dst))
            if conn.outcome == "open":
                conn.outcome = "closed"
        except* _Broken:
            # Unless a cut or stop got here first: their abort can surface in a pump as a broken end, and then
            # the TaskGroup raises that rather than the cancellation.
            if conn.outcome == "open":
                conn.outcome = "peer-reset"

    def _due(self, direction: str, pipe: _Pipe, n: int) -> float:
        """When `n` bytes read now arrive at the far end: once the link has serialized them (behind whatever it
        carries already, every connection's), plus the latency and jitter. One timer a piece: each timer fires a
        little late, so a chunk waits on one, not on one for its latency and another for its serialization."""
        link = self._links[direction]
        sent = self._shapers[direction].reserve(self._loop.time(), n, link.bytes_per_s)
        delay_ms = link.latency_ms + (self._rng.uniform(0, link.jitter_ms) if link.jitter_ms else 0.0)
        # Never before the previous chunk: jitter delays, it does not reorder (TCP would put it back in order).
        pipe.last_due = max(sent + delay_ms / 1000, pipe.last_due)
        return pipe.last_due

    async def _read(self, direction: str, src: asyncio.StreamReader, pipe: _Pipe) -> None:
        while True:
            try:
                data = await src.read(READ_CHUNK)
            except OSError:
                await pipe.put(self._due(direction, pipe, 0), _RESET)
                return
            if not data:
                await pipe.put(self._due(direction, pipe, 0), _EOF)
                return
            for piece in _pieces(data, self._links[direction].bytes_per_s):
                await pipe.put(self._due(direction, pipe, len(piece)), piece)

    async def _deliver(self, conn: _Conn, direction: str, pipe: _Pipe, dst: asyncio.StreamWriter) -> None:
        loop = self._loop
        while True:
            due, item = await pipe.get()
            await _sleep_until(loop, due)
            await self._flowing.wait()  # returns at once unless stalled (a stall holds FIN and RST too)
            if not isinstance(item, bytes):
                if item is _RESET:
                    raise _Broken(direction)
                try:
                    dst.write_eof()
                except OSError as e:
                    raise _Broken(direction) from e
                return
            # No await between the stall check and write(): a stall that begins now holds the next piece.
            if dst.transport.is_closing():
                raise _Broken(direction)
            dst.write(item)
            conn.bytes[direction] += len(item)
            self._bytes[direction] += len(item)
            try:
                await dst.drain()
            except OSError as e:
                raise _Broken(direction) from e


class NetSimThread:
    """A NetSim on a background thread with its own event loop, for sync code (gRPC tests, the demo).

    Every method may be called from any thread and returns once the proxy has acted (after cut() the connections
    are already reset). `on_event` runs on the proxy's thread.
    """

    def __init__(
        self, listen: str | tuple[str, int], upstream: str | tuple[str, int], link: LinkConfig | None = None, **kwargs
    ):
        """Takes NetSim's arguments, and `loop_factory` (timers.new_event_loop: timers precise to microseconds;
        asyncio.new_event_loop is the stock loop, whose timers on Linux fire up to a millisecond late)."""
        self._args = (listen, upstream, link)
        self._on_event = kwargs.pop("on_event", None)
        self._loop_factory = kwargs.pop("loop_factory", timers.new_event_loop)
        self._kwargs = kwargs
        self._sim: NetSim | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._final: NetSimStats | None = None  # stats() once stopped
        self.timeout_s = 10.0  # how long a call waits for the proxy's loop

    def start(self, timeout_s: float = 10.0) -> int:
        """Start the thread and bind; returns the bound port. Binding errors are raised here."""
        if self._thread is not None:
            raise RuntimeError("NetSimThread already started")
        self._thread = threading.Thread(target=self._run, name="netsim", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise TimeoutError("netsim did not start")
        if self._error is not None:
            self._thread.join(timeout_s)
            raise self._error
        return self.port

    def _run(self) -> None:
        loop = self._loop_factory()
        self._loop = loop
        try:
            self._sim = NetSim(*self._args, on_event=self._event, **self._kwargs)
            loop.run_until_complete(self._sim.start())
        except BaseException as e:  # handed to start()'s caller
            self._error = e
            self._ready.set()
            loop.close()
            return
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    def _event(self, event: NetSimEvent) -> None:
        if event.kind in ("end", "stopped"):
            self._done.set()
        if self._on_event is not None:
            self._on_event(event)

    def _call(self, fn: Callable, *args, **kwargs):
        if self._sim is None or self._loop is None or self._loop.is_closed():
            raise RuntimeError("NetSimThread is not running")
        if threading.current_thread() is self._thread:  # from on_event: already on the loop
            return fn(*args, **kwargs)

        async def on_loop():
            result = fn(*args, **kwargs)
            for _ in range(3):  # let aborted sockets close and cancelled connections unwind before returning
                await asyncio.sleep(0)
            return result

        return asyncio.run_coroutine_threadsafe(on_loop(), self._loop).result(self.timeout_s)

    @property
    def port(self) -> int:
        return self._sim.port

    @property
    def address(self) -> str:
        return self._sim.address

    def cut(self) -> int:
        return self._call(lambda: self._sim.cut())

    def stall(self) -> None:
        self._call(lambda: self._sim.stall())

    def restore(self) -> None:
        self._call(lambda: self._sim.restore())

    def set_link(
        self,
        latency_ms: float | None = None,
        jitter_ms: float | None = None,
        bandwidth_kbps: float | None = None,
        direction: str = "both",
    ) -> None:
        self._call(lambda: self._sim.set_link(latency_ms, jitter_ms, bandwidth_kbps, direction))

    def link(self, direction: str = "up") -> LinkConfig:
        return self._call(lambda: self._sim.link(direction))

    @property
    def state(self) -> LinkState:
        return self._call(lambda: self._sim.state)

    def stats(self) -> NetSimStats:
        """The counts now; after stop(), the final ones."""
        if self._final is not None:
            return self._final
        return self._call(lambda: self._sim.stats())

    def play(self, scenario: Scenario | Sequence[dict]) -> None:
        """Play a scenario in the background, its times counted from now."""
        self._call(lambda: self._sim.play(scenario))

    def wait_done(self, timeout_s: float | None = None) -> bool:
        """Block until a scenario's `end` has played or the proxy stopped; False on timeout."""
        return self._done.wait(timeout_s)

    def stop(self) -> None:
        """Reset every connection, stop listening, end the thread. Idempotent. Not from on_event (it would wait
        on the very loop it runs on)."""
        if self._thread is None or self._loop is None or self._loop.is_closed() or self._final is not None:
            return
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(self._sim.stop(), self._loop).result(self.timeout_s)
            self._final = self._call(lambda: self._sim.stats())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(self.timeout_s)

    def __enter__(self) -> NetSimThread:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
