"""Smoke test of bench/http_api.py: a tiny run against the in-process server, checking the JSON record's fields and
counts (never its timings)."""

from bench_modules import load_bench
from toy_models import toy_model_dir


def test_http_and_generate_rows():
    bench = load_bench("http_api")
    record = bench.main(["--device", "cpu", "--clients", "1", "3", "--tokens", "5", "--prompt-len", "8",
                         "--model", str(toy_model_dir()), "--drafter", "none"])  # fmt: skip
    assert record["bench"] == "http" and [(r["protocol"], r["clients"]) for r in record["rows"]] == [
        ("http", 1), ("grpc", 1), ("http", 3), ("grpc", 3)]  # fmt: skip
    for row in record["rows"]:
        assert row["tokens"] == 5 * row["clients"]  # ignore_eos: every stream runs to its length
        assert row["tokens_per_s"] > 0 and row["wall_s"] > 0
        assert 0 < row["ttft_p50_ms"] <= row["ttft_p99_ms"] and 0 <= row["itl_p50_ms"] <= row["itl_p99_ms"]
