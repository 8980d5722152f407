"""Smoke test of bench/spec.py on a tiny random target, a MoA and an EAGLE drafter: chain and several tree shapes,
greedy outputs checked against plain decoding (the bench fails otherwise), each drafter's best tree per
verification budget and the ratios to EAGLE taken from the record's own figures."""

import json

import pytest
from bench_modules import load_bench
from tiny_models import save_tiny_pairs

pytestmark = pytest.mark.heavy  # a long file, started first (tests/conftest.py)

SHAPES = ("3,2,6", "5,2,6", "4,3,10")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec")
    save_tiny_pairs(root, vocab_size=300, max_files=20)
    return root


def test_spec_record(models, capsys):
    spec = load_bench("spec")
    record = spec.main(["--target", str(models / "target"), "--data", str(models / "corpus"), "--device", "cpu",
                        "--drafters", str(models / "moa"), str(models / "eagle"), "--prompts", "2",
                        "--prompt-len", "24", "--new-tokens", "10", "--k", "3", "--offline", "4",
                        "--tree", *SHAPES, "5,2,6"])  # fmt: skip
    out, err = capsys.readouterr()
    assert json.loads(out.strip().splitlines()[-1]) == record  # the one JSON line, last
    landed = [json.loads(line) for line in err.strip().splitlines() if line.startswith("{")]
    assert [(m["drafter"], m.get("shape")) for m in landed] == [
        (name, shape) for name in ("moa", "eagle") for shape in (None, [3, 2, 6], [5, 2, 6], [4, 3, 10])
    ]  # each measurement as it finished: the chain, then each tree
    assert record["trees"] == [[3, 2, 6], [5, 2, 6], [4, 3, 10]]  # in the order given, each once
    moa, eagle = record["drafters"]
    assert (moa["kind"], eagle["kind"]) == ("moa", "eagle") and record["eagle"] == "eagle"
    for r in (moa, eagle):
        assert [t["shape"] for t in r["trees"]] == record["trees"]
        assert [m for m in landed if m["drafter"] == r["drafter"]][1:] == [{"drafter": r["drafter"], **t}
                                                                           for t in r["trees"]]  # fmt: skip
        assert all(t["tau"] >= 1 and t["mismatched_prompts"] == 0 for t in r["trees"])
        assert list(r["best_tree"]) == ["6", "10"]
        for n, best in r["best_tree"].items():
            same_budget = [t for t in r["trees"] if t["shape"][2] == int(n)]
            assert best["tau"] == max(t["tau"] for t in same_budget)
            assert best["shape"] == next(t["shape"] for t in same_budget if t["tau"] == best["tau"])
    ratios = record["best_tree_tau_ratio_vs_eagle"]["moa"]
    for n in ("6", "10"):
        assert ratios[n] == pytest.approx(moa["best_tree"][n]["tau"] / eagle["best_tree"][n]["tau"])
    assert record["tau_ratio_vs_eagle"]["moa"] == pytest.approx(moa["tau"] / eagle["tau"])


def test_spec_tree_shapes_parsed_and_refused():
    spec = load_bench("spec")
    assert spec.parse_tree_shapes([""]) == [] and spec.parse_tree_shapes([]) == []
    assert spec.parse_tree_shapes(["6,8,48", "", "6,8,48", "10,8,80"]) == [(6, 8, 48), (10, 8, 80)]
    for bad in ("6,8", "6,0,48", "6,8,48,1"):
        with pytest.raises(SystemExit, match="depth,top_k,total_tokens"):
            spec.parse_tree_shapes([bad])
