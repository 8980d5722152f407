"""Smoke tests of bench/capacity.py: a tiny search in every mode against in-process CPU servers, with acceptance
replayed on a random-weight target (bench/forced_acceptance.py) and with recorded traces, checking the JSON record's
fields and counts (never whether a count was sustained: that is timing); and the forced verdicts themselves."""

import json
import random

import pytest
from bench_modules import load_bench
from toy_models import load_toy_pair, toy_model_flags

pytestmark = pytest.mark.heavy  # a long file, started first (tests/conftest.py)


@pytest.fixture(scope="module")
def capacity():
    return load_bench("capacity")


@pytest.fixture(scope="module")
def forced():
    return load_bench("forced_acceptance")


def check_cell(cell: dict, max_clients: int) -> None:
    assert 0 <= cell["sustained"] <= max_clients and cell["first_failed"] in (None, *range(1, max_clients + 1))
    assert cell["probes"] and all(1 <= p["clients"] <= max_clients for p in cell["probes"])
    for p in cell["probes"]:  # paced runs: a pass/fail by the share of clients at the rate
        assert "error" not in p, p
        assert 0 <= p["clients_at_rate"] <= p["clients"] and isinstance(p["sustained"], bool)
        assert p["sustained"] == (p["clients_at_rate"] == p["clients"])  # under 20 clients: every one
        assert 0 <= p["client_min_tokens_per_s"] <= p["client_median_tokens_per_s"]
    if cell["sustained"]:
        assert cell["at_sustained"]["clients"] == cell["sustained"] and cell["at_sustained"]["sustained"]


def test_capacity_replayed_acceptance(capacity, tmp_path):
    plot = tmp_path / "capacity.png"
    acceptance = tmp_path / "acceptance.json"
    record = capacity.main(["--device", "cpu", "--preset", "small", "--layers", "2", "--rate", "5", "--rtt-ms", "10",
                            "50", "--max-clients", "1", "--duration", "1", "--acceptance", str(acceptance),
                            "--acceptance-prompts", "2", "--acceptance-tokens", "24", "--prompt-len", "32",
                            "--session-rounds", "8", "--timeout", "120", "--plot", str(plot),
                            *toy_model_flags()])  # fmt: skip
    assert record["bench"] == "capacity" and record["args"]["rate"] == [5] and record["args"]["max_clients"] == 1
    assert record["target"] == "small (random weights, 2 layers)"
    # The histogram recorded from the trained (toy) pair on held-out prompts, and what the forced verdicts gave.
    saved = json.loads(acceptance.read_text())
    acc = record["acceptance"]
    assert saved["format"] == "tether-acceptance" and saved["prompts"] == 2 and saved["k"] == 5
    assert acc["counts"] == saved["counts"] and len(acc["counts"]) == 6 and sum(acc["counts"]) > 0
    assert acc["tau"] == pytest.approx(sum((a + 1) * n for a, n in enumerate(acc["counts"])) / sum(acc["counts"]))
    assert 1 <= acc["forced_tau"] <= 6
    cells = {(c["mode"], c["rtt_ms"], c["rate"]): c for c in record["cells"]}
    modes = ("hybrid", "server-only", "server-draft", "auto")
    assert set(cells) == {(m, rtt, 5) for m in modes for rtt in (10, 50)}
    for (mode, rtt, _), c in cells.items():
        if mode == "auto":  # derived, not run: the better of hybrid and server-only
            rivals = {m: cells[(m, rtt, 5)]["sustained"] for m in ("hybrid", "server-only")}
            assert c["derived"] and c["sustained"] == max(rivals.values()) and rivals[c["picks"]] == c["sustained"]
            continue
        check_cell(c, 1)
        # Streams do not depend on the round trip but for their start: searched at the first RTT only.
        assert c["measured_rtt_ms"] == (10 if mode != "hybrid" else rtt)
        if mode == "hybrid" and c["at_sustained"]:
            assert 1 <= c["at_sustained"]["tau"] <= 6 and c["at_sustained"]["trace_match"] is None
    assert set(record["saturation"]) == {"hybrid", "server-only", "server-draft"}
    for sat in record["saturation"].values():
        assert sat["clients"] == 1 and sat["tokens_per_s"] > 0 and "sustained" not in sat
    assert {(r["rtt_ms"], r["rate"]) for r in record["ratios"]} == {(10, 5), (50, 5)}
    for r in record["ratios"]:
        h, s = (cells[(m, r["rtt_ms"], 5)]["sustained"] for m in ("hybrid", "server-only"))
        assert r["hybrid_over_server_only"] == (h / s if s else None)
    assert plot.exists() == _has_matplotlib()


def test_capacity_traced(capacity, tmp_path):
    record = capacity.main(["--device", "cpu", "--modes", "hybrid", "server-only", "--rate", "5", "--rtt-ms", "10",
                            "--max-clients", "1", "--duration", "1", "--no-saturation",
                            "--traces", str(tmp_path / "traces.json"), "--prompts", "2", "--prompt-len", "32",
                            "--trace-tokens", "24", "--timeout", "120", *toy_model_flags()])  # fmt: skip
    assert (tmp_path / "traces.json").exists() and record["acceptance"]["prompts"] == 2
    assert record["saturation"] == {}
    cells = {c["mode"]: c for c in record["cells"]}
    assert set(cells) == {"hybrid", "server-only", "auto"}
    for mode in ("hybrid", "server-only"):
        check_cell(cells[mode], 1)
    for p in cells["hybrid"]["probes"]:  # the drafts replayed against their own target: real acceptance
        assert 0 <= p["trace_match"] <= 1 and p["tau"] >= 1


def test_search_from_a_start(capacity):
    """Doubling up from a start that passes, halving down from one that fails, then bisection (no server)."""

    class Fake(capacity.Capacity):
        def __init__(self, most: int, max_clients: int):
            args = capacity.parser().parse_args(["--max-clients", str(max_clients)])
            super().__init__(args, None, "", None, 16, True)
            self.most, self.asked = most, []

        def run(self, mode, n, rate, rtt_ms):
            self.asked.append(n)
            return {"clients": n, "sustained": n <= self.most}

    up = Fake(most=20, max_clients=64)
    assert up.search("hybrid", 20, 50, start=4)["sustained"] == 20 and up.asked[:4] == [4, 8, 16, 32]
    down = Fake(most=5, max_clients=64)
    cell = down.search("hybrid", 20, 50, start=32)
    assert cell["sustained"] == 5 and down.asked[:3] == [32, 16, 8] and cell["first_failed"] == 6
    none = Fake(most=0, max_clients=64)
    assert none.search("hybrid", 20, 50, start=2)["sustained"] == 0 and none.asked == [2, 1]
    assert Fake(most=99, max_clients=64).search("hybrid", 20, 50, start=100)["sustained"] == 64


def test_forced_lengths_follow_the_histogram(forced):
    from tether.shared.speculative import DraftTree, Verdict

    histogram = forced.AcceptanceHistogram([1, 0, 1, 0, 0, 2])
    assert histogram.k == 5 and histogram.tau == pytest.approx((1 + 3 + 2 * 6) / 4)
    rng = random.Random(0)
    draws = [histogram.draw(rng, 5) for _ in range(4000)]
    assert set(draws) == {0, 2, 5} and draws.count(5) / len(draws) == pytest.approx(0.5, abs=0.05)
    assert {histogram.draw(rng, 3) for _ in range(200)} == {0, 2, 3}  # capped at the tree's depth
    f = forced.ForcedAcceptance(histogram, seed=0)
    chain, short, alone = DraftTree.chain(1, [2, 3, 4, 5, 6]), DraftTree.chain(1, [2]), DraftTree.chain(1, [])
    error = ValueError("a row that failed")
    out = f.force([chain, short, alone, chain], [Verdict([0], 7), Verdict([0, 1], 8), Verdict([0], 9), error])
    assert out[0].path == list(range(len(out[0].path))) and out[0].bonus == 7  # the target's own bonus
    assert out[1].accepted <= 1 and out[1].bonus == 8
    assert out[2] == Verdict([0], 9) and out[3] is error  # nothing to force; an error kept
    assert f.rounds == 2 and f.tau == pytest.approx((out[0].accepted + out[1].accepted + 2) / 2)
    with pytest.raises(ValueError):
        forced.AcceptanceHistogram([0, 0])


def test_forced_verdicts_reach_the_server(forced):
    """Inside the context the server's verify path gives the forced length (its cache commits that many rows);
    outside it the target's own verdict again."""
    from tether.server import rounds
    from tether.server.verifier import SequenceVerifier
    from tether.shared.speculative import DraftTree

    target, tok, drafter, _ = load_toy_pair()
    original = rounds.unpack_verdicts, rounds.verify_rows
    ver = SequenceVerifier(target, drafter, capacity=256)
    try:
        root = ver.open(tok.encode("def main():\n    "))[0]
        with forced.ForcedAcceptance(forced.AcceptanceHistogram([0, 0, 0, 1, 0, 0])) as f:
            before = ver.cache.length
            verdict, delta = ver.verify(DraftTree.chain(root, [7, 7, 7, 7, 7]))
            assert verdict.accepted == 3 and ver.cache.length == before + 4 and f.tau == 4
            assert delta is not None and len(delta.tokens) == 4  # the drafter's delta covers the forced path
        assert (rounds.unpack_verdicts, rounds.verify_rows) == original
    finally:
        ver.release()


def test_auto_and_ratios(capacity):
    cells = [{"mode": m, "rtt_ms": 50, "rate": 20, "sustained": n} for m, n in
             (("hybrid", 48), ("server-only", 64), ("server-draft", 80))]  # fmt: skip
    auto = [c for c in capacity.with_auto(cells) if c["mode"] == "auto"]
    assert auto == [{"mode": "auto", "rate": 20, "rtt_ms": 50, "sustained": 64, "picks": "server-only",
                     "derived": True}]  # fmt: skip
    assert capacity.ratios(cells) == [{"rtt_ms": 50, "rate": 20, "hybrid_over_server_only": 0.75}]


def test_acceptance_file_checked(tmp_path):
    traces = load_bench("traces")
    path = tmp_path / "a.json"
    path.write_text(json.dumps({"format": "tether-acceptance", "version": 1, "counts": [3, -1]}))
    with pytest.raises(ValueError):
        traces.load_acceptance(path)


def _has_matplotlib() -> bool:
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None


def test_merge_runs(capacity, tmp_path):
    """Runs of one mode each read back as one record: auto and the ratios over all their cells."""

    def run_output(name: str, cells: list[dict]) -> str:
        record = {"bench": "capacity", "args": {"max_clients": 64, "share": 0.95, "duration": 5.0}, "device": "GPU",
                  "target": "llama3-8b (random weights)", "cells": cells,
                  "acceptance": {"counts": [1, 1], "tau": 1.5, "prompts": 64, "forced_tau": 1.5}}  # fmt: skip
        path = tmp_path / name
        path.write_text("a table first\n" + json.dumps(record) + "\n")
        return str(path)

    hybrid = {"mode": "hybrid", "rtt_ms": 50, "rate": 20, "sustained": 48}
    stale = {"mode": "auto", "rtt_ms": 50, "rate": 20, "sustained": 48, "picks": "hybrid", "derived": True}
    plain = {"mode": "server-only", "rtt_ms": 50, "rate": 20, "sustained": 64}
    plot = tmp_path / "merged.png"
    record = capacity.main(["--merge", run_output("a", [hybrid, stale]), run_output("b", [plain]), "--plot", str(plot)])
    auto = [c for c in record["cells"] if c["mode"] == "auto"]
    assert len(auto) == 1 and auto[0]["picks"] == "server-only" and auto[0]["sustained"] == 64
    assert record["ratios"] == [{"rtt_ms": 50, "rate": 20, "hybrid_over_server_only": 0.75}]
    assert plot.exists() == _has_matplotlib()
