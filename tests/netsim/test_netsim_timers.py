"""netsim.timers: the proxy's event loop waits out timeouts in microseconds and is otherwise asyncio's own loop; and
bench/netsim_rtt.py's record. No test asserts a time: what is checked is the timeout each wait is given."""

import asyncio
import json
import selectors
import socket

import pytest
from bench_modules import load_bench
from netsim_helpers import connect, recv_exactly

from tether.netsim import timers
from tether.netsim.proxy import LinkConfig, NetSimThread

linux = pytest.mark.skipif(not timers.uses_microseconds(), reason="asyncio's selector here is not epoll")


@pytest.fixture
def selector():
    sel = timers.MicrosecondEpollSelector()
    yield sel
    sel.close()


def recording(monkeypatch) -> list:
    """select.select as timers calls it, recording each timeout."""
    seen, real = [], timers.select.select

    def select(r, w, x, timeout=None):
        seen.append(timeout)
        return real(r, w, x, timeout)

    monkeypatch.setattr(timers.select, "select", select)
    return seen


@linux
def test_a_timed_wait_is_given_its_timeout_in_microseconds(monkeypatch, selector):
    seen = recording(monkeypatch)
    assert selector.select(0.00025) == []
    assert seen == [0.00025]  # epoll_wait alone would have been given 1 ms
    assert selector.select(0) == [] and seen == [0.00025]  # a poll does not wait


@linux
def test_ready_events_are_still_epolls(monkeypatch, selector):
    seen = recording(monkeypatch)
    a, b = socket.socketpair()
    with a, b:
        selector.register(a, selectors.EVENT_READ, "data")
        b.send(b"x")
        ready = selector.select(5.0)  # returns on the event, not at the timeout
        assert [(key.data, events) for key, events in ready] == [("data", selectors.EVENT_READ)]
        assert seen == [5.0]


@linux
def test_past_fd_setsize_the_wait_is_epolls_own(monkeypatch, selector):
    seen = recording(monkeypatch)
    monkeypatch.setattr(timers, "FD_SETSIZE", 0)
    assert selector.select(0.00025) == []
    assert seen == []


def test_the_loop_runs_timers_in_order_and_carries_bytes():
    loop = timers.new_event_loop()
    if timers.uses_microseconds():
        assert isinstance(loop._selector, timers.MicrosecondEpollSelector)
    order = []

    async def main():
        async def echo(reader, writer):
            writer.write(await reader.readexactly(5))
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(echo, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        for delay in (0.003, 0.0001, 0.0015, 0):
            loop.call_later(delay, order.append, delay)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"hello")
        got = await reader.readexactly(5)
        await asyncio.sleep(0.004)
        writer.close()
        server.close()
        await server.wait_closed()
        return got

    try:
        assert loop.run_until_complete(main()) == b"hello"
    finally:
        loop.close()
    assert order == [0, 0.0001, 0.0015, 0.003]


def test_netsim_thread_runs_on_the_loop_it_is_given(echo):
    made = []

    def factory():
        made.append(timers.new_event_loop())
        return made[-1]

    with NetSimThread("127.0.0.1:0", echo.address, LinkConfig(latency_ms=1, bandwidth_kbps=8000),
                      loop_factory=factory) as sim:  # fmt: skip
        with connect(sim.port) as sock:
            sock.sendall(b"x" * 3000)
            assert recv_exactly(sock, 3000) == b"x" * 3000
    assert len(made) == 1 and made[0].is_closed()


def test_bench_netsim_rtt_record(capsys):
    bench = load_bench("netsim_rtt")
    assert bench.main(["--rtt-ms", "0", "2", "--mbps", "0", "50", "--rounds", "3", "--down-bytes", "700"]) == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert record["bench"] == "netsim_rtt" and record["microsecond_timers"] == timers.uses_microseconds()
    cells = record["cells"]
    assert cells[0]["direct"] and len(cells) == 1 + 2 * 2 * 2
    through = [(c["rtt_ms"], c["mbps"], c["loop"]) for c in cells[1:]]
    assert through == [(r, m, loop) for r in (0, 2) for m in (0, 50) for loop in ("microsecond", "stock")]
    for c in cells[1:]:
        # Never faster than the link allows (bytes at the cap, and the round trip), whatever the timers.
        wire_ms = (64 + 700) * 8 / (c["mbps"] * 1e3) if c["mbps"] else 0.0
        assert c["median_ms"] >= c["rtt_ms"] + wire_ms - 0.05
