"""netsim scenarios: a JSON list of timed link events, validated up front, then played against a NetSim.

Contract:
- A scenario file is a JSON list of objects, each {"at": SECONDS, "event": NAME, ...}. Times count from the start
  of playback: for `tether-netsim --scenario` and `NetSim(scenario=...)` that is the moment the proxy is listening;
  for `NetSim.play()` the call. Times must not decrease; events at the same time play in file order.
- Events: "cut", "stall", "restore" (NetSim's methods of those names); "set" with any of "latency_ms",
  "jitter_ms", "bandwidth_kbps" (numbers >= 0) and optionally "direction" ("up", "down" or "both", the default);
  "end" (the scenario is over: the CLI prints its counts and exits), which must come last.
- Anything else (an unknown event or field, a bad number, times out of order) is a ScenarioError naming the
  file and the event's index, raised before anything plays.
- `play(link, scenario)` plays it against any `Link` (NetSim is the one; this module does not import it).

    [{"at": 2.0, "event": "cut"}, {"at": 5.0, "event": "restore"},
     {"at": 6.0, "event": "stall"}, {"at": 7.5, "event": "restore"},
     {"at": 8.0, "event": "set", "latency_ms": 50, "jitter_ms": 5, "bandwidth_kbps": 1000},
     {"at": 12.0, "event": "end"}]
"""

from __future__ import annotations

import asyncio
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

EVENTS = ("cut", "stall", "restore", "set", "end")
LINK_FIELDS = ("latency_ms", "jitter_ms", "bandwidth_kbps")


class Link(Protocol):
    """What a scenario's events do to the link they play against: NetSim's methods of these names."""

    def cut(self) -> int: ...

    def stall(self) -> None: ...

    def restore(self) -> None: ...

    def set_link(
        self,
        latency_ms: float | None = None,
        jitter_ms: float | None = None,
        bandwidth_kbps: float | None = None,
        direction: str = "both",
    ) -> None: ...

    def finish(self) -> None: ...


class ScenarioError(ValueError):
    """A scenario that cannot be played, with where and why."""


@dataclass(frozen=True)
class ScenarioEvent:
    at: float  # seconds from the start of playback
    event: str  # cut / stall / restore / set / end
    latency_ms: float | None = None  # set: new one-way latency; None = unchanged
    jitter_ms: float | None = None  # set: new jitter; None = unchanged
    bandwidth_kbps: float | None = None  # set: new cap (0 = unlimited); None = unchanged
    direction: str = "both"  # set: which link, "up" (client->server), "down" or "both"


@dataclass(frozen=True)
class Scenario:
    events: tuple[ScenarioEvent, ...]
    source: str = "scenario"  # where it came from, for messages

    @property
    def ends(self) -> bool:
        """True when the last event is `end`, i.e. playback stops the CLI by itself."""
        return bool(self.events) and self.events[-1].event == "end"


def _number(value: object, name: str, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise ScenarioError(f"{where}: {name} must be a number >= 0, got {value!r}")
    return float(value)


def parse_scenario(data: object, source: str = "scenario") -> Scenario:
    """Validate parsed JSON (a list of event objects) into a Scenario."""
    if not isinstance(data, list):
        raise ScenarioError(f"{source}: a scenario is a JSON list of events, got {type(data).__name__}")
    events: list[ScenarioEvent] = []
    for i, item in enumerate(data):
        where = f"{source}: event {i}"
        if not isinstance(item, dict):
            raise ScenarioError(f'{where}: each event is an object like {{"at": 1.0, "event": "cut"}}, got {item!r}')
        if "at" not in item or "event" not in item:
            raise ScenarioError(f'{where}: needs both "at" and "event", got {item!r}')
        name = item["event"]
        if name not in EVENTS:
            raise ScenarioError(f"{where}: unknown event {name!r} (expected one of {', '.join(EVENTS)})")
        at = _number(item["at"], "at", where)
        allowed = {"at", "event", *LINK_FIELDS, "direction"} if name == "set" else {"at", "event"}
        if unknown := sorted(set(item) - allowed):
            raise ScenarioError(
                f"{where}: unknown field(s) {', '.join(unknown)} for {name!r} (allowed: {', '.join(sorted(allowed))})"
            )
        if events and at < events[-1].at:
            raise ScenarioError(f"{where}: times must not decrease ({at} comes after {events[-1].at})")
        if events and events[-1].event == "end":
            raise ScenarioError(f'{where}: nothing may follow "end"')
        fields: dict = {}
        if name == "set":
            fields = {k: _number(item[k], k, where) for k in LINK_FIELDS if k in item}
            if not fields:
                raise ScenarioError(f'{where}: "set" needs at least one of {", ".join(LINK_FIELDS)}')
            direction = item.get("direction", "both")
            if direction not in ("up", "down", "both"):
                raise ScenarioError(f"{where}: direction must be up, down or both, got {direction!r}")
            fields["direction"] = direction
        events.append(ScenarioEvent(at=at, event=name, **fields))
    return Scenario(tuple(events), source)


def load_scenario(path: str | Path) -> Scenario:
    """Read and validate a scenario file (FileNotFoundError when missing, ScenarioError when wrong)."""
    text = Path(path).read_text()
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ScenarioError(f"{path}: not valid JSON: {e}") from None
    return parse_scenario(data, str(path))


def apply(sim: Link, event: ScenarioEvent) -> None:
    """Do one event to a link, now."""
    if event.event == "cut":
        sim.cut()
    elif event.event == "stall":
        sim.stall()
    elif event.event == "restore":
        sim.restore()
    elif event.event == "set":
        sim.set_link(event.latency_ms, event.jitter_ms, event.bandwidth_kbps, event.direction)
    elif event.event == "end":
        sim.finish()
    else:  # parse_scenario lets no other through
        raise ScenarioError(f"unknown event {event.event!r}")


async def play(sim: Link, scenario: Scenario) -> None:
    """Play every event at its time, counted from this call. Cancel the task to stop early."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    for event in scenario.events:
        # Absolute deadlines from t0, so lateness of one event does not shift the ones after it.
        delay = t0 + event.at - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        apply(sim, event)
