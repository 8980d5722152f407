"""TLI with depth: the MoA drafter's prediction of the depth K/V its TLI blocks cannot see.

Why: in a MoDA target every block attends, at its own position, to the depth entries the blocks below it wrote
(tether.shared.model.DepthStream: each block's rotated attention k, v and, with moda_ffn_kv, one FFN k, v). At a
drafted position the MoA drafter re-runs only the target's last N blocks (TLI), so the first of them would attend
to no entries of the L - N layers below it and compute something else than the target's own block even with the
target's exact input and sequence K/V. The TLI weights are the target's, frozen: training cannot absorb the gap.

What: `DepthPredictor`, a bottleneck MLP from the hidden the drafter feeds its TLI blocks ([B, T, dim]) and the
token's embedding (the target's, [B, T, dim]) to the E = (L - N) * depth_per_layer missing entries, K and V
[B, T, E, Hkv, D] in the target's order (layer by layer, attention entry first, then the FFN's). The embedding is
there because layer 0's attention entries are a linear function of the token alone, which the hidden, after L - N
blocks, carries only blurred (measured on the default target, TLI 3, from the hidden alone: relative squared error
0.14 / 0.29 on layer 0's attention K / V against 0.02 / 0.06 on layer 4's). K comes out as the target stores
it, rotated at the token's position; the MLP predicts it before rotation, so what it learns does not depend on the
position (a same-position score is rotation invariant: only the pre-rotation content matters).
`MoADrafter.run_tli` pre-fills its DepthStream with these entries (tether.shared.moa); `depth_regression` is the
training loss against the target's real entries (tether.server.train.drafter), scale-free per K and V so that
neither dominates.

Contract: off unless DrafterConfig.tli_depth > 0, which needs a MoA drafter with TLI 1 <= N < L on a MoDA target
(elsewhere nothing is missing: a plain target writes no depth entries, TLI 0 runs no target block, TLI L re-runs
every block); `check_tli_depth` refuses other combinations with a ValueError that says so.

    predictor = DepthPredictor(target.cfg, n_tli=3, width=256)
    k, v = predictor(h, target.embed_tokens(tokens), cos, sin)   # -> [B, T, E, Hkv, D] each
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tether.shared.config import ModelConfig
from tether.shared.model import RMSNorm, apply_rope


def lower_entries(target: ModelConfig, n_tli: int) -> int:
    """E: the depth entries the target's layers below its last `n_tli` write (what the first TLI block reads)."""
    return (target.n_layers - n_tli) * target.depth_per_layer


def check_tli_depth(target: ModelConfig, kind: str, n_tli: int, width: int) -> None:
    """Refuse a depth predictor where there is nothing to predict (module docstring)."""
    if width < 0:
        raise ValueError(f"tli_depth must be >= 0, got {width}")
    if not width:
        return
    if kind != "moa":
        raise ValueError(f"tli_depth={width} is a MoA option (the TLI blocks' depth); this drafter is {kind!r}")
    if not target.moda:
        raise ValueError(f"tli_depth={width} needs a MoDA target; this one writes no depth entries: set tli_depth=0")
    if not 0 < n_tli < target.n_layers:
        raise ValueError(
            f"tli_depth={width} needs 1 <= TLI N < {target.n_layers} (the target's layers); with N={n_tli} "
            "no depth entry is missing: set tli_depth=0"
        )


class DepthPredictor(nn.Module):
    """hidden and token embedding [B, T, dim] -> the E lower depth entries K (rotated at the positions) and V, each
    [B, T, E, Hkv, D]."""

    def __init__(self, target: ModelConfig, n_tli: int, width: int):
        super().__init__()
        check_tli_depth(target, "moa", n_tli, width)
        self.n_entries = lower_entries(target, n_tli)
        self.n_kv_heads, self.head_dim = target.n_kv_heads, target.head_dim
        # The target's residual stream has no fixed scale (pre-norm keeps it near the embeddings'), so normalise.
        self.norm = RMSNorm(target.dim, target.norm_eps)
        self.emb_norm = RMSNorm(target.dim, target.norm_eps)
        self.up = nn.Linear(2 * target.dim, width)
        self.down = nn.Linear(width, 2 * self.n_entries * self.n_kv_heads * self.head_dim)

    def forward(self, h: Tensor, emb: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """h, emb [B, T, dim]; cos/sin [B or 1, T, 1, D] of the target's RoPE at h's positions."""
        B, T, _ = h.shape
        E, H, D = self.n_entries, self.n_kv_heads, self.head_dim
        z = torch.cat([self.norm(h), self.emb_norm(emb.to(h.dtype))], -1)
        kv = self.down(F.silu(self.up(z))).view(B, T, 2, E * H, D)
        k = apply_rope(kv[:, :, 0], cos, sin).view(B, T, E, H, D)  # every entry at the token's own position
        return k, kv[:, :, 1].reshape(B, T, E, H, D)


def depth_regression(pred: tuple[Tensor, Tensor], true: tuple[Tensor, Tensor]) -> Tensor:
    """Mean squared error of predicted K and V [B, T, E, Hkv, D] against the target's, each relative to the mean
    square of the target's (so 1.0 is what predicting zeros scores), averaged over K and V. RoPE is orthogonal, so
    the error of rotated keys equals that of the pre-rotation ones the predictor computes."""
    parts = [
        (p.float() - t.float()).pow(2).mean() / t.float().pow(2).mean().clamp_min(1e-12)
        for p, t in zip(pred, true, strict=True)
    ]
    return sum(parts) / 2
