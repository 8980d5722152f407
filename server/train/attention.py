"""MoDA attention for training at long sequences: the "flex" backend, which never holds a T x T score matrix.

The reference backend (tether.shared.attention) materialises the sequence scores [B, Hq, T, T] in fp32 and keeps
several such tensors per layer for backward: ~11 GB a layer at B=64, T=1024, 12 heads. This backend splits the
one MoDA softmax into its two key sets and merges them exactly through their log-sum-exps:
- sequence part: causal attention over the layer's own keys, with its log-sum-exp `lse_s` [B, Hq, T], from a
  fused kernel (torch's flex_attention, compiled) that keeps O(T) per row for backward, not O(T^2);
- depth part: the token's own depth keys, scores [B, Hq, T, L] (L <= 2 x layers, small), in plain PyTorch;
- merge: with lse = logaddexp(lse_s, lse_d), out = exp(lse_s - lse) * o_s + softmax-weights_d @ depth_v,
  the weights exp(s_d - lse). Gradients reach q and k through lse_s too (flex_attention differentiates its lse).
Without depth keys (a plain model, MoDA's block 0) it is torch SDPA (flash attention on a GPU).

Contract: the AttentionFn of tether.shared.attention, for causal self-attention over new tokens (Tq == Tk,
no tree mask); any other call (a KV-cache prefix, a tree mask) defers to the reference. On the CPU
flex_attention has no backward (and uncompiled it materialises the scores anyway), so there the sequence part is
the same computation spelt out in PyTorch (`causal_attention_lse`); the flex kernel is checked against it forward
on the CPU and, with gradients, on CUDA (tests/server/train/test_train_attention.py).

    import tether.server.train.attention  # registers "flex"
    model.backend = "flex"                # then train as usual
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from tether.shared.attention import attention_sdpa, moda_attention_reference, register_backend

BACKEND = "flex"


def causal_attention_lse(q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """Causal GQA attention and its log-sum-exp, in plain PyTorch (materialises the scores: CPU and tests only).
    q [B, Hq, T, D], k/v [B, Hkv, T, D] -> out [B, Hq, T, D], lse [B, Hq, T] (fp32, natural log)."""
    G = q.shape[1] // k.shape[1]
    s = torch.einsum("bhqd,bhkd->bhqk", q.float(), k.repeat_interleave(G, 1).float()) * scale
    T = q.shape[2]
    s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool, device=q.device).tril(), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None]).to(v.dtype)
    return torch.einsum("bhqk,bhkd->bhqd", p, v.repeat_interleave(G, 1)), lse


@functools.cache
def _causal_block_mask(T: int, device: str):
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask(lambda b, h, q, k: q >= k, None, None, T, T, device=device)


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    # Uncompiled, flex_attention is an unfused reference that materialises the scores.
    return torch.compile(flex_attention, dynamic=False)


def flex_attention_lse(q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """Causal GQA attention and its log-sum-exp from torch's flex_attention (shapes as causal_attention_lse).
    Compiled on an accelerator; eager on the CPU, where it has no backward (tests compare its forward)."""
    from torch.nn.attention import flex_attention as fa

    flex = fa.flex_attention if q.device.type == "cpu" else _compiled_flex()
    mask = _causal_block_mask(q.shape[2], str(q.device))
    kw = dict(block_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    if hasattr(fa, "AuxRequest"):  # torch >= 2.9; return_lse is deprecated there
        out, aux = flex(q, k, v, return_aux=fa.AuxRequest(lse=True), **kw)
        return out, aux.lse
    return flex(q, k, v, return_lse=True, **kw)


def merge_depth(
    o_s: Tensor,  # [B, Hq, T, D] the sequence part's output
    lse_s: Tensor,  # [B, Hq, T] its log-sum-exp (fp32)
    q: Tensor,  # [B, T, Hq, D]
    depth_k: Tensor,  # [B, T, L, Hkv, D]
    depth_v: Tensor,  # [B, T, L, Hkv, D]
    scale: float,
) -> Tensor:
    """One softmax over sequence and depth keys, from the sequence part's (output, lse): -> [B, T, Hq, D]."""
    B, T, Hq, D = q.shape
    Hkv = depth_k.shape[3]
    G = Hq // Hkv
    qg = q.reshape(B, T, Hkv, G, D)
    s_d = torch.einsum("bqhgd,bqlhd->bhgql", qg, depth_k).float() * scale  # [B, Hkv, G, T, L]
    lse_s = lse_s.view(B, Hkv, G, T)
    lse = torch.logaddexp(lse_s, torch.logsumexp(s_d, dim=-1))  # [B, Hkv, G, T]
    w_seq = torch.exp(lse_s - lse).permute(0, 3, 1, 2)[..., None]  # [B, T, Hkv, G, 1]
    p_d = torch.exp(s_d - lse[..., None]).to(depth_v.dtype)
    o = o_s.transpose(1, 2).reshape(B, T, Hkv, G, D) * w_seq.to(o_s.dtype)
    o = o + torch.einsum("bhgql,bqlhd->bqhgd", p_d, depth_v)
    return o.reshape(B, T, Hq, D)


def moda_attention_flex(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    depth_k: Tensor | None = None,
    depth_v: Tensor | None = None,
    *,
    scale: float | None = None,
    tree_mask: Tensor | None = None,
) -> Tensor:
    """The "flex" backend (see the module docstring): q [B, T, Hq, D], k/v [B, T, Hkv, D] -> [B, T, Hq, D]."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if tree_mask is not None or q.shape[1] != k.shape[1]:
        return moda_attention_reference(q, k, v, depth_k, depth_v, scale=scale, tree_mask=tree_mask)
    if depth_k is None or depth_k.shape[2] == 0:
        return attention_sdpa(q, k, v, scale=scale)
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    seq = causal_attention_lse if q.device.type == "cpu" else flex_attention_lse
    o_s, lse_s = seq(qt, kt, vt, scale)
    return merge_depth(o_s, lse_s, q, depth_k, depth_v, scale)


register_backend(BACKEND, moda_attention_flex)
