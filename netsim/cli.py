"""`tether-netsim`: a TCP proxy between a client and the server, with latency, jitter, a bandwidth cap and a
scripted scenario of cuts and stalls. It copies raw bytes, so gRPC, HTTP/2 and TLS pass through untouched.

tether-netsim --listen 127.0.0.1:50052 --upstream 127.0.0.1:50051 --latency-ms 40 --jitter-ms 10
tether-netsim --listen 127.0.0.1:0 --upstream 127.0.0.1:50051 --bandwidth-kbps 2000 --scenario flaky.json --json

Contract: prints one line `listening on HOST:PORT` once bound (port 0 picks a free one and prints it), logs link
events on stderr (unless --quiet), and on SIGTERM/SIGINT, or when the scenario's `end` event plays, prints the
bytes delivered each way (up = client->server, down = server->client) and connection counts: one line of text,
or with --json one JSON line (tether.netsim.proxy.NetSimStats.summary()). Exits 2 on a bad flag or scenario, or
an address that is not HOST:PORT. Scenario files: tether.netsim.scenario (times in seconds from the moment the proxy
listens). Every flag can also come from a TETHER_* environment variable, --foo-bar from TETHER_FOO_BAR (a switch:
1/0, true/false, yes/no); the command line wins, and --help lists each flag's default and variable.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from tether.netsim.proxy import LinkConfig, NetSim, NetSimEvent, NetSimStats
from tether.netsim.scenario import Scenario, load_scenario
from tether.shared.cli_support import (
    EnvParser,
    HelpFormatter,
    add_dataclass_args,
    add_version_flag,
    build_config,
    host_port,
)


@dataclass(frozen=True)
class NetSimConfig:
    listen: str = "127.0.0.1:50052"  # HOST:PORT clients connect to (port 0 = any free port)
    upstream: str = "127.0.0.1:50051"  # HOST:PORT of the server every connection is forwarded to
    latency_ms: float = 0.0  # one-way delay, each direction
    jitter_ms: float = 0.0  # extra one-way delay per chunk, uniform in [0, jitter-ms] (never reorders)
    bandwidth_kbps: float = 0.0  # cap in kilobits per second, each direction; 0 = unlimited
    scenario: str = ""  # JSON file of timed events (cut, stall, restore, set, end), seconds from start
    seed: int = -1  # seed of the jitter draws; -1 = a different one each run
    json: bool = False  # print the final counts as one JSON line
    quiet: bool = False  # no event log on stderr


def log_event(event: NetSimEvent) -> None:
    details = " ".join(f"{k}={v}" for k, v in event.detail.items())
    print(f"[{event.t:9.3f}s] {event.kind} {details}".rstrip(), file=sys.stderr, flush=True)


def format_stats(stats: NetSimStats) -> str:
    return (
        f"up {stats.up_bytes} bytes, down {stats.down_bytes} bytes; connections: {stats.connections_accepted} "
        f"accepted, {stats.connections_reset} reset, {stats.connections_refused} refused, "
        f"{stats.connections_failed} failed"
    )


async def serve(cfg: NetSimConfig, link: LinkConfig, scenario: Scenario | None) -> NetSimStats:
    sim = NetSim(cfg.listen, cfg.upstream, link, scenario=scenario, seed=None if cfg.seed < 0 else cfg.seed,
                 on_event=None if cfg.quiet else log_event)  # fmt: skip
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):  # before the listening line: whoever reads it may signal at once
        loop.add_signal_handler(sig, stop.set)
    await sim.start()
    print(f"listening on {sim.address}", flush=True)
    waits = [asyncio.create_task(stop.wait()), asyncio.create_task(sim.wait_done())]
    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    for task in waits:
        task.cancel()
    await sim.stop()
    return sim.stats()


def run(cfg: NetSimConfig) -> int:
    # Everything a user can get wrong fails here, before the port is bound.
    link = LinkConfig(cfg.latency_ms, cfg.jitter_ms, cfg.bandwidth_kbps)
    scenario = load_scenario(cfg.scenario) if cfg.scenario else None
    stats = asyncio.run(serve(cfg, link, scenario))
    print(json.dumps(stats.summary()) if cfg.json else format_stats(stats), flush=True)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = EnvParser(
        prog="tether-netsim",
        description="tether's network harness: a TCP proxy with latency, jitter, a bandwidth cap, cuts and stalls.",
        formatter_class=HelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    add_version_flag(parser, "tether")
    add_dataclass_args(parser, NetSimConfig, skip=("json", "quiet"), types={"listen": host_port, "upstream": host_port})
    # Plain switches rather than BooleanOptionalAction's --no-json / --no-quiet pairs.
    parser.add_argument("--json", action="store_true", help="print the final counts as one JSON line")
    parser.add_argument("--quiet", action="store_true", help="no event log on stderr")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    # One command, no subcommands, so not cli_support.run_cli (it reports errors per subcommand): same policy,
    # plus OSError, which here is what a taken port looks like.
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, --version, or a bad flag or variable, which argparse has reported
        return 0 if e.code is None else int(e.code)
    try:
        return run(build_config(NetSimConfig, args))
    except (OSError, ValueError) as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
