"""The shipped default model loads, is the size we promise, and generates text from its tokenizer."""

from pathlib import Path

import torch

from tether.server.generate import GenerateConfig, generate_text
from tether.shared.model import Transformer
from tether.shared.tokenizer import Tokenizer

DEFAULT = Path(__file__).resolve().parent.parent / "deploy" / "models" / "target"


def test_default_model_is_small_moda_and_loads():
    # Issue #43's budget: the default target's committed files within 48 MB (with its drafters:
    # tests/deploy/test_models_pipeline.py).
    total = sum(f.stat().st_size for f in DEFAULT.iterdir())
    assert total <= 48_000_000
    model = Transformer.from_pretrained(DEFAULT, dtype=torch.float32)
    tok = Tokenizer.from_pretrained(DEFAULT)
    assert model.cfg.moda and model.cfg.moda_ffn_kv
    assert model.cfg.vocab_size == tok.vocab_size


def test_default_model_generates_python_like_text():
    plain = dict(model=str(DEFAULT), prompt="import os\n", max_new_tokens=40, device="cpu", drafter="none")
    result = generate_text(GenerateConfig(**plain))
    assert result["new_tokens"] == 40 and result["tau"] == 1.0
    # The default drafter speeds it up without changing a token (greedy), and gains more than one token a round.
    spec = generate_text(GenerateConfig(**{**plain, "drafter": str(DEFAULT.parent / "drafter")}))
    assert spec["token_ids"] == result["token_ids"]
    assert spec["tau"] > 1.5 and spec["rounds"] < 30
    # A trained model continues an import line with code, not noise: most of its text is ASCII and it
    # opens at least one more import or definition.
    text = result["text"]
    assert sum(c.isascii() for c in text) / len(text) > 0.95
    assert any(word in text for word in ("import", "def ", "class ", "="))


def test_top_k_one_samples_what_greedy_picks_with_and_without_the_drafter():
    """`tether-server generate --top-k 1` at a high temperature: the target's rule keeps only its argmax, so plain and
    speculative sampling (whose drafts ignore top_k: the verifier decides) both give greedy's tokens."""
    plain = dict(model=str(DEFAULT), prompt="def main():\n", max_new_tokens=24, device="cpu", drafter="none")
    greedy = generate_text(GenerateConfig(**plain))["token_ids"]
    hot = dict(temperature=1.5, top_k=1, seed=3)
    assert generate_text(GenerateConfig(**plain, **hot))["token_ids"] == greedy
    spec = generate_text(GenerateConfig(**{**plain, "drafter": str(DEFAULT.parent / "drafter")}, **hot))
    assert spec["token_ids"] == greedy
