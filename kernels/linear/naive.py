"""Pure-PyTorch reference for the skinny linear op (tether.kernels.linear): the same arguments as `linear`, spelt
out in fp32, the test oracle. Returns fp32 (the values the kernel rounds to the input's dtype), with the kernel's
rounding points kept where the contract names them (the Linear's output rounded to x's dtype before a residual add
or SwiGLU's activation, as the unfused PyTorch model rounds them).

    ref = linear_naive(x, w, bias, residual=r)  # [..., N] fp32
    ref = linear_naive(x, w_gate_up, gated=True)  # [..., F] fp32
"""

from __future__ import annotations

import torch
from torch import Tensor


def linear_naive(
    x: Tensor, weight: Tensor, bias: Tensor | None = None, *, residual: Tensor | None = None, gated: bool = False
) -> Tensor:
    """x [..., K], weight [N, K] ([2F, K] gated), bias [N], residual [..., N] -> [..., N] (or [..., F]) fp32."""
    dt = x.dtype
    y = x.float() @ weight.float().T
    if gated:
        g, u = y.chunk(2, dim=-1)
        g, u = g.to(dt).float(), u.to(dt).float()
        return g / (1.0 + torch.exp(-g)) * u
    if bias is not None:
        y = y + bias.float()
    if residual is not None:
        y = y.to(dt).float() + residual.float()
    return y
