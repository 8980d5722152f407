"""Smoke test of bench/link.py: a tiny grid (idle and one background client, RTT 0 and 10 ms, 100 Mbit/s, 16 tokens,
the default modes: server-only, server-draft, the default hybrid, adaptive) and one short outage against the
in-process CPU servers, checking the JSON record's structure, its counts and that its bounds are computed from
its own measured figures (never a timing)."""

import importlib.util
import json

import pytest
from bench_modules import load_bench
from toy_models import toy_model_flags

pytestmark = pytest.mark.heavy  # a long file, started first (tests/conftest.py)

NEW_TOKENS = 16
HYBRID_FIELDS = ("tau", "rounds", "round_ms", "server_round_ms", "bound_tok_s", "bound_ratio", "bound_rtt0_tok_s",
                 "bound_rtt0_ratio")  # fmt: skip


@pytest.fixture(scope="module")
def link():
    return load_bench("link")


def test_link_record(link, tmp_path, capsys):
    plot = tmp_path / "link.png"
    record = link.main(["--device", "cpu", "--rtt-ms", "0", "10", "--mbps", "100", "--new-tokens", str(NEW_TOKENS),
                        "--load", "0", "1", "--load-tokens", "16", "--load-prompt-len", "16", "--warmup", "0",
                        "--outages-s", "0.2", "--pace", "40", "--outage-rtt-ms", "10", "--outage-mbps", "100",
                        "--plot", str(plot), *toy_model_flags()])  # fmt: skip
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == record  # the one JSON line, last
    assert record["bench"] == "link" and record["device"].startswith("cpu") and record["torch"]
    assert "server-draft: cpu" in record["device"]  # its own server, in this process
    assert set(record["definitions"]) >= {"tok_s", "bound_tok_s", "bound_rtt0_tok_s", "round_ms", "server_round_ms"}
    modes = record["args"]["modes"]
    assert modes == list(link.DEFAULT_MODES)
    assert {"server-only", "server-draft", "adaptive"} <= set(modes) and any(m in link.MODES for m in modes)
    rows = record["rows"]
    cells = [(load, 100, rtt, m) for load in ("0", "1") for rtt in (0, 10) for m in modes]
    assert [(r["load"], r["mbps"], r["rtt_ms"], r["mode"]) for r in rows] == cells
    assert all(r["load_clients"] == int(r["load"]) for r in rows)
    measured = {(r["mode"], r["load"], r["rtt_ms"]): r for r in rows if "skipped" not in r}
    for r in rows:
        if "skipped" in r:  # only a mode this client cannot run (chain always runs: it is what every client does)
            assert link.client_options(r["mode"]) is None and r["mode"] not in ("server-only", "server-draft", "chain")
            continue
        assert r["tokens"] == NEW_TOKENS and r["offline_tokens"] == 0
        assert r["tok_s"] > 0 and r["payload_B_per_tok"] > 0 and r["wire_B_per_tok"] > 0
        assert "mean_batch" in r
        if r["mode"] in ("server-only", "server-draft"):
            assert all(r[f] is None for f in HYBRID_FIELDS) and r["stream_tokens"] == NEW_TOKENS
            continue
        if r["mode"] != "adaptive" or r["rounds"]:  # adaptive may stream the whole text
            assert r["rounds"] >= 1 and r["tau"] >= 1 and r["round_ms"] > 0 and r["server_round_ms"] > 0
            assert r["client_stats"]["rounds"] == r["rounds"]
        if r["mode"] != "adaptive":
            assert r["stream_tokens"] == 0 and r["switches"] == []  # a hybrid mode is forced: it never streams
        assert len(r["switches"]) == r["mode_switches"]  # each switch's time and bytes, the text sent up
        assert all(ms > 0 and up > 0 for ms, up, _ in r["switches"])
        # The bounds, from this record's own figures: tau / (RTT + the server's round), tau / (RTT + round at RTT 0).
        rtt0 = measured[(r["mode"], r["load"], 0)]["round_ms"]
        if r["tau"] and r["server_round_ms"] and rtt0:
            assert r["bound_tok_s"] == pytest.approx(1e3 * r["tau"] / (r["rtt_ms"] + r["server_round_ms"]))
            assert r["bound_rtt0_tok_s"] == pytest.approx(1e3 * r["tau"] / (r["rtt_ms"] + rtt0))
            assert r["bound_ratio"] == pytest.approx(r["tok_s"] / r["bound_tok_s"])
            assert r["bound_rtt0_ratio"] == pytest.approx(r["tok_s"] / r["bound_rtt0_tok_s"])
    assert {("server-only", "1", 10), ("server-draft", "1", 10), ("adaptive", "1", 10)} <= set(measured)
    # The summary: a cell per load and RTT, adaptive's ratio to the better of server-only and the hybrid.
    assert [(c["load"], c["rtt_ms"]) for c in record["summary"]] == [
        (load, rtt) for load in ("0", "1") for rtt in (0, 10)
    ]
    for c in record["summary"]:
        assert set(c["tok_s"]) == set(modes)
        rivals = {m: v for m, v in c["tok_s"].items() if m not in ("server-draft", "adaptive") and v}
        assert c["best_other"] == max(rivals, key=rivals.get)
        assert c["adaptive_ratio"] == pytest.approx(c["tok_s"]["adaptive"] / rivals[c["best_other"]])
    (outage,) = record["outages"]
    assert outage["outage_s"] == 0.2 and outage["mode"] == "chain" and outage["tokens"] == int(40 * 5.2)
    assert outage["offline_tokens"] >= 1  # the client drafts alone while it waits to reconnect
    if outage["resyncs"]:
        assert outage["resync_ms"] > 0 and outage["resync_up_B"] > 0 and outage["resync_down_B"] > 0
    assert plot.exists() == (importlib.util.find_spec("matplotlib") is not None)


def test_summary_ratio(link):
    rows = [
        {"mode": m, "load": "full", "load_clients": 8, "mbps": 10, "rtt_ms": 50, "tok_s": v}
        for m, v in (("server-only", 100.0), ("server-draft", 300.0), ("auto+pipe", 120.0), ("adaptive", 114.0))
    ]
    rows.append({"mode": "chain", "load": "full", "load_clients": 8, "mbps": 10, "rtt_ms": 50, "skipped": "n/a"})
    (cell,) = link.summary(rows, [r["mode"] for r in rows])
    # server-draft is faster, but it is another deployment: adaptive is judged against server-only and the hybrid.
    assert cell["best_other"] == "auto+pipe" and cell["adaptive_ratio"] == pytest.approx(0.95)
    assert cell["tok_s"]["chain"] is None


def test_bounds_from_rows(link):
    rows = [{"mode": "chain", "rtt_ms": 0, "mbps": 10, "tok_s": 100.0, "tau": 5.0, "round_ms": 25.0,
             "server_round_ms": 1.0},
            {"mode": "chain", "rtt_ms": 50, "mbps": 10, "tok_s": 50.0, "tau": 5.0, "round_ms": 75.0,
             "server_round_ms": 2.0},
            {"mode": "chain", "rtt_ms": 50, "mbps": 1, "tok_s": 40.0, "tau": 4.0, "round_ms": 90.0,
             "server_round_ms": None},
            {"mode": "server-only", "rtt_ms": 50, "mbps": 10, "tok_s": 80.0, "tau": None, "round_ms": None,
             "server_round_ms": None}]  # fmt: skip
    link.add_bounds(rows)
    zero, fifty, slow, plain = rows
    assert zero["bound_tok_s"] == pytest.approx(5000.0) and zero["bound_rtt0_tok_s"] == pytest.approx(200.0)
    assert fifty["bound_tok_s"] == pytest.approx(5e3 / 52) and fifty["bound_ratio"] == pytest.approx(50 / (5e3 / 52))
    assert fifty["bound_rtt0_tok_s"] == pytest.approx(5e3 / 75) and fifty["bound_rtt0_ratio"] == pytest.approx(0.75)
    # No server round time, no RTT-0 row at that bandwidth, no tau: no bound rather than a made-up one.
    assert slow["bound_tok_s"] is None and slow["bound_rtt0_tok_s"] is None and slow["bound_ratio"] is None
    assert plain["bound_tok_s"] is None and plain["bound_rtt0_tok_s"] is None


def test_quick_and_modes(link):
    args = link.settings(["--quick"])
    assert (args.rtt_ms, args.mbps, args.new_tokens, args.outages_s, args.warmup) == ([0, 10], [100], 16, [], 0)
    assert args.load == ["0"] and link.settings([]).load == ["0", link.FULL]
    assert link.client_options("adaptive") == {"mode": "auto"}  # the client's defaults, its online mode its own
    assert link.client_options("chain") is not None  # every client drafts chains without pipelining
    with pytest.raises(SystemExit):
        link.settings(["--new-tokens", "1"])
    with pytest.raises(SystemExit):
        link.settings(["--load", "busy"])


def test_a_cell_whose_stream_fails_is_recorded_and_the_grid_goes_on(link, monkeypatch):
    """A cell that ends in LinkDown or ServerError (e.g. a stream whose tokens stopped under full load) is a row
    that says so, shown as failed in the grid, not the end of the run."""

    class Rig:
        def batches(self):
            return (0.0, 0)

    def down(*_):
        raise link.LinkDown("DEADLINE_EXCEEDED: Stream removed")

    monkeypatch.setattr(link, "run_server_only", down)
    row = link.measure(Rig(), "server-only", None, None)
    assert row["failed"].startswith("LinkDown: DEADLINE_EXCEEDED") and row["mean_batch"] is None
    args = link.settings(["--quick"])
    row |= {"mode": "server-only", "load": "0", "load_clients": 0, "rtt_ms": 0, "mbps": 100}
    table = link.grid_table(args, [row], "here")
    assert list(table.columns[4].cells) == ["failed"]
    assert link.summary([row], ["server-only"])[0]["tok_s"]["server-only"] is None
