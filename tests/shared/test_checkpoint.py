"""Checkpoints: Hugging Face Llama/Qwen2 checkpoints load and give transformers' logits; ours round-trip."""

import dataclasses
import json

import pytest
import torch

from tether.shared.checkpoint import fingerprint
from tether.shared.config import PRESETS
from tether.shared.model import Transformer

transformers = pytest.importorskip("transformers")

SMALL = dict(
    vocab_size=300,
    hidden_size=48,
    intermediate_size=72,
    num_hidden_layers=3,
    num_attention_heads=6,
    num_key_value_heads=2,
    max_position_embeddings=128,
)


def randomize(model: torch.nn.Module, seed: int = 0) -> None:
    """Random weights everywhere, biases and norm gains included (transformers initialises those to 0/1)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.2 if p.dim() == 2 else 0.5) + (1.0 if p.dim() == 1 else 0))


def check_against_transformers(hf_model, tmp_path):
    hf_model.eval()
    randomize(hf_model)
    hf_model.save_pretrained(tmp_path)
    ours = Transformer.from_pretrained(tmp_path, dtype=torch.float32)
    x = torch.randint(0, SMALL["vocab_size"], (2, 21), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf_model(x).logits
        got = ours(x)
    assert got.shape == (2, 21, SMALL["vocab_size"])
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    return ours


@pytest.mark.parametrize("tied", [False, True])
def test_llama_checkpoint_matches_transformers(tmp_path, tied):
    cfg = transformers.LlamaConfig(**SMALL, tie_word_embeddings=tied, head_dim=16)
    model = transformers.LlamaForCausalLM(cfg)
    ours = check_against_transformers(model, tmp_path)
    assert ours.cfg.head_dim == 16 and ours.cfg.tied_embeddings == tied and not ours.cfg.moda


def test_llama3_rope_scaling_matches_transformers(tmp_path):
    scaling = dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=16
    )
    cfg = transformers.LlamaConfig(**SMALL, rope_theta=500000.0, rope_scaling=scaling)
    ours = check_against_transformers(transformers.LlamaForCausalLM(cfg), tmp_path)
    assert dict(ours.cfg.rope_scaling)["factor"] == 8.0 and ours.cfg.rope_theta == 500000.0


@pytest.mark.parametrize("tied", [False, True])
def test_qwen2_checkpoint_matches_transformers(tmp_path, tied):
    cfg = transformers.Qwen2Config(**SMALL, tie_word_embeddings=tied)
    ours = check_against_transformers(transformers.Qwen2ForCausalLM(cfg), tmp_path)
    assert ours.cfg.qkv_bias and not ours.cfg.o_bias


def test_our_plain_checkpoint_loads_in_transformers(tmp_path):
    torch.manual_seed(0)
    cfg = dataclasses.replace(PRESETS["tiny"], moda=False, norm_position="pre", tied_embeddings=False)
    ours = Transformer(cfg).eval()
    randomize(ours)
    ours.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "llama"
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    x = torch.randint(0, cfg.vocab_size, (1, 17))
    with torch.no_grad():
        torch.testing.assert_close(ours(x), hf(x).logits, rtol=1e-4, atol=1e-4)


def test_moda_checkpoint_round_trip_and_fingerprint(tmp_path):
    torch.manual_seed(0)
    model = Transformer(PRESETS["tiny"]).eval()
    model.save_pretrained(tmp_path / "a")
    loaded = Transformer.from_pretrained(tmp_path / "a")
    assert loaded.cfg == model.cfg
    x = torch.randint(0, 512, (1, 9))
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))
    fp = fingerprint(tmp_path / "a")
    assert fp == fingerprint(tmp_path / "a") and len(fp) == 64
    with torch.no_grad():
        model.layers[1].ffn_kv_proj.weight[0, 0] += 1
    model.save_pretrained(tmp_path / "b")
    assert fingerprint(tmp_path / "b") != fp


def test_bf16_save_halves_the_file(tmp_path):
    model = Transformer(PRESETS["tiny"])
    model.save_pretrained(tmp_path / "fp32")
    model.save_pretrained(tmp_path / "bf16", dtype=torch.bfloat16)
    a, b = (tmp_path / "fp32/model.safetensors").stat().st_size, (tmp_path / "bf16/model.safetensors").stat().st_size
    assert b < 0.55 * a
    assert Transformer.from_pretrained(tmp_path / "bf16").embed_tokens.weight.dtype == torch.bfloat16


def test_unsupported_checkpoints_are_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="not supported"):
        Transformer.from_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        Transformer.from_pretrained(tmp_path / "missing")
