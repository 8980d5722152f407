"""MoDA attention: the reference implementation and the backend seam.

Mixture-of-Depths Attention puts two kinds of keys under one softmax for each query token t:
- sequence keys: this layer's K/V at the positions t may see (causal, or a tree mask among new tokens);
- depth keys: the K/V that token t itself wrote at earlier layers (same position only).
The reference computes the two score blocks separately, O(T^2 + T*L), concatenates them and takes one
softmax, never a T x (T*L) masked product. With no depth keys it is plain causal GQA attention.

Contract of every backend (`AttentionFn`):
    q        [B, Tq, Hq, D]       queries of the new positions (RoPE applied)
    k, v     [B, Tk, Hkv, D]      sequence keys/values; the last Tq rows are the queries' own positions,
                                  the first Tk - Tq rows are a prefix (a KV cache) every query sees
    depth_k  [B, Tq, L, Hkv, D]   position-major depth keys (L may be 0, or None for no depth)
    depth_v  [B, Tq, L, Hkv, D]
    scale    softmax scale (one for both parts)
    tree_mask [Tq, Tq] or [B, Tq, Tq] bool, True where new query i may see new key j; None means causal.
              A mask whose last dim is Tk ([.., Tq, Tk]) is taken as the whole visibility, prefix included
              (drafter training uses it for block-bounded context).
    returns  [B, Tq, Hq, D]

Backends register by name ("reference", "sdpa"; the server adds "triton" when CUDA is present), so the
model never imports a kernel: `get_backend(name)` is the only door.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

AttentionFn = Callable[..., Tensor]

_BACKENDS: dict[str, AttentionFn] = {}


def register_backend(name: str, fn: AttentionFn) -> None:
    _BACKENDS[name] = fn


def get_backend(name: str) -> AttentionFn:
    try:
        return _BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown attention backend {name!r}; registered: {', '.join(sorted(_BACKENDS))}") from None


def available_backends() -> list[str]:
    return sorted(_BACKENDS)


def new_key_mask(tq: int, tk: int, tree_mask: Tensor | None, device: torch.device) -> Tensor:
    """Boolean visibility [Tq, Tk] (or [B, Tq, Tk] for a batched tree mask): the prefix is always visible,
    unless the mask already spans all Tk keys."""
    if tree_mask is not None and tree_mask.shape[-1] == tk and tree_mask.shape[-2] == tq:
        return tree_mask.to(device=device, dtype=torch.bool)
    prefix = tk - tq
    if prefix < 0:
        raise ValueError(f"fewer keys ({tk}) than queries ({tq})")
    if tree_mask is None:
        local = torch.ones(tq, tq, dtype=torch.bool, device=device).tril()
    else:
        local = tree_mask.to(device=device, dtype=torch.bool)
        if local.shape[-2:] != (tq, tq):
            raise ValueError(f"tree_mask must be [.., {tq}, {tq}], got {tuple(local.shape)}")
    head = torch.ones(*local.shape[:-1], prefix, dtype=torch.bool, device=device)
    return torch.cat([head, local], dim=-1)


def moda_attention_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    depth_k: Tensor | None = None,
    depth_v: Tensor | None = None,
    *,
    scale: float | None = None,
    tree_mask: Tensor | None = None,
) -> Tensor:
    """Pure-PyTorch MoDA attention (see module docstring for shapes). Softmax in fp32."""
    B, Tq, Hq, D = q.shape
    Tk, Hkv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    scale = D**-0.5 if scale is None else scale
    qg = q.reshape(B, Tq, Hkv, G, D)
    # Sequence scores with GQA folded: the G query heads of a KV head share its keys without a repeat.
    s_seq = torch.einsum("bqhgd,bkhd->bhgqk", qg, k) * scale  # [B, Hkv, G, Tq, Tk]
    visible = new_key_mask(Tq, Tk, tree_mask, q.device)
    visible = visible[:, None, None] if visible.dim() == 3 else visible
    s_seq = s_seq.float().masked_fill(~visible, float("-inf"))
    has_depth = depth_k is not None and depth_k.shape[2] > 0
    if has_depth:
        s_depth = torch.einsum("bqhgd,bqlhd->bhgql", qg, depth_k).float() * scale  # [B, Hkv, G, Tq, L]
        p = torch.cat([s_seq, s_depth], dim=-1).softmax(dim=-1)
        p_seq, p_depth = p[..., :Tk].to(v.dtype), p[..., Tk:].to(v.dtype)
    else:
        p_seq = s_seq.softmax(dim=-1).to(v.dtype)
    o = torch.einsum("bhgqk,bkhd->bqhgd", p_seq, v)  # [B, Tq, Hkv, G, D]
    if has_depth:
        o = o + torch.einsum("bhgql,bqlhd->bqhgd", p_depth, depth_v)
    return o.reshape(B, Tq, Hq, D)


def attention_sdpa(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    depth_k: Tensor | None = None,
    depth_v: Tensor | None = None,
    *,
    scale: float | None = None,
    tree_mask: Tensor | None = None,
) -> Tensor:
    """torch SDPA for the no-depth case (plain models, MoDA layer 0); defers to the reference otherwise."""
    if depth_k is not None and depth_k.shape[2] > 0:
        return moda_attention_reference(q, k, v, depth_k, depth_v, scale=scale, tree_mask=tree_mask)
    Tq, Tk = q.shape[1], k.shape[1]
    gqa = q.shape[2] != k.shape[2]  # SDPA shares each KV head with its query group itself: no repeated K/V copy
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if tree_mask is None and Tq == Tk:
        o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        mask = new_key_mask(Tq, Tk, tree_mask, q.device)
        mask = mask[:, None] if mask.dim() == 3 else mask
        o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return o.transpose(1, 2)


def moda_attention_bruteforce(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    depth_k: Tensor | None,
    depth_v: Tensor | None,
    *,
    scale: float | None = None,
    tree_mask: Tensor | None = None,
) -> Tensor:
    """The definition, spelt out: every query against the explicit union of all sequence and depth keys
    under one masked softmax, O(T x (T + T*L)). Test oracle only; never use it for real work."""
    B, Tq, Hq, D = q.shape
    Tk, Hkv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    scale = D**-0.5 if scale is None else scale
    L = 0 if depth_k is None else depth_k.shape[2]
    keys = torch.cat([k, depth_k.reshape(B, Tq * L, Hkv, D)], dim=1) if L else k  # [B, Tk + Tq*L, Hkv, D]
    vals = torch.cat([v, depth_v.reshape(B, Tq * L, Hkv, D)], dim=1) if L else v
    seq_vis = new_key_mask(Tq, Tk, tree_mask, q.device)
    seq_vis = seq_vis if seq_vis.dim() == 3 else seq_vis.expand(B, Tq, Tk)
    depth_owner = torch.arange(Tq * L, device=q.device) // max(L, 1)  # depth row r belongs to query r // L
    depth_vis = (depth_owner[None, :] == torch.arange(Tq, device=q.device)[:, None]).expand(B, Tq, Tq * L)
    vis = torch.cat([seq_vis, depth_vis], dim=-1)  # [B, Tq, Tk + Tq*L]
    kr = keys.repeat_interleave(G, dim=2).float()
    vr = vals.repeat_interleave(G, dim=2).float()
    s = torch.einsum("bqhd,bkhd->bhqk", q.float(), kr) * scale
    s = s.masked_fill(~vis[:, None], float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), vr).to(q.dtype)


register_backend("reference", moda_attention_reference)
register_backend("sdpa", attention_sdpa)
