"""Smoke test of bench/draft.py: two short contexts, both drafters and an int8 part, checking the JSON record's
fields (never a time: only that each is a positive number); and another drafter, named by its directory."""

from pathlib import Path

from bench_modules import load_bench


def test_draft_step_record():
    draft = load_bench("draft")
    record = draft.main(["--contexts", "8", "40", "--k", "2", "--reps", "2", "--torch", "--precisions", "int8"])
    assert record["bench"] == "draft" and record["k"] == 2 and record["tli"] >= 0
    assert [r["context"] for r in record["rows"]] == [8, 40]
    assert record["part_bytes"]["int8"] > 0
    for r in record["rows"]:
        assert r["onnx_ms"] > 0 and r["torch_ms"] > 0 and r["onnx_int8_ms"] > 0
        assert r["onnx_refeed_stepped_ms"] > 0 and r["onnx_refeed_fed_ms"] > 0


def test_draft_step_of_another_drafter():
    draft = load_bench("draft")
    eagle = str(Path(__file__).resolve().parents[2] / "deploy" / "models" / "drafter-eagle")
    record = draft.main(
        ["--contexts", "8", "--k", "2", "--reps", "2", "--drafter", eagle, "--threads", "2", "--idle-ms", "1"]
    )
    assert (
        record["drafter"] == eagle and record["kind"] == "eagle" and record["threads"] == 2 and record["idle_ms"] == 1
    )
    assert record["rows"][0]["onnx_ms"] > 0
