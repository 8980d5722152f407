"""Smoke test of bench/server_draft.py on the toy models: plain and server-draft Generate rows at each B, the greedy
outputs checked against each other by the bench (it fails otherwise in float32), tau and the speed-up taken from the
row's own figures, and the one JSON line last."""

import json

from bench_modules import load_bench
from toy_models import toy_model_flags


def test_server_draft_record(capsys):
    bench = load_bench("server_draft")
    record = bench.main([*toy_model_flags(), "--device", "cpu", "--streams", "1", "2", "--prompts", "2", "--tokens",
                         "12", "--k", "3"])  # fmt: skip
    out = capsys.readouterr().out
    assert json.loads(out.strip().splitlines()[-1]) == record
    rows = record["rows"]
    assert [(r["streams"], r["mode"]) for r in rows] == [(b, m) for b in (1, 2) for m in ("plain", "server-draft")]
    assert all(r["tokens"] == 2 * 12 for r in rows)  # ignore_eos: every stream its full length
    for plain, drafted in zip(rows[::2], rows[1::2], strict=True):
        assert drafted["differ"] == 0 and 1 <= drafted["tau"] <= 3 + 1
        assert drafted["speedup"] == round(drafted["tokens_per_s"] / plain["tokens_per_s"], 3)
    assert (record["k"], record["dtype"], record["prompts"]) == (3, "float32", 2)
