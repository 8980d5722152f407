"""Pure-PyTorch references for the MoDA ops (tether.kernels.moda) in fp32, slow and obvious: the tests' oracles.
Never use them for real work.

One MoDA definition: both call tether.shared.attention.moda_attention_reference (what the model's "reference"
backend runs, and what tests/shared/test_model.py holds to the definition spelt out, moda_attention_bruteforce),
and add only the calling conventions of their kernels.

- `moda_attention_naive(q, k, v, depth_k, depth_v, causal=True, scale=None, cu_seqlens=None)`: the reference for
  `moda_attention` (prefill.py), same arguments; returns q's dtype.
- `moda_verify_naive(q, k_cache, v_cache, block_table, cache_lens, q_lens, depth_k, depth_v, tree_mask=None)`: the
  reference for the paged `moda_verify` (verify.py), same arguments and conventions (cache_lens counts the new
  tokens, whose K/V are already in the cache). Each row's cache is gathered through its block table into a
  contiguous [1, cache_len, Hkv, D] prefix and handed, with the row's first q_len queries, to the shared
  reference, one Python step per row. Returns fp32 [B, Kmax, Hq, D]; padded query rows (i >= q_lens[b]) are zero.

    o = moda_verify_naive(q, k_cache, v_cache, block_table, cache_lens, q_lens, depth_k, depth_v, tree_mask=mask)
"""

from __future__ import annotations

import torch
from torch import Tensor

from tether.shared.attention import moda_attention_reference


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
    """MoDA attention, the reference for tether.kernels.moda.moda_attention (same arguments): the shared reference
    in fp32, with what it does not take spelt out here (causal=False as a mask over all Tk keys; a packed batch
    one sequence at a time).

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

    T, Tk = q.shape[1], k.shape[1]
    everything = None if causal else torch.ones(T, Tk, dtype=torch.bool, device=q.device)  # [T, Tk]: no mask at all
    dk, dv = _fp32(depth_k), _fp32(depth_v)
    o = moda_attention_reference(q.float(), k.float(), v.float(), dk, dv, scale=scale, tree_mask=everything)
    return o.to(q.dtype)


def _fp32(t: Tensor | None) -> Tensor | None:
    return None if t is None else t.float()


def gather_paged(cache: Tensor, block_table: Tensor, length: int) -> Tensor:
    """Positions [0, length) of one row from a paged cache [num_blocks, block_size, Hkv, D] and that row's block
    table [max_blocks]: [length, Hkv, D]."""
    block_size = cache.shape[1]
    pos = torch.arange(length, device=cache.device)
    blocks = block_table.to(cache.device).long()[pos // block_size]
    return cache[blocks, pos % block_size]


def moda_verify_naive(
    q: Tensor,  # [B, Kmax, Hq, D]
    k_cache: Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: Tensor,  # [num_blocks, block_size, Hkv, D]
    block_table: Tensor,  # [B, max_blocks] int
    cache_lens: Tensor,  # [B] int, committed prefix + the new tokens
    q_lens: Tensor,  # [B] int
    depth_k: Tensor | None = None,  # [B, Kmax, L, Hkv, D]
    depth_v: Tensor | None = None,  # [B, Kmax, L, Hkv, D]
    *,
    tree_mask: Tensor | None = None,  # [B, Kmax, Kmax] or [Kmax, Kmax] bool; None: causal
    scale: float | None = None,
) -> Tensor:
    """The paged verify's reference (module docstring): fp32 [B, Kmax, Hq, D], zero past each row's q_len."""
    B = q.shape[0]
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lens, qlens = cache_lens.tolist(), q_lens.tolist()
    has_depth = depth_k is not None and depth_k.shape[2] > 0
    for b in range(B):
        n, k = int(lens[b]), int(qlens[b])
        if not 1 <= k <= n:
            raise ValueError(f"row {b}: need 1 <= q_len <= cache_len, got q_len={k}, cache_len={n}")
        keys = gather_paged(k_cache, block_table[b], n)[None].float()  # [1, n, Hkv, D]
        vals = gather_paged(v_cache, block_table[b], n)[None].float()
        mask = None
        if tree_mask is not None:
            mask = (tree_mask if tree_mask.dim() == 2 else tree_mask[b])[:k, :k]
        dk = depth_k[b : b + 1, :k].float() if has_depth else None
        dv = depth_v[b : b + 1, :k].float() if has_depth else None
        out[b, :k] = moda_attention_reference(
            q[b : b + 1, :k].float(), keys, vals, dk, dv, scale=scale, tree_mask=mask
        )[0]
    return out
