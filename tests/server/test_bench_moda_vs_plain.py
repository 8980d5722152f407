"""bench/moda_vs_plain.py on two tiny CPU runs (a MoDA model and its plain twin, bounded by steps): the record pairs
their held-out losses at every shared evaluation step, the table and the plot come out, and runs that cannot be
compared step for step (swapped, another batch size) are refused with status 2."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tether.server.train.target import TrainConfig, train_target

BENCH = Path(__file__).resolve().parents[2] / "bench" / "moda_vs_plain.py"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from tether.server.train.corpus import build_corpus

    tmp = tmp_path_factory.mktemp("twins")
    build_corpus(tmp / "corpus", max_files=40, vocab_size=512, progress=False)
    base = TrainConfig(preset="tiny", data=str(tmp / "corpus"), steps=12, batch_size=4, seq_len=32, warmup=2,
                       eval_every=4, eval_windows=4, save_every=100, quiet=True)  # fmt: skip
    out = {}
    for name, overrides in (("moda", ()), ("plain", (("moda", False),)), ("wide", ())):
        batch = 8 if name == "wide" else base.batch_size  # "wide": 2x the tokens per step
        cfg = TrainConfig(**{**base.__dict__, "out": str(tmp / name), "overrides": overrides, "batch_size": batch})
        out[name] = (tmp / name, train_target(cfg))
    return out


def _bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCH), *args], capture_output=True, text=True, timeout=120)


def test_pairs_heldout_losses_at_equal_steps(runs, tmp_path):
    (moda_dir, moda), (plain_dir, plain) = runs["moda"], runs["plain"]
    plot = tmp_path / "twins.png"
    done = _bench("--moda", str(moda_dir), "--plain", str(plain_dir), "--plot", str(plot))
    assert done.returncode == 0, done.stderr
    record = json.loads(done.stdout.strip().splitlines()[-1])
    assert "MoDA - plain" in done.stdout  # the table's header came first
    assert [p["step"] for p in record["points"]] == [0, 4, 8, 12]
    history = {d: json.loads((d / "history.json").read_text())["val"] for d in (moda_dir, plain_dir)}
    for point, (tm, lm), (tp, lp) in zip(record["points"], history[moda_dir], history[plain_dir], strict=True):
        assert point["tokens"] == tm == tp == point["step"] * moda["tokens_per_step"]
        assert (point["moda"], point["plain"]) == (lm, lp)
        assert point["delta"] == pytest.approx(lm - lp)
    assert record["last"]["moda"] == moda["heldout_loss"] and record["last"]["plain"] == plain["heldout_loss"]
    assert record["moda"]["params"] > record["plain"]["params"]  # the FFN depth K/V projections
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_refuses_runs_it_cannot_compare_step_for_step(runs, tmp_path):
    moda_dir, plain_dir, wide_dir = runs["moda"][0], runs["plain"][0], runs["wide"][0]
    swapped = _bench("--moda", str(plain_dir), "--plain", str(moda_dir))
    assert swapped.returncode == 2 and "holds a plain model" in swapped.stderr
    wide = _bench("--moda", str(wide_dir), "--plain", str(plain_dir))
    assert wide.returncode == 2 and "tokens per step" in wide.stderr
    missing = _bench("--moda", str(tmp_path), "--plain", str(plain_dir))
    assert missing.returncode == 2 and "history.json" in missing.stderr
