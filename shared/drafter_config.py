"""The drafter's configuration and the shape of its deltas, without torch: what both ends and the torch-free edge
client share (tether.shared.drafter builds and runs the torch drafters from them).

Contract:
- `DrafterConfig`: a drafter's architecture (MoA with TLI N, or EAGLE); `to_dict` / `from_dict` (unknown fields
  refused; `tli_depth` is left out of `to_dict` while 0, so older configs and their fingerprints stay as they
  were). `layer_config(target, ...)`: the ModelConfig of one of the drafter's own layers.
- `POSITION_AXIS`: the positions axis of each delta tensor. `ArrayDelta`: a delta whose tensors are numpy
  arrays (what the client decodes from the wire; tether.shared.drafter.DraftDelta holds torch tensors).

    cfg = DrafterConfig.from_dict(json.loads(text))
    delta = ArrayDelta(start, tokens, tether.shared.wire.decode_many(payload))
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

from tether.shared.config import ModelConfig


@dataclass(frozen=True)
class DrafterConfig:
    kind: str = "moa"  # "moa" (Mixture of Attentions) or "eagle" (the EAGLE-style baseline)
    tli: int = 1  # MoA: how many of the target's last layers the client re-runs (TLI N); 0 = CA feeds the head
    n_heads: int = 6  # SA / CA / EAGLE attention query heads
    n_kv_heads: int = 2  # their key/value heads
    head_dim: int = 32  # their per-head width
    ffn_dim: int = 512  # SA and CA SwiGLU width
    lsa_heads: int = 4  # LSA query heads (LSA width is the target's 2 * Hkv * D)
    lsa_kv_heads: int = 2  # LSA key/value heads
    lsa_ffn_dim: int = 256  # LSA SwiGLU width
    eagle_ffn_dim: int = 0  # EAGLE SwiGLU width; 0 = sized so EAGLE's trainable budget matches MoA's
    target_fingerprint: str = ""  # sha256 of the target checkpoint this drafter was trained against
    tli_depth: int = 0  # MoA, MoDA target, 0 < TLI N < L: width of the lower layers' depth K/V predictor; 0 = off

    def __post_init__(self) -> None:
        if self.tli_depth < 0:
            raise ValueError(f"tli_depth must be >= 0, got {self.tli_depth}")
        if self.tli_depth and (self.kind != "moa" or self.tli == 0):
            raise ValueError(f"tli_depth={self.tli_depth} needs a MoA drafter with TLI N >= 1: set tli_depth=0")

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        if not self.tli_depth:
            del d["tli_depth"]  # off: the dict (and every fingerprint over it) stays what it was before the field
        return d

    @classmethod
    def from_dict(cls, d: dict) -> DrafterConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        if set(d) - known:
            raise ValueError(f"unknown DrafterConfig fields: {sorted(set(d) - known)}")
        return cls(**d)


def layer_config(target: ModelConfig, dim: int, n_heads: int, n_kv_heads: int, head_dim: int, ffn_dim: int):
    """A plain pre-norm decoder layer's config for the drafter's own layers (SA, CA, LSA, EAGLE)."""
    return dataclasses.replace(
        target,
        dim=dim,
        n_layers=1,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        ffn_dim=ffn_dim,
        norm_position="pre",
        moda=False,
        moda_ffn_kv=False,
        qkv_bias=False,
        o_bias=False,
        rope_scaling=None,
    )


# The positions axis of each delta tensor: MoA's LSA vectors [n, dim] and TLI K/V [N, n, Hkv, D]; EAGLE's
# hidden states [n, dim].
POSITION_AXIS = {"lsa": 0, "tli_k": 1, "tli_v": 1, "hidden": 0}


@dataclass
class ArrayDelta:
    """A delta with numpy tensors: verified positions [start, start + n) of one sequence."""

    start: int
    tokens: list[int]
    tensors: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def n(self) -> int:
        return len(self.tokens)
