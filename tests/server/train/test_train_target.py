"""A short CPU training run lowers the held-out loss, resumes from its checkpoint, and leaves a usable model; a run
cut into chunks (by steps or by a faked clock) is bit for bit the run left alone; throughput is recorded; the
larger presets hold the parameters their comments state. Every run is bounded by steps, never by the clock."""

import dataclasses
import json
import math

import pytest
import torch

from tether.server.cli import main as server_main
from tether.server.train import target as train_module
from tether.server.train.target import TrainConfig, attention_backend, flops_per_token, lr_at, train_target
from tether.shared.config import PRESETS
from tether.shared.model import Transformer
from tether.shared.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from tether.server.train.corpus import build_corpus

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


def _chunk_cfg(tmp_path, corpus, name: str, **kw) -> TrainConfig:
    """24 steps with evaluations (every 8) and saves (every 12) falling inside and outside chunks."""
    base = dict(preset="tiny", out=str(tmp_path / name), data=str(corpus), steps=24, batch_size=4, seq_len=32,
                warmup=4, eval_every=8, eval_windows=4, save_every=12, quiet=True)  # fmt: skip
    return TrainConfig(**{**base, **kw})


def _final_state(out) -> tuple[dict, dict]:
    ckpt = torch.load(out / "checkpoint.pt", weights_only=False)
    return ckpt["model"], ckpt["history"]


@pytest.fixture(scope="module")
def whole_run(tmp_path_factory, corpus):
    """The reference: 24 steps in one invocation."""
    tmp = tmp_path_factory.mktemp("whole")
    assert train_target(_chunk_cfg(tmp, corpus, "whole"))["finished"]
    return _final_state(tmp / "whole")


def _assert_same_run(out, whole_run) -> None:
    model, history = _final_state(out)
    ref_model, ref_history = whole_run
    assert model.keys() == ref_model.keys()
    for name, tensor in ref_model.items():
        assert torch.equal(model[name], tensor), name  # same batches, same lr, same optimizer state
    assert history["train"] == ref_history["train"]
    assert history["val"] == ref_history["val"]  # the same evaluation steps, none added where a chunk stopped


def test_a_run_in_chunks_of_steps_is_the_run_left_alone(tmp_path, corpus, whole_run):
    cfg = _chunk_cfg(tmp_path, corpus, "chunks", chunk_steps=7)
    summaries = [train_target(cfg) for _ in range(4)]
    assert [s["steps"] for s in summaries] == [7, 14, 21, 24]
    assert [s["finished"] for s in summaries] == [False, False, False, True]
    assert summaries[0]["heldout_loss_tokens"] == 0 and summaries[1]["heldout_loss_tokens"] == 8 * 4 * 32
    _assert_same_run(tmp_path / "chunks", whole_run)


def test_a_run_stopped_by_its_time_limit_resumes_exactly(tmp_path, corpus, whole_run, monkeypatch):
    """A fake clock that moves one second per reading stops each invocation part-way (where depends on how often
    the loop reads it); resumed until finished, the run is the one left alone."""
    ticks = iter(range(10**9))
    monkeypatch.setattr(train_module, "_clock", lambda: float(next(ticks)))
    cfg = _chunk_cfg(tmp_path, corpus, "timed", time_limit_s=20)
    steps = []
    while not steps or steps[-1] < cfg.steps:
        summary = train_target(cfg)
        steps.append(summary["steps"])
        assert summary["finished"] == (summary["steps"] == cfg.steps)
    assert len(steps) > 1 and steps == sorted(set(steps))  # more than one chunk, each making progress
    _assert_same_run(tmp_path / "timed", whole_run)


def test_throughput_is_recorded_per_window_and_for_the_run(tmp_path, corpus):
    cfg = _chunk_cfg(tmp_path, corpus, "speed", steps=12, peak_tflops=1e-3)  # a 1 GFLOP/s "peak": MFU is defined
    summary = train_target(cfg)
    speed = json.loads((tmp_path / "speed" / "history.json").read_text())["speed"]
    assert [s for s, _, _ in speed] == [8, 10, 12]  # an evaluation (8) and every 10 steps close a window
    for _, rate, mfu in speed:
        assert rate > 0 and mfu == pytest.approx(rate * summary["flops_per_token"] / 1e9)
    assert summary["tokens_per_s"] > 0 and summary["run_steps"] == 12 and summary["peak_memory_gib"] is None
    # Without a known peak (the CPU) there is no MFU.
    summary = train_target(dataclasses.replace(cfg, out=str(tmp_path / "nopeak"), peak_tflops=0.0))
    assert summary["mfu"] is None
    assert all(mfu is None for *_, mfu in json.loads((tmp_path / "nopeak" / "history.json").read_text())["speed"])


def test_flops_per_token_counts_every_matrix_and_every_key():
    cfg, T = PRESETS["tiny"], 16
    with torch.device("meta"):
        model = Transformer(cfg)
    weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    weights += model.head_weight.numel()  # the tied head multiplies; the embedding lookup does not
    keys = [t + 1 + cfg.depth_len(layer) for layer in range(cfg.n_layers) for t in range(T)]  # seen, per token
    attention = 4 * cfg.n_heads * cfg.head_dim * sum(keys) / T  # QK and PV, 2 FLOPs a multiply-add
    assert flops_per_token(cfg, T) == pytest.approx(3 * (2 * weights + attention))


def test_the_attention_backend_defaults_to_the_fused_one_on_cuda_only():
    assert attention_backend(TrainConfig(device="cpu")) == "reference"
    assert attention_backend(TrainConfig(device="cuda")) == "flex"
    assert attention_backend(TrainConfig(device="cuda", attention="sdpa")) == "sdpa"
    with pytest.raises(ValueError, match="unknown attention backend"):
        attention_backend(TrainConfig(attention="nope"))


def test_the_fused_attention_backend_trains_like_the_reference(tmp_path, corpus):
    """On the CPU "flex" runs the same softmax split in two and merged: the same run, to rounding."""
    runs = {name: train_target(_chunk_cfg(tmp_path, corpus, name, steps=10, attention=name))
            for name in ("reference", "flex")}  # fmt: skip
    assert runs["flex"]["attention"] == "flex"
    assert runs["flex"]["heldout_loss"] == pytest.approx(runs["reference"]["heldout_loss"], abs=1e-3)


@pytest.mark.parametrize(
    "name, params, without_embeddings, moda", [("medium", 86_526_720, 80_235_264, True),
                                               ("medium-plain", 81_808_128, 75_516_672, False)]
)  # fmt: skip
def test_the_medium_twins_hold_the_parameters_their_comments_state(name, params, without_embeddings, moda):
    cfg = PRESETS[name]
    with torch.device("meta"):
        model = Transformer(cfg)
    numel = sum(p.numel() for p in model.parameters())
    assert numel == params == cfg.num_params()
    assert numel - model.embed_tokens.weight.numel() == without_embeddings == cfg.num_params(False)
    assert 50e6 <= numel <= 150e6 and cfg.moda is moda and cfg.moda_ffn_kv is moda
    twin = dataclasses.replace(PRESETS["medium"], moda=False, moda_ffn_kv=False)
    assert twin == PRESETS["medium-plain"]  # the twins differ in the MoDA switches alone
    assert cfg.head_dim in (64, 128) and cfg.n_kv_heads < cfg.n_heads and cfg.max_seq_len >= 1024
    assert math.log2(cfg.vocab_size) == 13  # the package corpus's tokenizer (build-corpus --vocab-size 8192)


def test_cli_chunk_flags(tmp_path, corpus, capsys):
    out = tmp_path / "cli-chunk"
    args = ["train-target", "--preset", "tiny", "--out", str(out), "--data", str(corpus), "--steps", "6",
            "--batch-size", "2", "--seq-len", "16", "--eval-every", "3", "--eval-windows", "2", "--quiet",
            "--chunk-steps", "4", "--attention", "flex", "--no-compile", "--peak-tflops", "1"]  # fmt: skip
    assert server_main(args) == 0
    first = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (first["steps"], first["finished"], first["attention"], first["compile"]) == (4, False, "flex", False)
    assert server_main(args) == 0
    second = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (second["steps"], second["finished"], second["run_steps"]) == (6, True, 2)
    with pytest.raises(SystemExit):  # argparse refuses a backend that is not registered
        server_main([*args, "--attention", "nope"])
