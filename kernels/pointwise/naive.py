"""Pure-PyTorch references for the fused pointwise ops (tether.kernels.pointwise): spelt-out definitions in fp32, the
test oracle. Same arguments as `rope` and `silu_mul`; both return fp32 (the exact values the kernels round once to
the input's dtype):

    ref = rope_naive(x, cos, sin)  # [B, T, H, D] fp32
    ref = silu_mul_naive(x)  # [..., F] fp32
"""

from __future__ import annotations

import torch
from torch import Tensor


def rope_naive(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate-half RoPE: x [B, T, H, D], cos, sin [B or 1, T, 1, D] -> x * cos + cat(-x2, x1) * sin in fp32, where
    x1, x2 are the halves of x's last dim (shared.model.apply_rope before its cast back)."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return xf * cos.float() + rotated * sin.float()


def silu_mul_naive(x: Tensor) -> Tensor:
    """SwiGLU's activation: x [..., 2F] -> silu(g) * u [..., F] in fp32, g, u = the halves of the last dim and
    silu(g) = g / (1 + exp(-g))."""
    g, u = x.float().chunk(2, dim=-1)
    return g / (1.0 + torch.exp(-g)) * u
