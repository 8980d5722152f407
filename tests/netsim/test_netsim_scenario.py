"""netsim scenarios: validation with clear errors, and playback against a live proxy."""

import inspect
import json
import threading

import pytest
from netsim_helpers import closed_by_peer, connect, recv_exactly

from tether.netsim.proxy import LinkConfig, NetSim, NetSimThread
from tether.netsim.scenario import Link, Scenario, ScenarioError, ScenarioEvent, load_scenario, parse_scenario

EXAMPLE = [
    {"at": 2.0, "event": "cut"},
    {"at": 5.0, "event": "restore"},
    {"at": 6.0, "event": "stall"},
    {"at": 7.5, "event": "restore"},
    {"at": 8.0, "event": "set", "latency_ms": 50, "jitter_ms": 5, "bandwidth_kbps": 1000},
    {"at": 8.0, "event": "set", "bandwidth_kbps": 200, "direction": "up"},
    {"at": 9, "event": "end"},
]


def test_the_proxy_is_the_link_a_scenario_plays_against():
    """scenario.play takes a Link (so the scenario module need not import the proxy): NetSim has each of its
    members, with the same parameters."""
    members = [name for name, member in vars(Link).items() if inspect.isfunction(member) and name[0] != "_"]
    assert members == ["cut", "stall", "restore", "set_link", "finish"]
    for name in members:
        assert inspect.signature(getattr(NetSim, name)).parameters == inspect.signature(getattr(Link, name)).parameters


def test_parse_the_example():
    scenario = parse_scenario(EXAMPLE)
    assert [e.event for e in scenario.events] == ["cut", "restore", "stall", "restore", "set", "set", "end"]
    assert scenario.events[4] == ScenarioEvent(8.0, "set", latency_ms=50.0, jitter_ms=5.0, bandwidth_kbps=1000.0)
    assert scenario.events[5].direction == "up" and scenario.events[5].latency_ms is None
    assert scenario.ends and not parse_scenario(EXAMPLE[:2]).ends
    assert parse_scenario([]) == Scenario(())


@pytest.mark.parametrize(
    "data,message",
    [
        ({"at": 1, "event": "cut"}, "a JSON list of events"),
        ([["cut", 1]], "each event is an object"),
        ([{"event": "cut"}], 'needs both "at" and "event"'),
        ([{"at": 1, "event": "explode"}], "event 0: unknown event 'explode' (expected one of cut, stall"),
        ([{"at": 2, "event": "cut"}, {"at": 1, "event": "restore"}], "event 1: times must not decrease"),
        ([{"at": -1, "event": "cut"}], "at must be a number >= 0"),
        ([{"at": "1", "event": "cut"}], "at must be a number >= 0"),
        ([{"at": True, "event": "cut"}], "at must be a number >= 0"),
        ([{"at": 1, "event": "cut", "latency_ms": 5}], "unknown field(s) latency_ms for 'cut'"),
        ([{"at": 1, "event": "set", "latency": 5}], "unknown field(s) latency for 'set'"),
        ([{"at": 1, "event": "set"}], '"set" needs at least one of latency_ms'),
        ([{"at": 1, "event": "set", "jitter_ms": -2}], "jitter_ms must be a number >= 0"),
        ([{"at": 1, "event": "set", "jitter_ms": 2, "direction": "left"}], "direction must be up, down or both"),
        ([{"at": 1, "event": "end"}, {"at": 2, "event": "cut"}], 'event 1: nothing may follow "end"'),
    ],
)
def test_bad_scenarios_are_clear_errors(data, message):
    with pytest.raises(ScenarioError) as err:
        parse_scenario(data, "flaky.json")
    assert message in str(err.value) and str(err.value).startswith("flaky.json")


def test_load_scenario_from_a_file(tmp_path):
    path = tmp_path / "s.json"
    path.write_text(json.dumps(EXAMPLE))
    assert load_scenario(path).events == parse_scenario(EXAMPLE).events
    path.write_text('[{"at": 1, "event": "cut"},]')
    with pytest.raises(ScenarioError, match="s.json: not valid JSON"):
        load_scenario(path)
    with pytest.raises(FileNotFoundError):
        load_scenario(tmp_path / "missing.json")


def test_playback_drives_the_proxy(echo):
    events, stalled = [], threading.Event()

    def on_event(event):
        events.append(event)
        if event.kind == "stall":
            stalled.set()

    scenario = [
        {"at": 0.05, "event": "stall"},
        {"at": 0.1, "event": "cut"},
        {"at": 0.15, "event": "restore"},
        {"at": 0.2, "event": "set", "latency_ms": 5, "direction": "up"},
        {"at": 0.25, "event": "end"},
    ]
    with NetSimThread("127.0.0.1:0", echo.address, on_event=on_event) as sim:
        with connect(sim.port) as sock:
            sim.play(scenario)
            assert stalled.wait(5)
            assert sim.wait_done(5)
            assert closed_by_peer(sock)  # the cut reset it
        assert sim.link("up") == LinkConfig(latency_ms=5) and sim.link("down") == LinkConfig()
        assert sim.state == "normal"
        with connect(sim.port) as fresh:
            fresh.sendall(b"back")
            assert recv_exactly(fresh, 4) == b"back"
    kinds = [e.kind for e in events if e.kind not in ("accepted", "closed")]
    assert kinds == ["listening", "stall", "cut", "restore", "set", "end", "stopped"]
    played = [e for e in events if e.kind in ("stall", "cut", "restore", "set", "end")]
    assert all(e.t >= at - 0.005 for e, at in zip(played, (0.05, 0.1, 0.15, 0.2, 0.25), strict=True))


def test_a_scenario_given_to_the_proxy_plays_from_start(echo):
    scenario = parse_scenario([{"at": 0.0, "event": "cut"}, {"at": 0.05, "event": "end"}])
    with NetSimThread("127.0.0.1:0", echo.address, scenario=scenario) as sim:
        assert sim.wait_done(5)
        assert sim.state == "cut"
