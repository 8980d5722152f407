"""`tether-netsim`: a TCP proxy between a client and the server, with latency, jitter, a bandwidth cap and a
scripted scenario of cuts and stalls. It copies raw bytes, so gRPC, HTTP/2 and TLS pass through untouched.

tether-netsim --listen 127.0.0.1:50052 --upstream 127.0.0.1:50051 --latency-ms 40 --jitter-ms 10
tether-netsim --listen 127.0.0.1:0 --upstream 127.0.0.1:50051 --bandwidth-kbps 2000 --scenario flaky.json --json

Contract: prints one line `listening on HOST:PORT` once bound (port 0 picks a free one and prints it), logs link
events on stderr (unless --quiet), and on SIGTERM/SIGINT, or when the scenario's `end` event plays, prints the
bytes delivered each way (up = client->server, down = server->client) and connection counts: one line of text,
or with --json one JSON line (tether.netsim.records.NetSimStats.summary()). Exits 2 on a bad flag or scenario, or
an address that is not HOST:PORT. Scenario files: tether.netsim.scenario (times in seconds from the moment the proxy
listens). Every flag can also come from a TETHER_* environment variable, --foo-bar from TETHER_FOO_BAR (a switch:
1/0, true/false, yes/no); the command line wins, and --help lists each flag's default and variable.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import inspect
import json
import os
import re
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NoReturn

from tether.netsim import timers
from tether.netsim.proxy import NetSim
from tether.netsim.records import LinkConfig, NetSimEvent, NetSimStats
from tether.netsim.scenario import Scenario, load_scenario

# netsim is a standalone harness that imports nothing else of tether's (tests/netsim/test_netsim_standalone.py), so
# the command line's conventions, which tether.shared.cli_support gives the other programs, are kept here alone.
PREFIX = "TETHER_"  # --foo-bar reads TETHER_FOO_BAR, as every tether program's flags do
TRUE, FALSE = ("1", "true", "yes"), ("0", "false", "no")
_HOST_PORT = re.compile(r"(?:\[[0-9A-Fa-f:.%\w]+\]|[^\s:\[\]/]+):(\d{1,5})", re.ASCII)


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
    sim = NetSim(
        cfg.listen,
        cfg.upstream,
        link,
        scenario=scenario,
        seed=None if cfg.seed < 0 else cfg.seed,
        on_event=None if cfg.quiet else log_event,
    )
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
    with asyncio.Runner(loop_factory=timers.new_event_loop) as runner:  # a link's delays are its timers
        stats = runner.run(serve(cfg, link, scenario))
    print(json.dumps(stats.summary()) if cfg.json else format_stats(stats), flush=True)
    return 0


def host_port(text: str) -> str:
    """The argparse type of a flag that takes HOST:PORT ([v6]:PORT for IPv6): the text as given, or an error. A
    bare host is refused: the user would otherwise learn of it from a connection that goes nowhere."""
    m = _HOST_PORT.fullmatch(text)
    if m is None or int(m.group(1)) > 65535:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r} (such as 127.0.0.1:50051 or [::1]:50051)")
    return text


def variable(action: argparse.Action) -> str | None:
    """The TETHER_* variable of a flag that takes a value or is a switch; None for --help and --version."""
    flag = next((s for s in action.option_strings if s.startswith("--")), None)
    if flag is None or (action.nargs == 0 and not isinstance(action, argparse._StoreConstAction)):
        return None
    return PREFIX + flag[2:].upper().replace("-", "_")


def parse_switch(text: str) -> bool:
    word = text.strip().lower()
    if word in TRUE + FALSE:
        return word in TRUE
    raise ValueError(f"expected one of {', '.join(TRUE + FALSE)}, got {text!r}")


def field_comments(cls) -> dict[str, str]:
    """The trailing comment of each dataclass field, which is its --help."""
    pattern = re.compile(r"^\s+(\w+): [^#]*#\s*(.+)$")
    return {m.group(1): m.group(2) for line in inspect.getsource(cls).splitlines() if (m := pattern.match(line))}


def _shown(value: object) -> str:
    """A default as a user would type it."""
    if isinstance(value, bool):
        return str(value).lower()
    return str(value) if value != "" else '""'


class EnvParser(argparse.ArgumentParser):
    """An ArgumentParser whose flags also come from their TETHER_* variables: a variable set (and not empty) stands
    in for its flag's default, the command line wins over it, and one that does not parse as its flag's value ends
    the command in one line naming it (exit status 2), as does a flag that does not parse."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")  # argparse's adds the usage

    def parse_known_args(self, args=None, namespace=None):
        namespace = argparse.Namespace() if namespace is None else namespace
        for action in self._actions:
            name = variable(action)
            text = os.environ.get(name, "") if name is not None else ""
            if text and not hasattr(namespace, action.dest):  # argparse then leaves it unless the flag is given
                setattr(namespace, action.dest, self._from_variable(action, name, text))
        return super().parse_known_args(args, namespace)

    def _from_variable(self, action: argparse.Action, name: str, text: str) -> object:
        try:
            if action.nargs == 0:
                return action.const if parse_switch(text) else action.default
            return action.type(text) if action.type is not None else text
        except argparse.ArgumentTypeError as e:
            message = str(e)
        except (TypeError, ValueError) as e:
            message = str(e) if action.type is None else f"invalid {action.type.__name__} value: {text!r}"
        self.exit(2, f"{self.prog}: error: {name} (for {'/'.join(action.option_strings)}): {message}\n")


class _Version(argparse.Action):
    def __init__(self, option_strings: Sequence[str], dest: str, help: str | None = None):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        import importlib.metadata  # only when asked: its import costs more than the rest of a bare --help

        try:
            version = importlib.metadata.version("tether")
        except importlib.metadata.PackageNotFoundError:
            version = "(not installed: run from a source tree)"
        print(f"{parser.prog} {version}")
        parser.exit()


def _flag(parser: argparse.ArgumentParser, flag: str, help: str, **kwargs) -> None:
    """A flag whose help ends with its default and its variable, as every tether program's."""
    action = parser.add_argument(flag, **kwargs)
    action.help = f"{help} (default: {_shown(action.default)}) (env: {variable(action)})".replace("%", "%%")


def build_parser() -> argparse.ArgumentParser:
    parser = EnvParser(
        prog="tether-netsim",
        description="tether's network harness: a TCP proxy with latency, jitter, a bandwidth cap, cuts and stalls.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    parser.add_argument("--version", action=_Version, help="print the version and exit")
    helps = field_comments(NetSimConfig)
    types = {"listen": host_port, "upstream": host_port}
    for f in dataclasses.fields(NetSimConfig):
        flag = "--" + f.name.replace("_", "-")
        if isinstance(f.default, bool):  # plain switches rather than --json / --no-json pairs
            _flag(parser, flag, helps[f.name], action="store_true")
        else:
            _flag(parser, flag, helps[f.name], type=types.get(f.name, type(f.default)), default=f.default)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    # What a user can get wrong is one line and exit status 2; OSError is what a taken port looks like.
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, --version, or a bad flag or variable, which argparse has reported
        return 0 if e.code is None else int(e.code)
    try:
        return run(NetSimConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(NetSimConfig)}))
    except (OSError, ValueError) as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
