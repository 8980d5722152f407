"""Drafter training: block-bounded verification points, a short run that learns, resume, and pairing checks."""

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tether.server.train.drafter import DrafterTrainConfig, staircase_mask, train_drafter, verification_boundaries
from tether.shared.checkpoint import fingerprint
from tether.shared.config import PRESETS
from tether.shared.drafter_loading import load_drafter
from tether.shared.model import Transformer
from tether.shared.tokenizer import Tokenizer

pytestmark = pytest.mark.heavy  # a long file, started first (tests/conftest.py)

SMALL_DRAFTER = (("n_heads", 4), ("n_kv_heads", 2), ("head_dim", 12), ("ffn_dim", 64), ("lsa_ffn_dim", 32))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from tether.server.train.corpus import build_corpus

    root = tmp_path_factory.mktemp("drafter")
    build_corpus(root / "corpus", max_files=40, vocab_size=512, progress=False)
    torch.manual_seed(0)
    target = Transformer(PRESETS["tiny"])
    target.save_pretrained(root / "target")
    Tokenizer.from_pretrained(root / "corpus").save_pretrained(root / "target")
    return root


def test_verification_boundaries_are_block_bounded():
    b = verification_boundaries(64, 50, 6, 14, np.random.default_rng(0)).numpy()
    t = np.arange(50)[None]
    assert (b <= t).all() and (b >= 0).all()
    assert ((t - b) <= 13).all()  # never more than a block of drafted positions
    for row in b:
        points = np.unique(row)
        gaps = np.diff(points)  # the first block is cut short by the random phase; the others are k long
        assert len(set(gaps[1:].tolist())) <= 1 and all(1 <= g <= 14 for g in gaps)
        assert len(gaps) < 2 or 6 <= gaps[1] <= 14
    mask = staircase_mask(torch.as_tensor(b[:1]))
    assert mask[0, 20].sum() == 20 - b[0, 20] + 1


@pytest.mark.parametrize("kind,tli", [("moa", 1), ("eagle", 0)])
def test_short_run_learns_resumes_and_pairs(setup, tmp_path, kind, tli):
    cfg = DrafterTrainConfig(
        target=str(setup / "target"), data=str(setup / "corpus"), kind=kind, tli=tli, out=str(tmp_path / kind),
        steps=40, batch_size=8, seq_len=64, lr=3e-3, warmup=5, eval_every=20, eval_windows=8, eval_prompts=2,
        eval_prompt_len=16, eval_new_tokens=12, quiet=True, overrides=SMALL_DRAFTER,
    )  # fmt: skip
    summary = train_drafter(cfg)
    history = json.loads((tmp_path / kind / "history.json").read_text())
    assert history["val"][-1][1] < history["val"][0][1] - 0.05
    assert summary["heldout_tau"] >= 1.0 and summary["steps"] == 40
    resumed = train_drafter(DrafterTrainConfig(**{**cfg.__dict__, "steps": 50}))
    assert resumed["steps"] == 50
    target = Transformer.from_pretrained(setup / "target")
    drafter = load_drafter(tmp_path / kind, target, target_fingerprint=fingerprint(setup / "target"))
    assert drafter.dcfg.kind == kind and drafter.dcfg.tli == tli
    with pytest.raises(ValueError, match="was trained for target"):
        load_drafter(tmp_path / kind, target, target_fingerprint="0" * 64)


@pytest.mark.parametrize("kind,tli", [("moa", 1), ("eagle", 0)])
def test_a_resumed_run_is_the_run_left_alone(setup, tmp_path, kind, tli):
    """Stopped and resumed from its checkpoint (an evaluation in between), a run trains the same weights bit for
    bit as one left alone: each step's batch, verification points and noise come from (seed, step)."""
    cfg = DrafterTrainConfig(
        target=str(setup / "target"), data=str(setup / "corpus"), kind=kind, tli=tli, out=str(tmp_path / "whole"),
        steps=8, batch_size=4, seq_len=32, lr=3e-3, warmup=2, eval_every=100, eval_windows=4, eval_prompts=1,
        eval_prompt_len=8, eval_new_tokens=4, quiet=True, overrides=SMALL_DRAFTER,
    )  # fmt: skip
    train_drafter(cfg)
    chunked = {**cfg.__dict__, "out": str(tmp_path / "chunked")}
    train_drafter(DrafterTrainConfig(**{**chunked, "steps": 3}))
    train_drafter(DrafterTrainConfig(**chunked))
    whole = load_file(str(tmp_path / "whole" / "drafter.safetensors"))
    resumed = load_file(str(tmp_path / "chunked" / "drafter.safetensors"))
    assert whole.keys() == resumed.keys()
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)


def test_depth_predictor_trains_from_an_initial_drafter(setup, tmp_path):
    """--init starts from a drafter without a predictor (which starts fresh); the predictor-only steps and the full
    steps after them lower its held-out regression loss; a drafter of another architecture is refused."""
    common = dict(
        target=str(setup / "target"), data=str(setup / "corpus"), kind="moa", tli=1, batch_size=8, seq_len=64,
        lr=1e-2, warmup=2, eval_windows=8, eval_prompts=1, eval_prompt_len=16, eval_new_tokens=4, quiet=True,
    )  # fmt: skip
    train_drafter(DrafterTrainConfig(**common, out=str(tmp_path / "plain"), steps=2, overrides=SMALL_DRAFTER))
    cfg = DrafterTrainConfig(**common, out=str(tmp_path / "depth"), steps=24, depth_only_steps=20, eval_every=12,
                             init=str(tmp_path / "plain"), overrides=(*SMALL_DRAFTER, ("tli_depth", 16)))  # fmt: skip
    summary = train_drafter(cfg)
    depth = json.loads((tmp_path / "depth" / "history.json").read_text())["depth"]
    assert [s for s, _ in depth] == [0, 12, 24]
    assert depth[-1][1] < 0.95 * depth[0][1] and summary["heldout_depth_loss"] == depth[-1][1]
    target = Transformer.from_pretrained(setup / "target")
    drafter = load_drafter(tmp_path / "depth", target)
    assert drafter.dcfg.tli_depth == 16 and drafter.depth_predictor is not None
    with pytest.raises(ValueError, match="is another drafter"):
        train_drafter(DrafterTrainConfig(**{**cfg.__dict__, "out": str(tmp_path / "x"), "tli": 2}))


def test_the_default_target_is_found_from_any_directory(tmp_path, monkeypatch):
    """train-drafter without --target trains for the checkout's default model, as generate and serve use it, from
    wherever the command runs (it was a path relative to the repository root)."""
    from pathlib import Path

    from tether.server.train.drafter import DrafterTrainConfig

    monkeypatch.chdir(tmp_path)
    assert (Path(DrafterTrainConfig().target) / "config.json").is_file()
