"""bench/invariance.py: prompt-lookup drafting, and a run on the served path (fused target, Triton kernels through
the interpreter on the CPU) where no session's text depends on the others sharing its steps."""

import json

import pytest
import torch
from bench_modules import load_bench
from tiny_models import save_tiny_pairs

from tether.kernels.utils import interpreting

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() and not interpreting(),
                                reason="the kernels need CUDA or TRITON_INTERPRET")  # fmt: skip


def test_prompt_lookup_drafts_what_followed_the_last_pair():
    lookup = load_bench("invariance").prompt_lookup
    assert lookup([1, 2, 3, 4, 1, 2], 3) == [3, 4, 1]  # after the earlier (1, 2)
    assert lookup([5, 1, 2, 9, 1, 2, 7, 1, 2], 2) == [7, 1]  # the latest earlier occurrence
    assert lookup([1, 2, 3, 1, 2], 5) == [3, 1, 2]  # fewer at the end
    assert lookup([1, 2, 3, 4], 3) == [] and lookup([1, 2, 3, 1, 2], 0) == []


def test_sessions_together_write_what_they_write_alone(tmp_path, capsys):
    save_tiny_pairs(tmp_path, vocab_size=300, max_files=12)
    texts = ["def add(a, b):", "import os\n", "class Stack:", "x = [1, 2, 3]"]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"id": str(i), "text": t}) + "\n"
                                                    for i, t in enumerate(texts)))  # fmt: skip
    record = load_bench("invariance").main([
        "--model", str(tmp_path / "target"), "--drafter", str(tmp_path / "moa"), "--prompts",
        str(tmp_path / "prompts.jsonl"), "--sessions", "5", "--new-tokens", "8", "--k", "3", "--device", "cpu",
        "--attention", "triton", "--kv-pool-mb", "4"])  # fmt: skip
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == record
    assert (record["sessions"], record["distinct_prompts"], record["attention"]) == (5, 4, "triton")
    assert record["differ"] == 0 and record["first_difference"] is None
    # Five sessions in lockstep share their steps: fewer steps than the four prompts took one by one.
    assert record["steps_together"] < record["steps_alone"]


def test_a_random_target_of_a_presets_shapes_is_invariant_too(tmp_path, capsys):
    save_tiny_pairs(tmp_path, vocab_size=300, max_files=12)
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"id": str(i), "text": t}) + "\n"
                                                    for i, t in enumerate(["def f(x):", "import sys\n"])))  # fmt: skip
    record = load_bench("invariance").main([
        "--model", str(tmp_path / "target"), "--drafter", "none", "--preset", "tiny", "--layers", "2",
        "--prompts", str(tmp_path / "prompts.jsonl"), "--sessions", "3", "--new-tokens", "6", "--k", "2",
        "--device", "cpu", "--attention", "triton", "--kv-pool-mb", "4"])  # fmt: skip
    assert record["model"] == "tiny (random weights, 2 layers)" and record["attention"] == "triton"
    assert record["differ"] == 0 and record["steps_together"] < record["steps_alone"]
