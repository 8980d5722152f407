"""How faithful tether-netsim's link is: round trips through the proxy against the round trip it was set to.

A client on this host sends `--up-bytes` and an echo peer answers `--down-bytes` (a draft round up, a verdict with
its KV delta down, by default), `--rounds` times per cell, over loopback directly and through netsim at every RTT in
`--rtt-ms` (one-way latency RTT/2 each way) x every bandwidth in `--mbps` (0: uncapped), with the proxy's event loop
as it runs (netsim.timers: timers waited in microseconds) and with asyncio's stock loop (`--loops`), whose timers
on Linux wait in whole milliseconds, rounded up. The proxy runs in a process of its own (NetSimProcess), as
bench/link.py runs it.

Reported per cell: the median and 90th percentile round trip, and `extra_ms`: the median minus what an ideal link
of that setting takes (the RTT, the direct loopback round trip, and each direction's bytes at the cap). Prints a
table, then one JSON line (record "bench": "netsim_rtt").

    python bench/netsim_rtt.py
    python bench/netsim_rtt.py --rtt-ms 0 10 50 --mbps 0 100 10 --rounds 200
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import socket
import socketserver
import statistics
import sys
import threading
import time

from rich.console import Console
from rich.table import Table

from tether.netsim import timers
from tether.netsim.process import NetSimProcess
from tether.netsim.proxy import LinkConfig

LOOPS = {"microsecond": timers.new_event_loop, "stock": asyncio.new_event_loop}


class _Answer(socketserver.BaseRequestHandler):
    """Reads `up` bytes, answers `down` bytes, until the client closes."""

    def handle(self):
        up, down = self.server.sizes
        sock = self.request
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(30)
        reply = b"d" * down
        try:
            while _read(sock, up):
                sock.sendall(reply)
        except OSError:
            pass


class Peer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, up: int, down: int):
        super().__init__(("127.0.0.1", 0), _Answer)
        self.sizes = (up, down)


def _read(sock: socket.socket, n: int) -> bool:
    """Read exactly n bytes; False at EOF."""
    got = 0
    while got < n:
        chunk = sock.recv(min(65536, n - got))
        if not chunk:
            return False
        got += len(chunk)
    return True


def round_trips(port: int, up: int, down: int, rounds: int, warmup: int = 5) -> list[float]:
    """Milliseconds of each of `rounds` round trips (after `warmup` untimed ones) on one connection."""
    out = []
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        msg = b"u" * up
        for i in range(warmup + rounds):
            t0 = time.perf_counter()
            sock.sendall(msg)
            if not _read(sock, down):
                raise ConnectionError("the peer closed mid-run")
            if i >= warmup:
                out.append((time.perf_counter() - t0) * 1e3)
    return out


def summary(ms: list[float]) -> tuple[float, float]:
    """(median, 90th percentile)."""
    s = sorted(ms)
    return statistics.median(s), s[min(len(s) - 1, int(0.9 * len(s)))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rtt-ms", type=float, nargs="+", default=[0, 10, 50], help="round trips netsim adds")
    ap.add_argument("--mbps", type=float, nargs="+", default=[0, 100], help="bandwidth caps each way (0: none)")
    ap.add_argument("--loops", nargs="+", choices=sorted(LOOPS), default=["microsecond", "stock"],
                    help="the proxy's loop: netsim's own (microsecond timers), asyncio's stock one")  # fmt: skip
    ap.add_argument("--rounds", type=int, default=100, help="timed round trips per cell")
    ap.add_argument("--up-bytes", type=int, default=64, help="bytes sent each round (a draft round's size)")
    ap.add_argument("--down-bytes", type=int, default=6000, help="bytes answered each round (a verdict and delta)")
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.up_bytes < 1 or args.down_bytes < 1:
        ap.error("--rounds, --up-bytes and --down-bytes must be >= 1")

    peer = Peer(args.up_bytes, args.down_bytes)
    threading.Thread(target=peer.serve_forever, daemon=True).start()
    cells = []
    try:
        direct = summary(round_trips(peer.server_address[1], args.up_bytes, args.down_bytes, args.rounds))
        cells.append({"loop": "-", "rtt_ms": 0.0, "mbps": 0.0, "median_ms": direct[0], "p90_ms": direct[1],
                      "extra_ms": 0.0, "direct": True})  # fmt: skip
        for rtt in args.rtt_ms:
            for mbps in args.mbps:
                wire = (args.up_bytes + args.down_bytes) * 8 / (mbps * 1e3) if mbps else 0.0  # ms at the cap
                for name in args.loops:
                    link = LinkConfig(latency_ms=rtt / 2, bandwidth_kbps=mbps * 1000)
                    upstream = f"127.0.0.1:{peer.server_address[1]}"
                    with NetSimProcess("127.0.0.1:0", upstream, link, loop_factory=LOOPS[name]) as sim:
                        med, p90 = summary(round_trips(sim.port, args.up_bytes, args.down_bytes, args.rounds))
                    cells.append({"loop": name, "rtt_ms": rtt, "mbps": mbps, "median_ms": med, "p90_ms": p90,
                                  "extra_ms": med - rtt - direct[0] - wire, "direct": False})  # fmt: skip
    finally:
        peer.shutdown()
        peer.server_close()

    t = Table(title=f"round trips through netsim: {args.up_bytes} B up, {args.down_bytes} B down, {args.rounds} each")
    for col in ("link", "loop", "median ms", "p90 ms", "extra ms"):
        t.add_column(col, justify="right")
    for c in cells:
        where = "direct" if c["direct"] else f"RTT {c['rtt_ms']:g} ms, {c['mbps']:g} Mbit/s" if c["mbps"] else \
            f"RTT {c['rtt_ms']:g} ms, uncapped"  # fmt: skip
        t.add_row(where, c["loop"], f"{c['median_ms']:.3f}", f"{c['p90_ms']:.3f}", f"{c['extra_ms']:.3f}")
    Console().print(t)
    record = {"bench": "netsim_rtt", "python": sys.version.split()[0], "platform": platform.platform(),
              "microsecond_timers": timers.uses_microseconds(), "args": vars(args), "cells": cells}  # fmt: skip
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
