"""The netsim proxy on loopback: bytes, order, latency and bandwidth as lower bounds, cut, stall, restore, stats.

Timing is only ever asserted as "not before": the proxy may be late on a busy machine, never early.
"""

import asyncio
import socket
import time

import pytest
from netsim_helpers import closed_by_peer, connect, recv_exactly, wait_for

from tether.netsim.proxy import NetSim, NetSimThread
from tether.netsim.records import LinkConfig, LinkState, parse_address

SLACK_S = 0.005  # timer granularity: a deadline may fire this much early


def roundtrip(sock: socket.socket, data: bytes) -> bytes:
    sock.sendall(data)
    return recv_exactly(sock, len(data))


def closed_by_peer_eventually(sock: socket.socket) -> bool:
    """Like closed_by_peer, reading past bytes that were already on their way."""
    try:
        for _ in range(10_000):  # bounded: at most a few MB of queued bytes
            if not sock.recv(65536):
                return True
    except ConnectionResetError:
        return True
    return False


def refused_at_once(port: int) -> bool:
    """A connection the proxy accepts, then resets at once (connect itself may already see the reset)."""
    try:
        with connect(port) as sock:
            return closed_by_peer(sock)
    except ConnectionResetError:
        return True


def test_bytes_pass_both_ways_in_order_and_are_counted(echo):
    payloads = [b"hello", bytes(range(256)) * 4, b"x" * (1 << 20)]
    with NetSimThread("127.0.0.1:0", echo.address) as sim:
        sock = connect(sim.port)
        for data in payloads:
            assert roundtrip(sock, data) == data
        sock.shutdown(socket.SHUT_WR)  # the half-close goes through; the echo server closes in turn
        assert sock.recv(1) == b""
        sock.close()
        assert wait_for(lambda: sim.stats().connections_open == 0)
    stats = sim.stats()  # the final counts, kept after stop
    total = sum(map(len, payloads))
    assert stats.up_bytes == stats.down_bytes == total
    assert (stats.connections_accepted, stats.connections_reset, stats.connections_refused) == (1, 0, 0)
    (conn,) = stats.connections
    assert (conn.up_bytes, conn.down_bytes, conn.outcome) == (total, total, "closed")
    assert echo.endings == ["eof"]


def test_jitter_delays_but_never_reorders(echo):
    with NetSimThread("127.0.0.1:0", echo.address, LinkConfig(latency_ms=1, jitter_ms=20), seed=7) as sim:
        sock = connect(sim.port)
        sent = b""
        for i in range(150):  # many small writes, so the proxy reads (and jitters) many separate chunks
            piece = f"<{i}>".encode()
            sock.sendall(piece)
            sent += piece
            time.sleep(0.001)
        assert recv_exactly(sock, len(sent)) == sent
        sock.close()


def test_latency_is_added_each_way(echo):
    with NetSimThread("127.0.0.1:0", echo.address, LinkConfig(latency_ms=100)) as sim:
        sock = connect(sim.port)
        t0 = time.monotonic()
        assert roundtrip(sock, b"ping") == b"ping"
        assert time.monotonic() - t0 >= 0.2 - SLACK_S  # 100 ms up + 100 ms down
        sock.close()


def test_bandwidth_caps_throughput(echo):
    # 800 kbps = 100 kB/s each way: 50 kB cannot be through in under 0.5 s (up and down overlap, so not 1 s).
    with NetSimThread("127.0.0.1:0", echo.address, LinkConfig(bandwidth_kbps=800)) as sim:
        sock = connect(sim.port)
        data = bytes(50_000)
        t0 = time.monotonic()
        assert roundtrip(sock, data) == data
        assert time.monotonic() - t0 >= 0.5 - SLACK_S
        sock.close()


def test_cut_resets_open_connections_and_refuses_new_ones_until_restore(echo):
    with NetSimThread("127.0.0.1:0", echo.address) as sim:
        with connect(sim.port) as sock:
            assert roundtrip(sock, b"before") == b"before"
            assert sim.cut() == 1
            assert sim.state == LinkState.CUT
            assert closed_by_peer(sock)
        assert wait_for(lambda: echo.endings == ["reset"])  # the server's end was reset too
        assert refused_at_once(sim.port)
        sim.restore()
        with connect(sim.port) as again:
            assert roundtrip(again, b"after") == b"after"
        stats = sim.stats()
    assert (stats.connections_accepted, stats.connections_reset, stats.connections_refused) == (3, 1, 1)
    assert stats.connections[0].outcome == "cut"


def test_stall_holds_everything_then_delivers_it_in_order(echo):
    with NetSimThread("127.0.0.1:0", echo.address) as sim:
        sock = connect(sim.port)
        assert roundtrip(sock, b"flowing") == b"flowing"
        sim.stall()
        before = sim.stats()
        sock.sendall(b"held-1 ")
        late = connect(sim.port)  # a connection made during the stall is accepted, its bytes held too
        late.sendall(b"late")
        sock.sendall(b"held-2")
        for s in (sock, late):
            s.settimeout(0.3)
            with pytest.raises(TimeoutError):
                s.recv(1)
        during = sim.stats()
        assert (during.up_bytes, during.down_bytes) == (before.up_bytes, before.down_bytes)  # nothing either way
        assert during.connections_open == 2 and during.state == "stall"
        sim.restore()
        for s in (sock, late):
            s.settimeout(5)
        assert recv_exactly(sock, 13) == b"held-1 held-2"
        assert recv_exactly(late, 4) == b"late"
        sock.close()
        late.close()


def test_stall_holds_the_close_too(echo):
    with NetSimThread("127.0.0.1:0", echo.address) as sim, connect(sim.port) as sock:
        assert roundtrip(sock, b"x") == b"x"
        sim.stall()
        sock.sendall(b"bye")
        sock.shutdown(socket.SHUT_WR)
        assert not wait_for(lambda: echo.endings, timeout_s=0.3)  # the server has not seen the FIN
        sim.restore()
        assert recv_exactly(sock, 4) == b"bye"  # then EOF: the server closed in turn
        assert wait_for(lambda: echo.endings == ["eof"])


def test_cut_in_the_middle_of_busy_transfers(echo):
    # Three connections pushing data through a capped link, so every pump is mid-transfer when the cut lands: at
    # 100 kB/s the 600 kB need 6 s, far more than even a busy machine takes to see 1000 bytes back on each.
    with NetSimThread("127.0.0.1:0", echo.address, LinkConfig(bandwidth_kbps=800)) as sim:
        socks = [connect(sim.port) for _ in range(3)]
        for sock in socks:
            sock.sendall(bytes(200_000))
            assert len(recv_exactly(sock, 1000)) == 1000
        assert sim.cut() == 3
        assert all(closed_by_peer_eventually(sock) for sock in socks)
        for sock in socks:
            sock.close()
        stats = sim.stats()
    assert [c.outcome for c in stats.connections] == ["cut"] * 3
    assert stats.connections_reset == 3 and stats.up_bytes < 600_000


def test_set_link_at_runtime_per_direction(echo):
    with NetSimThread("127.0.0.1:0", echo.address) as sim:
        sock = connect(sim.port)
        sim.set_link(latency_ms=150, direction="up")
        assert sim.link("up").latency_ms == 150 and sim.link("down").latency_ms == 0
        t0 = time.monotonic()
        assert roundtrip(sock, b"slow") == b"slow"
        assert time.monotonic() - t0 >= 0.15 - SLACK_S
        sim.set_link(latency_ms=0, bandwidth_kbps=1000)  # both ways; jitter left as it was
        assert sim.link("down") == LinkConfig(latency_ms=0, jitter_ms=0, bandwidth_kbps=1000)
        with pytest.raises(ValueError, match="direction"):
            sim.set_link(latency_ms=1, direction="sideways")
        with pytest.raises(ValueError, match="latency_ms"):
            sim.set_link(latency_ms=-1)
        sock.close()


def test_unreachable_upstream_closes_the_client_and_counts_a_failure():
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        dead = probe.getsockname()[1]
    with NetSimThread("127.0.0.1:0", f"127.0.0.1:{dead}") as sim:
        assert refused_at_once(sim.port)
        assert wait_for(lambda: sim.stats().connections_failed == 1)
        assert sim.stats().connections[0].outcome == "failed"


def test_event_hook_sees_connections_and_state_changes(echo):
    events = []
    with NetSimThread("127.0.0.1:0", echo.address, on_event=events.append) as sim, connect(sim.port) as sock:
        assert roundtrip(sock, b"x") == b"x"
        sim.stall()
        sim.restore()
        sim.set_link(jitter_ms=3)
        sim.cut()
        sim.restore()
    kinds = [e.kind for e in events]
    assert kinds == ["listening", "accepted", "stall", "restore", "set", "cut", "restore", "stopped"]
    assert events[5].detail == {"reset": 1} and events[4].detail == {"direction": "both", "jitter_ms": 3}
    assert all(a.t <= b.t for a, b in zip(events, events[1:], strict=False))


def test_stop_resets_connections_and_stops_listening(echo):
    sim = NetSimThread("127.0.0.1:0", echo.address)
    port = sim.start()
    with connect(port) as sock:
        assert roundtrip(sock, b"x") == b"x"
        sim.stop()
        assert closed_by_peer(sock)
    with pytest.raises(ConnectionRefusedError):
        connect(port)
    sim.stop()  # idempotent


def test_asyncio_api():
    async def main():
        async def echo_back(reader, writer):
            while data := await reader.read(65536):
                writer.write(data)
            writer.close()

        upstream = await asyncio.start_server(echo_back, "127.0.0.1", 0)
        sim = NetSim("127.0.0.1:0", ("127.0.0.1", upstream.sockets[0].getsockname()[1]), LinkConfig(latency_ms=5))
        port = await sim.start()
        assert sim.address == f"127.0.0.1:{port}"
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"async")
        assert await asyncio.wait_for(reader.readexactly(5), 5) == b"async"
        assert sim.cut() == 1
        try:
            assert await asyncio.wait_for(reader.read(), 5) == b""
        except ConnectionResetError:
            pass  # reset or EOF: either way, gone
        sim.restore()
        await sim.stop()
        upstream.close()
        return sim.stats()

    stats = asyncio.run(main())
    assert (stats.up_bytes, stats.down_bytes, stats.connections_reset) == (5, 5, 1)


def test_bad_arguments_are_clear_errors(echo):
    for text in ("nope", "host:", ":80", "host:99999"):
        with pytest.raises(ValueError, match="HOST:PORT"):
            parse_address(text)
    assert parse_address("[::1]:80") == ("::1", 80)
    with pytest.raises(ValueError, match="bandwidth_kbps"):
        LinkConfig(bandwidth_kbps=float("nan"))
    with NetSimThread("127.0.0.1:0", echo.address) as sim:
        with pytest.raises(OSError):  # the port is taken
            NetSimThread(sim.address, echo.address).start()
