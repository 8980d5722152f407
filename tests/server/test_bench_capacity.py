"""Smoke test of bench/capacity.py: a tiny search in both modes against the in-process server on draft traces it
records first, checking the JSON record's fields and counts (never whether a count was sustained: that is timing)."""

import pytest
from bench_modules import load_bench
from toy_models import toy_model_flags

pytestmark = pytest.mark.heavy  # a long file, started first (tests/conftest.py)


def test_capacity_record(tmp_path):
    capacity = load_bench("capacity")
    record = capacity.main(["--device", "cpu", "--rate", "5", "--max-clients", "2", "--duration", "1",
                            "--traces", str(tmp_path / "traces.json"), "--prompts", "2", "--prompt-len", "32",
                            "--trace-tokens", "24", "--timeout", "120", *toy_model_flags()])  # fmt: skip
    assert record["bench"] == "capacity" and record["args"]["rate"] == 5 and record["args"]["max_clients"] == 2
    assert (tmp_path / "traces.json").exists() and record["traces"]["prompts"] == 2
    assert record["tokens_per_stream"] == 24  # server-only streams as long as the traces
    assert set(record["modes"]) == {"edge", "server-only"}
    for mode, r in record["modes"].items():
        assert 0 <= r["sustained"] <= 2 and r["first_failed"] in (None, 1, 2)
        probes = r["probes"]
        assert probes[0]["clients"] == 1 and all(p["clients"] <= 2 for p in probes)
        for p in probes:  # paced runs: a pass/fail by the share of clients at the rate
            assert "error" not in p, p
            assert 0 <= p["clients_at_rate"] <= p["clients"] and isinstance(p["sustained"], bool)
            assert p["sustained"] == (p["clients_at_rate"] == p["clients"])  # under 20 clients: every one
            assert 0 <= p["client_min_tokens_per_s"] <= p["client_median_tokens_per_s"]
        if r["sustained"]:
            assert r["at_sustained"]["clients"] == r["sustained"] and r["at_sustained"]["sustained"]
        sat = r["saturation"]
        assert sat["clients"] == 2 and sat["tokens_per_s"] > 0 and "sustained" not in sat
        if mode == "edge":
            assert sat["tau"] >= 1 and 0 <= sat["trace_match"] <= 1
        else:
            assert sat["ttft_p50_ms"] > 0
    edge, plain = record["modes"]["edge"]["sustained"], record["modes"]["server-only"]["sustained"]
    assert record["ratio"] == (edge / plain if plain else None)
