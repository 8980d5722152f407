"""Naive reference for the fused RMSNorm op (tether.kernels.norm): the test oracle.

The definition spelt out in PyTorch, the same arguments and dtypes as `rms_norm`: s = x + residual in x's dtype
(when a residual is given), fp32 statistics over the last dim, the normalised row rounded to x's dtype before the
weight multiplies it (tether.shared.model.RMSNorm's order). Pass fp32 tensors to get an fp32 reference.

    h = rms_norm_naive(x, weight, eps)
    h, s = rms_norm_naive(x, weight, eps, residual=r)
"""

from __future__ import annotations

import torch
from torch import Tensor


def rms_norm_naive(
    x: Tensor, weight: Tensor, eps: float, *, residual: Tensor | None = None
) -> Tensor | tuple[Tensor, Tensor]:
    """weight * (xf * rsqrt(mean(xf ** 2, -1) + eps)).to(x.dtype), xf = s.float(), s = x (+ residual)."""
    s = x if residual is None else x + residual
    sf = s.float()
    h = weight * (sf * torch.rsqrt(sf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return h if residual is None else (h, s)
