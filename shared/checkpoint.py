"""Checkpoints in the Hugging Face layout: config.json + model.safetensors (+ tokenizer.json beside them).

Contract:
- `save_model(model, dir)` writes tensors under Hugging Face Llama names (model.layers.N.self_attn.q_proj...),
  so a plain (moda off, pre-norm) checkpoint of ours loads in transformers' LlamaForCausalLM unchanged.
  A MoDA checkpoint says `"model_type": "tether_moda"` and carries our extra fields; it loads only here.
- `load_model(dir)` reads ours, and Llama-, Mistral- and Qwen2-style checkpoints written by transformers
  (single or sharded safetensors). Unsupported features (sliding windows, MLP bias, other RoPE
  scalings) are refused with a clear error rather than loaded wrong.
- `fingerprint(dir)`: sha256 over config.json and every tensor, the identity clients pair against.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tether.shared.config import ModelConfig

MODEL_TYPE = "tether_moda"
HF_PLAIN_TYPES = ("llama", "mistral", "qwen2")

# Our parameter names <-> Hugging Face's ({i} is a layer index). Post-norm blocks reuse the two norm slots.
_NAMES = [
    ("embed_tokens.", "model.embed_tokens."),
    ("embed_norm.", "model.embed_norm."),
    ("layers.{i}.attn.", "model.layers.{i}.self_attn."),
    ("layers.{i}.ffn.", "model.layers.{i}.mlp."),
    ("layers.{i}.attn_norm.", "model.layers.{i}.input_layernorm."),
    ("layers.{i}.ffn_norm.", "model.layers.{i}.post_attention_layernorm."),
    ("layers.{i}.ffn_kv_proj.", "model.layers.{i}.ffn_kv_proj."),
    ("norm.", "model.norm."),
    ("lm_head.", "lm_head."),
]


def _rename(name: str, forward: bool) -> str:
    for ours, theirs in _NAMES:
        src, dst = (ours, theirs) if forward else (theirs, ours)
        pattern = "^" + re.escape(src).replace(r"\{i\}", r"(\d+)")
        new, n = re.subn(pattern, dst.replace("{i}", r"\1"), name)
        if n:
            return new
    raise KeyError(f"unknown tensor name {name!r}")


def to_hf_name(name: str) -> str:
    return _rename(name, forward=True)


def from_hf_name(name: str) -> str:
    return _rename(name, forward=False)


def _rope_settings(hf: dict) -> tuple[float, tuple | None]:
    params = hf.get("rope_parameters") or {}
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    scaling = hf.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
    if scaling:
        scaling = {k: v for k, v in scaling.items() if k != "rope_theta"}
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind not in ("default", "llama3"):
            raise ValueError(f"RoPE scaling {kind!r} is not supported (supported: default, llama3)")
        return theta, tuple(sorted(scaling.items()))
    return theta, None


def config_from_hf(hf: dict) -> ModelConfig:
    """Map a config.json (ours or a Hugging Face Llama/Mistral/Qwen2 one) to a ModelConfig."""
    kind = hf.get("model_type")
    if kind == MODEL_TYPE:
        return ModelConfig.from_dict(hf["tether"])
    if kind not in HF_PLAIN_TYPES:
        raise ValueError(f"model_type {kind!r} is not supported (supported: {MODEL_TYPE}, {', '.join(HF_PLAIN_TYPES)})")
    if hf.get("mlp_bias"):
        raise ValueError("checkpoints with mlp_bias=True are not supported")
    if hf.get("use_sliding_window") or (kind == "mistral" and hf.get("sliding_window")):
        raise ValueError("sliding-window attention is not supported")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"activation {hf.get('hidden_act')!r} is not supported (SwiGLU with silu only)")
    theta, scaling = _rope_settings(hf)
    heads = hf["num_attention_heads"]
    bias = bool(hf.get("attention_bias", False))
    return ModelConfig(
        vocab_size=hf["vocab_size"],
        dim=hf["hidden_size"],
        n_layers=hf["num_hidden_layers"],
        n_heads=heads,
        n_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        ffn_dim=hf["intermediate_size"],
        norm_position="pre",
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        moda=False,
        moda_ffn_kv=False,
        tied_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=bias or kind == "qwen2",
        o_bias=bias and kind != "qwen2",
        max_seq_len=hf.get("max_position_embeddings", 2048),
    )


def config_to_hf(cfg: ModelConfig) -> dict:
    """config.json content: Llama-compatible keys always; our own block for everything Llama lacks."""
    plain_llama = not cfg.moda and cfg.norm_position == "pre" and cfg.qkv_bias == cfg.o_bias
    out = {
        "architectures": ["LlamaForCausalLM"] if plain_llama else ["TetherMoDAForCausalLM"],
        "model_type": "llama" if plain_llama else MODEL_TYPE,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.ffn_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": dict(cfg.rope_scaling) if cfg.rope_scaling else None,
        "tie_word_embeddings": cfg.tied_embeddings,
        "attention_bias": cfg.qkv_bias,
        "max_position_embeddings": cfg.max_seq_len,
        "tether": cfg.to_dict(),
    }
    return out


def save_model(model: torch.nn.Module, path: str | Path, *, dtype: torch.dtype | None = None) -> None:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, t in model.state_dict().items():
        t = t.detach().to("cpu")
        tensors[to_hf_name(name)] = (t.to(dtype) if dtype is not None and t.is_floating_point() else t).contiguous()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config_to_hf(model.cfg), indent=2, sort_keys=True) + "\n")


def _safetensor_files(path: Path) -> list[Path]:
    single = path / "model.safetensors"
    if single.exists():
        return [single]
    index = path / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / s for s in shards]
    raise FileNotFoundError(f"{path} holds neither model.safetensors nor model.safetensors.index.json")


def load_model(path: str | Path, *, device: str | torch.device = "cpu", dtype: torch.dtype | None = None):
    from tether.shared.model import Transformer

    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise FileNotFoundError(f"{path} is not a model directory: no config.json")
    cfg = config_from_hf(json.loads(cfg_file.read_text()))
    with torch.device("meta"):
        model = Transformer(cfg)
    state = {}
    for f in _safetensor_files(path):
        with safe_open(str(f), framework="pt", device="cpu") as sf:
            for name in sf.keys():
                if name.endswith("rotary_emb.inv_freq"):
                    continue  # older transformers saved this buffer; we derive it from the config
                state[from_hf_name(name)] = sf.get_tensor(name)
    if cfg.tied_embeddings:
        state.pop("lm_head.weight", None)
    expected = set(model.state_dict())
    missing, unexpected = expected - set(state), set(state) - expected
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {path} does not match its config: missing {sorted(missing)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]}"
        )
    model.load_state_dict(state, assign=True)
    # Buffers were created on the meta device; rebuild them for real.
    from tether.shared.model import rope_frequencies

    model.inv_freq = rope_frequencies(cfg)
    if dtype is not None:
        model = model.to(dtype)
        model.inv_freq = model.inv_freq.float()
    return model.to(device).eval()


def fingerprint(path: str | Path) -> str:
    """sha256 over config.json and every tensor's name, dtype, shape and bytes, in name order."""
    path = Path(path)
    h = hashlib.sha256()
    h.update((path / "config.json").read_bytes())
    for f in _safetensor_files(path):
        with safe_open(str(f), framework="pt", device="cpu") as sf:
            for name in sorted(sf.keys()):
                t = sf.get_tensor(name)
                h.update(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
                h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
