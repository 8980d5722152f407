"""Smoke test of bench/frontends.py: a tiny run with gRPC in process and with one front end, checking the JSON
record's fields and counts (never its timings)."""

from bench_modules import load_bench
from toy_models import toy_model_flags


def test_routing_record_in_process_and_with_a_front_end():
    bench = load_bench("frontends")
    record = bench.main(
        ["--frontends", "0", "1", "--streams", "3", "--unary", "2", "--messages", "4", *toy_model_flags()]
    )
    assert record["bench"] == "frontends" and record["args"]["frontends"] == [0, 1]
    here, apart = record["rows"]
    for row, n in ((here, 0), (apart, 1)):
        assert row["frontends"] == n and row["messages"] == (3 + 2) * 4  # every refused round was answered
        assert row["messages_per_s"] > 0 and row["engine_cpu_us_per_message"] >= 0
    # A few messages can take less than one clock tick of the front end's CPU time: 0 is a measurement, None is not.
    assert here["frontends_cpu_us_per_message"] is None and apart["frontends_cpu_us_per_message"] >= 0
