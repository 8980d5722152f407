"""Pure-PyTorch references for the kernels in this package: spelt-out definitions in fp32, slow and obvious."""

from __future__ import annotations

import torch
from torch import Tensor


def moda_attention_naive(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    depth_k: Tensor | None = None,
    depth_v: Tensor | None = None,
    *,
    causal: bool = True,
    scale: float | None = None,
    cu_seqlens: Tensor | None = None,
) -> Tensor:
    """MoDA attention, the reference for tether.kernels.moda.moda_attention (same arguments).

    q [B, T, Hq, D]; k, v [B, Tk, Hkv, D] (Tk >= T: the first Tk - T rows are a prefix every query sees);
    depth_k, depth_v [B, T, L, Hkv, D] or None. Query t of a sequence takes one softmax over the sequence keys
    j <= t + Tk - T (all of them if not causal) and its own L depth keys. With cu_seqlens (int32 [N + 1]) the
    batch is packed (B == 1, Tk == T) and each sequence attends only within itself.
    Returns [B, T, Hq, D] in q's dtype; everything is computed in fp32.
    """
    if cu_seqlens is not None:
        if q.shape[0] != 1 or k.shape[1] != q.shape[1]:
            raise ValueError("with cu_seqlens the inputs are packed: B == 1 and Tk == T")
        out = torch.empty_like(q)
        bounds = cu_seqlens.tolist()
        for bos, eos in zip(bounds[:-1], bounds[1:], strict=True):
            part = slice(bos, eos)
            dk = None if depth_k is None else depth_k[:, part]
            dv = None if depth_v is None else depth_v[:, part]
            out[:, part] = moda_attention_naive(q[:, part], k[:, part], v[:, part], dk, dv, causal=causal, scale=scale)
        return out

    B, T, Hq, D = q.shape
    Tk, Hkv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    scale = D**-0.5 if scale is None else scale
    qf = q.float().transpose(1, 2)  # [B, Hq, T, D]
    kf = k.float().repeat_interleave(G, dim=2).transpose(1, 2)  # [B, Hq, Tk, D]
    vf = v.float().repeat_interleave(G, dim=2).transpose(1, 2)
    s = qf @ kf.transpose(-1, -2) * scale  # [B, Hq, T, Tk]
    if causal:
        visible = torch.ones(T, Tk, dtype=torch.bool, device=q.device).tril(Tk - T)
        s = s.masked_fill(~visible, float("-inf"))
    L = 0 if depth_k is None else depth_k.shape[2]
    if L == 0:
        return (s.softmax(-1) @ vf).transpose(1, 2).to(q.dtype)
    dkf = depth_k.float().repeat_interleave(G, dim=3).permute(0, 3, 1, 2, 4)  # [B, Hq, T, L, D]
    dvf = depth_v.float().repeat_interleave(G, dim=3).permute(0, 3, 1, 2, 4)
    s_depth = torch.einsum("bhtd,bhtld->bhtl", qf, dkf) * scale  # [B, Hq, T, L]: own position only
    p = torch.cat([s, s_depth], dim=-1).softmax(-1)
    o = p[..., :Tk] @ vf + torch.einsum("bhtl,bhtld->bhtd", p[..., Tk:], dvf)  # [B, Hq, T, D]
    return o.transpose(1, 2).to(q.dtype)
