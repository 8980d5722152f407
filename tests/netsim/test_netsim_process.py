"""NetSimProcess: the proxy in a spawned child, driven over a pipe with NetSimThread's interface.

Each test spawns one child (a fresh interpreter importing tether.netsim only), so they are few and each checks
several calls. Timing is only asserted as "not before", as in test_netsim_proxy.py.
"""

import os
import socket
import time

import pytest
from netsim_helpers import closed_by_peer, connect, recv_exactly, wait_for

from tether.netsim.process import NetSimProcess
from tether.netsim.proxy import LinkConfig, LinkState


def roundtrip(sock: socket.socket, data: bytes) -> bytes:
    sock.sendall(data)
    return recv_exactly(sock, len(data))


def test_the_child_proxies_shapes_cuts_and_reports_as_the_thread_does(echo):
    sim = NetSimProcess("127.0.0.1:0", echo.address, LinkConfig(latency_ms=0))
    with sim:
        assert sim._proc.pid != os.getpid() and sim._proc.is_alive()
        assert sim.address == f"127.0.0.1:{sim.port}"
        with connect(sim.port) as sock:
            assert roundtrip(sock, b"hello" * 1000) == b"hello" * 1000
            sim.set_link(latency_ms=20, direction="up")
            assert sim.link("up").latency_ms == 20 and sim.link("down").latency_ms == 0
            t0 = time.monotonic()
            assert roundtrip(sock, b"slow") == b"slow"
            assert time.monotonic() - t0 >= 0.020 - 0.005  # the child's link shapes the bytes
            assert sim.cut() == 1
            assert sim.state == LinkState.CUT
            assert closed_by_peer(sock)
        sim.restore()
        with connect(sim.port) as again:
            assert roundtrip(again, b"after") == b"after"
        assert wait_for(lambda: sim.stats().connections_open == 0)
        live = sim.stats()
        assert live.up_bytes == live.down_bytes == 5000 + 4 + 5
        assert (live.connections_accepted, live.connections_reset) == (2, 1)
    final = sim.stats()  # kept after stop, with the child gone
    assert not sim._proc.is_alive()
    assert final.up_bytes == live.up_bytes and final.connections_accepted == 2
    sim.stop()  # idempotent
    with pytest.raises(RuntimeError, match="not running"):
        sim.cut()


def test_errors_in_the_child_are_raised_in_the_parent(echo):
    with NetSimProcess("127.0.0.1:0", echo.address) as sim:
        with pytest.raises(ValueError):
            sim.set_link(latency_ms=1, direction="sideways")
        assert sim.link().latency_ms == 0  # the child answers on after an error
        taken = NetSimProcess(sim.address, echo.address)
        with pytest.raises(OSError):  # the port is in use: binding fails in the child, start() raises it here
            taken.start()
        assert not taken._proc.is_alive()
    with pytest.raises(TypeError, match="on_event"):
        NetSimProcess("127.0.0.1:0", echo.address, on_event=print)


def test_wait_done_without_a_timeout_waits_for_the_scenario_and_the_pipe_stays_in_step(echo):
    with NetSimProcess("127.0.0.1:0", echo.address) as sim:
        sim.timeout_s = 0.05  # shorter than the scenario: wait_done() must not be bound by it
        sim.play([{"at": 0.3, "event": "set", "latency_ms": 7}, {"at": 0.3, "event": "end"}])
        assert sim.wait_done()
        sim.timeout_s = 10.0
        assert sim.link("down").latency_ms == 7  # the answer to this call, not a late one to an earlier call
