"""Smoke test of bench/draft.py: two short contexts, both drafters and an int8 part, checking the JSON record's
fields (never a time: only that each is a positive number); another drafter, named by its directory; and draft trees
timed on the step graph and on the tree session."""

import pytest
from bench_modules import load_bench
from toy_models import toy_model_dir, toy_model_flags


def test_draft_step_record():
    draft = load_bench("draft")
    record = draft.main(
        ["--contexts", "8", "40", "--k", "2", "--reps", "2", "--torch", "--precisions", "int8", *toy_model_flags()]
    )
    assert record["bench"] == "draft" and record["k"] == 2 and record["tli"] >= 0
    assert [r["context"] for r in record["rows"]] == [8, 40]
    assert record["part_bytes"]["int8"] > 0
    for r in record["rows"]:
        assert r["onnx_ms"] > 0 and r["torch_ms"] > 0 and r["onnx_int8_ms"] > 0
        assert r["onnx_refeed_stepped_ms"] > 0 and r["onnx_refeed_fed_ms"] > 0


def test_draft_step_of_another_drafter():
    draft = load_bench("draft")
    eagle = str(toy_model_dir("drafter-eagle"))
    flags = ["--model", str(toy_model_dir()), "--drafter", eagle, "--threads", "2", "--idle-ms", "1"]
    record = draft.main(["--contexts", "8", "--k", "2", "--reps", "2", *flags])
    assert (
        record["drafter"] == eagle and record["kind"] == "eagle" and record["threads"] == 2 and record["idle_ms"] == 1
    )
    assert record["rows"][0]["onnx_ms"] > 0 and record["tree"] is None and "tree_session_ms" not in record["rows"][0]


def test_draft_trees_timed_on_both_sessions():
    draft = load_bench("draft")
    record = draft.main(["--contexts", "8", "--k", "2", "--reps", "2", "--tree", "3,2,5", *toy_model_flags()])
    assert record["tree"] == [3, 2, 5]
    row = record["rows"][0]
    assert row["tree_step_graph_ms"] > 0 and row["tree_session_ms"] > 0  # the two grew the same trees (else raised)
    for bad in ("3,1,5", "3,2", "0,2,5"):
        with pytest.raises(SystemExit, match="depth,top_k,nodes"):
            draft.tree_shape(bad)
