"""Model configuration: one frozen dataclass for the target LLM, plus named presets.

Contract: a ModelConfig fully describes a target's shapes and the MoDA switches; checkpoints store it as
config.json (see tether.shared.checkpoint). Presets are starting points for `train-target --preset NAME`.

    from tether.shared.config import ModelConfig, PRESETS
    cfg = PRESETS["small"]                      # the default shipped target
    cfg = dataclasses.replace(cfg, moda=False)  # its plain-Llama twin
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

NormPosition = Literal["pre", "post"]


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 4096  # tokenizer vocabulary, including special tokens
    dim: int = 192  # residual stream width (hidden_size in Hugging Face terms)
    n_layers: int = 8  # decoder blocks
    n_heads: int = 6  # query heads
    n_kv_heads: int = 2  # key/value heads (GQA); must divide n_heads
    head_dim: int = 32  # per-head width; need not equal dim // n_heads (Qwen/Llama-3 style)
    ffn_dim: int = 384  # SwiGLU hidden width
    norm_position: NormPosition = "post"  # "pre": x + f(norm(x)) (Llama); "post": norm(x + f(x)) (MoDA's best)
    norm_eps: float = 1e-5  # RMSNorm epsilon
    rope_theta: float = 10000.0  # RoPE base
    rope_scaling: tuple[tuple[str, float | str], ...] | None = None  # Llama-3 style rope scaling, as sorted items
    moda: bool = True  # Mixture-of-Depths Attention: attend also to this token's K/V from earlier layers
    moda_ffn_kv: bool = True  # each FFN also writes a depth K/V from a linear projection of its input
    tied_embeddings: bool = True  # LM head shares the embedding matrix
    qkv_bias: bool = False  # bias on q/k/v projections (Qwen2 has it)
    o_bias: bool = False  # bias on the attention output projection (Llama with attention_bias=True)
    max_seq_len: int = 2048  # longest sequence the RoPE table and KV caches are sized for

    def __post_init__(self) -> None:
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        if self.norm_position not in ("pre", "post"):
            raise ValueError(f"norm_position must be 'pre' or 'post', got {self.norm_position!r}")
        if self.moda_ffn_kv and not self.moda:
            object.__setattr__(self, "moda_ffn_kv", False)

    @property
    def n_rep(self) -> int:
        """Query heads per KV head (the GQA group size G)."""
        return self.n_heads // self.n_kv_heads

    @property
    def depth_per_layer(self) -> int:
        """Depth K/V entries one block writes for the blocks after it: its attention's, plus its FFN's."""
        if not self.moda:
            return 0
        return 2 if self.moda_ffn_kv else 1

    def depth_len(self, layer: int) -> int:
        """How many depth entries the attention of `layer` sees (those written by layers before it)."""
        return layer * self.depth_per_layer

    def num_params(self, include_embeddings: bool = True) -> int:
        d, hd = self.dim, self.head_dim
        attn = d * hd * (self.n_heads * 2 + self.n_kv_heads * 2)
        attn += (hd * (self.n_heads + 2 * self.n_kv_heads) if self.qkv_bias else 0) + (d if self.o_bias else 0)
        ffn = 3 * d * self.ffn_dim
        depth = d * 2 * self.n_kv_heads * hd if self.moda_ffn_kv else 0
        block = attn + ffn + depth + 2 * d
        emb = self.vocab_size * d * (1 if self.tied_embeddings else 2)
        return self.n_layers * block + d + (emb if include_embeddings else 0)

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["rope_scaling"] = dict(self.rope_scaling) if self.rope_scaling else None
        return out

    @classmethod
    def from_dict(cls, d: dict) -> ModelConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown ModelConfig fields: {sorted(unknown)}")
        d = dict(d)
        if d.get("rope_scaling") is not None:
            d["rope_scaling"] = tuple(sorted(d["rope_scaling"].items()))
        return cls(**d)


# dim 768, 12 layers, 12 query / 4 KV heads of 64 (GQA 3), SwiGLU 2048, seq up to 2048.
_MEDIUM = ModelConfig(
    vocab_size=8192, dim=768, n_layers=12, n_heads=12, n_kv_heads=4, head_dim=64, ffn_dim=2048, norm_position="pre"
)

_LLAMA3_8B = ModelConfig(
    vocab_size=128256,
    dim=4096,
    n_layers=32,
    n_heads=32,
    n_kv_heads=8,
    head_dim=128,
    ffn_dim=14336,
    norm_position="pre",
    rope_theta=500000.0,
    moda=False,
    moda_ffn_kv=False,
    tied_embeddings=False,
    max_seq_len=8192,
)

PRESETS: dict[str, ModelConfig] = {
    # Unit tests: every feature on, awkward sizes, runs in milliseconds.
    "tiny": ModelConfig(vocab_size=512, dim=48, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=12, ffn_dim=80),
    # The default shipped target (3.5M parameters, ~7 MB in bf16 with its tokenizer). Pre-norm: at this size and
    # budget it beat post-norm by 0.11 nats held-out, with or without MoDA (deploy/models/README.md).
    "small": ModelConfig(norm_position="pre"),
    # The same model post-norm, as the MoDA paper prefers at scale.
    "small-post": ModelConfig(norm_position="post"),
    # The plain-Llama twin for the MoDA ablation: same shapes and budget, no depth attention.
    "small-plain": ModelConfig(norm_position="pre", moda=False, moda_ffn_kv=False),
    # A larger research size for GPU runs (about 30M parameters).
    "base": ModelConfig(
        vocab_size=8192, dim=512, n_layers=12, n_heads=8, n_kv_heads=4, head_dim=64, ffn_dim=1408, max_seq_len=4096
    ),
    # Issue [7/7]'s larger target: GPT-2-small sized, for the package corpus (`build-corpus --packages`, vocab 8192)
    # on one H200 (deploy/models/README.md). Transformer(cfg) holds 86,526,720 parameters, 80,235,264 without the
    # (tied) embeddings; 4,718,592 of them are the FFN depth K/V projections. Pre-norm, as measured best at 3.5M.
    "medium": _MEDIUM,
    # Its plain-Llama twin for the MoDA ablation: same shapes, no depth attention. 81,808,128 parameters,
    # 75,516,672 without the embeddings.
    "medium-plain": dataclasses.replace(_MEDIUM, moda=False, moda_ffn_kv=False),
    # Issue [2/7]'s default candidate: a MoDA target sized so that it and its MoA and EAGLE drafters (2.07M trainable
    # parameters each) stay within 48 MB of bf16 weights, trained on the package corpus (vocab 8192) on one H200
    # (deploy/models/README.md, "compact"). Transformer(cfg) holds 19,128,192 parameters (38.3 MB in bf16); pre-norm
    # MoDA with FFN depth K/V, as measured best at 3.5M; SwiGLU 960 rather than 1024 keeps the three under 48 MB.
    "compact": ModelConfig(
        vocab_size=8192, dim=384, n_layers=10, n_heads=6, n_kv_heads=2, head_dim=64, ffn_dim=960, norm_position="pre"
    ),
    # Llama-3-8B shapes (random weights) for kernel and tensor-parallel benchmarks.
    "llama3-8b": _LLAMA3_8B,
    # Llama-3.2-1B shapes (random weights): the capacity benchmark's smaller real-size target (bench/capacity.py).
    "llama3-1b": dataclasses.replace(
        _LLAMA3_8B, dim=2048, n_layers=16, head_dim=64, ffn_dim=8192, tied_embeddings=True
    ),
}


def preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}") from None
