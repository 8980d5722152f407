"""A short CPU training run lowers the held-out loss, resumes from its checkpoint, and leaves a usable model."""

import json

import pytest
import torch

from tether.server.cli import main as server_main
from tether.server.train_target import TrainConfig, lr_at, train_target
from tether.shared.model import Transformer
from tether.shared.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from tether.server.corpus import build_corpus

    path = tmp_path_factory.mktemp("corpus")
    build_corpus(path, max_files=60, vocab_size=512, progress=False)
    return path


def test_short_run_lowers_heldout_loss_and_resumes(tmp_path, corpus):
    cfg = TrainConfig(
        preset="tiny",
        out=str(tmp_path / "run"),
        data=str(corpus),
        steps=60,
        batch_size=16,
        seq_len=64,
        lr=3e-3,
        warmup=10,
        eval_every=30,
        eval_windows=32,
        save_every=30,
        quiet=True,
    )
    summary = train_target(cfg)
    assert summary["steps"] == 60  # bounded by steps, never by the clock: the same run on a busy machine
    assert summary["heldout_loss"] < summary["heldout_loss_initial"] - 0.5
    out = tmp_path / "run"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "checkpoint.pt", "loss.png", "history.json"):
        assert (out / name).exists(), name
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # Resuming: a larger step budget continues from the checkpoint rather than starting over.
    steps_done = summary["steps"]
    resumed = train_target(TrainConfig(**{**cfg.__dict__, "steps": steps_done + 20, "time_limit_s": 0}))
    assert resumed["steps"] == steps_done + 20
    history = json.loads((out / "history.json").read_text())
    assert history["val"][0][1] == pytest.approx(summary["heldout_loss_initial"])

    model = Transformer.from_pretrained(out, dtype=torch.float32)
    tok = Tokenizer.from_pretrained(out)
    assert model.cfg.vocab_size == tok.vocab_size
    ids = torch.tensor([tok.encode("def main():\n")])
    assert model(ids).shape == (1, ids.shape[1], tok.vocab_size)


def test_a_time_limit_stops_the_run_and_a_later_run_goes_on(tmp_path, corpus):
    """A limit already passed when training starts (any positive one this small): the run stops before its first
    step and saves what it has; a later run without a limit goes on from there (no clock read by the test)."""
    cfg = TrainConfig(preset="tiny", out=str(tmp_path / "run"), data=str(corpus), steps=50, batch_size=4,
                      seq_len=32, warmup=2, eval_every=25, eval_windows=4, save_every=25, time_limit_s=1e-9,
                      quiet=True)  # fmt: skip
    assert train_target(cfg)["steps"] == 0
    assert train_target(TrainConfig(**{**cfg.__dict__, "steps": 3, "time_limit_s": 0}))["steps"] == 3


def test_cli_train_then_generate(tmp_path, corpus, capsys):
    out = tmp_path / "cli"
    rc = server_main(
        ["train-target", "--preset", "tiny", "--out", str(out), "--data", str(corpus), "--steps", "5",
         "--batch-size", "4", "--seq-len", "32", "--eval-every", "5", "--eval-windows", "8", "--quiet",
         "--set", "moda=false", "--set", 'norm_position="pre"']
    )  # fmt: skip
    assert rc == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["steps"] == 5 and summary["moda"] is False and summary["norm_position"] == "pre"
    rc = server_main(
        ["generate", "--model", str(out), "--drafter", "none", "--prompt", "import os\n", "--max-new-tokens", "12",
         "--json"]
    )  # fmt: skip
    assert rc == 0
    result = json.loads(capsys.readouterr().out)
    assert 1 <= result["new_tokens"] <= 12 and isinstance(result["text"], str)


def test_lr_schedule_warms_up_then_decays():
    cfg = TrainConfig(lr=1.0, warmup=10, steps=110, min_lr_ratio=0.1)
    assert lr_at(0, cfg) == pytest.approx(0.1)
    assert lr_at(9, cfg) == pytest.approx(1.0)
    assert lr_at(60, cfg) == pytest.approx(0.55)
    assert lr_at(110, cfg) == pytest.approx(0.1)


def test_generate_reports_clear_errors(tmp_path, capsys):
    assert server_main(["generate", "--model", str(tmp_path), "--prompt", "x"]) == 2
    assert "no tokenizer.json" in capsys.readouterr().err
