"""The netsim proxy's values: the link model it applies, its states, the events and counts it reports, and
HOST:PORT addresses.

Contract: plain frozen records, no asyncio and no sockets, so the command line, NetSimProcess (whose results cross a
pipe pickled) and tests read them without a running proxy.
- `LinkConfig(latency_ms, jitter_ms, bandwidth_kbps)`: one direction's link; every field a finite number >= 0,
  kept as a float (50 and 50.0 are one link).
- `LinkState`: normal, cut or stall (tether.netsim.proxy says what each does).
- `NetSimEvent`: one state change or connection, as `on_event` sees it; `NetSimStats` and `ConnStats`: the counts
  `stats()` returns (`summary()`: the JSON line `tether-netsim --json` prints).
- `parse_address("HOST:PORT")` (or "[v6]:PORT") -> (host, port), ValueError otherwise; `format_address` back.

    LinkConfig(latency_ms=40, bandwidth_kbps=2000).bytes_per_s  # 250000.0
"""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass

HISTORY = 1024  # closed connections kept for stats()
DIRECTIONS = ("up", "down")


@dataclass(frozen=True)
class LinkConfig:
    latency_ms: float = 0.0  # one-way delay added to every chunk
    jitter_ms: float = 0.0  # extra delay per chunk, uniform in [0, jitter_ms] (never reorders a connection)
    bandwidth_kbps: float = 0.0  # cap in kilobits (1000 bits) per second; 0 = unlimited

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
                raise ValueError(f"{f.name} must be a number >= 0, got {v!r}")
            object.__setattr__(self, f.name, float(v))  # 50 and 50.0 are one link (and print alike)

    @property
    def bytes_per_s(self) -> float:
        return self.bandwidth_kbps * 1000 / 8


class LinkState(enum.StrEnum):
    NORMAL = "normal"
    CUT = "cut"  # connections reset, new ones refused
    STALL = "stall"  # connections open, nothing delivered


@dataclass(frozen=True)
class NetSimEvent:
    t: float  # seconds since the proxy started listening
    kind: str  # listening, accepted, refused, failed, closed, peer-reset, cut, stall, restore, set, end, stopped
    detail: dict  # what else is known, e.g. {"conn": 3, "peer": "127.0.0.1:5000"} or {"reset": 2}


@dataclass(frozen=True)
class ConnStats:
    id: int  # 1, 2, ... in accept order
    peer: str  # the client's HOST:PORT
    up_bytes: int  # delivered client -> server
    down_bytes: int  # delivered server -> client
    opened_s: float  # seconds since start
    closed_s: float | None  # seconds since start; None while open
    outcome: str  # open, closed (both ends finished), peer-reset (an end reset or failed), cut, failed, stopped


@dataclass(frozen=True)
class NetSimStats:
    state: str  # normal / cut / stall
    elapsed_s: float  # since the proxy started listening
    up_bytes: int  # delivered client -> server, all connections
    down_bytes: int  # delivered server -> client, all connections
    connections_accepted: int  # every accept, refused ones included
    connections_refused: int  # accepted while cut, then reset at once
    connections_reset: int  # open connections reset by cut()
    connections_failed: int  # upstream could not be reached
    connections_open: int
    up: LinkConfig  # the client -> server link now
    down: LinkConfig  # the server -> client link now
    connections: tuple[ConnStats, ...]  # open ones, then up to HISTORY closed ones, in accept order

    def summary(self) -> dict:
        """Everything but the per-connection list, JSON-ready."""
        out = dataclasses.asdict(self)
        del out["connections"]
        return out


def parse_address(text: str) -> tuple[str, int]:
    """'HOST:PORT' (or '[v6]:PORT') -> (host, port)."""
    host, sep, port = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"expected HOST:PORT, got {text!r}")
    return host, int(port)


def format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
