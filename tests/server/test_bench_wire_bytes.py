"""Smoke test of bench/wire_bytes.py on the toy pair: the sizes of the fixed-size codecs are what the format says,
every lossy codec's chains still write the target's greedy text (the bench fails otherwise), and the record is the
one JSON line it prints last."""

import json

from bench_modules import load_bench
from toy_models import toy_model_dir

from tether.shared.config import ModelConfig


def test_wire_bytes_record(tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    texts = ['def add(a, b):\n    """Add two numbers."""', 'class Box:\n    """A box of things, kept in order."""']
    prompts.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    bench = load_bench("wire_bytes")
    record = bench.main(
        [
            "--target",
            str(toy_model_dir()),
            "--drafter",
            str(toy_model_dir("drafter")),
            "--prompts",
            str(prompts),
            "--n-prompts",
            "2",
            "--new-tokens",
            "10",
            "--k",
            "3",
            "--offline",
            "4",
            "--resync",
            "4",
            "999",
            "--quality",
        ]
    )
    out, _ = capsys.readouterr()
    assert json.loads(out.strip().splitlines()[-1]) == record

    cfg = ModelConfig.from_dict(json.loads((toy_model_dir() / "config.json").read_text())["tether"])
    tli = json.loads((toy_model_dir("drafter") / "drafter_config.json").read_text())["tli"]
    default, medium, big = record["sizes"].values()
    by_codec = {r["codec"]: r for r in default}
    raw = by_codec["RAW"]
    assert raw["raw_bf16"] == 2 * (cfg.dim + 2 * tli * cfg.n_kv_heads * cfg.head_dim)
    assert raw["parts"]["lsa"] == 2 * cfg.dim and raw["parts"]["K0"] == 2 * cfg.n_kv_heads * cfg.head_dim
    assert set(raw["parts"]) == {"lsa", *(f"{kv}{i}" for kv in "KV" for i in range(tli))}
    for codec, bits in (("INT4_HADAMARD", 4), ("INT3_HADAMARD", 3), ("INT2_HADAMARD", 2)):
        row = cfg.n_kv_heads * cfg.head_dim  # one token of one layer's K: rows of head_dim, groups of <= 64
        groups = cfg.n_kv_heads * -(-cfg.head_dim // min(64, cfg.head_dim))
        assert by_codec[codec]["parts"]["V1"] == row * bits / 8 + 2 * groups
    ratios = [by_codec[c]["ratio"] for c in ("INT2_HADAMARD", "INT3_HADAMARD", "INT4_HADAMARD", "INT8_ZSTD", "RAW")]
    assert ratios == sorted(ratios) and ratios[-1] > 1  # RAW pays its framing
    assert [len(rows) for rows in (medium, big)] == [len(default)] * 2
    assert {r["codec"]: r["raw_bf16"] for r in big}["RAW"] == 2 * (4096 + 2 * 3 * 8 * 128)

    quality = {q["codec"]: q for q in record["quality"]}
    assert set(quality) == {"FP16_SHUFFLE_ZSTD", "INT8_ZSTD", "INT4_HADAMARD", "INT3_HADAMARD", "INT2_HADAMARD"}
    assert all(q["tau"] >= 1 and 0 <= q["offline_agreement"] <= 1 for q in quality.values())
    lossy = [q for name, q in quality.items() if name != "FP16_SHUFFLE_ZSTD"]
    assert all(0 <= q["draft_agreement"] <= 1 and 0 <= q["first_draft_agreement"] <= 1 for q in lossy)
    assert quality["INT8_ZSTD"]["first_draft_agreement"] > 0.5  # near-lossless: the same drafts, round by round
    assert quality["INT3_HADAMARD"]["round_bytes_per_token"] < quality["FP16_SHUFFLE_ZSTD"]["round_bytes_per_token"]
    assert record["resync"]["INT4_HADAMARD"]["999"] is None  # no prompt that long: not measured
    assert record["resync"]["INT4_HADAMARD"]["4"] < record["resync"]["RAW"]["4"]
    assert set(record["entropy"]["zstd_over_packed"]) == {"INT4_HADAMARD", "INT3_HADAMARD", "INT2_HADAMARD"}
