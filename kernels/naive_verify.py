"""Naive reference for the paged MoDA verify op (tether.kernels.moda_verify): the test oracle.

Each row's cache is gathered through its block table into a contiguous [1, cache_len, Hkv, D] prefix and handed,
with the row's first q_len queries, to tether.shared.attention's reference in fp32. Same arguments and the same
conventions as `moda_verify` (cache_lens counts the new tokens, whose K/V are already in the cache):

    o = moda_verify_naive(q, k_cache, v_cache, block_table, cache_lens, q_lens, depth_k, depth_v, tree_mask=mask)

Returns fp32 [B, Kmax, Hq, D]; padded query rows (i >= q_lens[b]) are zero. One Python step per row: slow on
purpose, never use it for real work.
"""

from __future__ import annotations

import torch
from torch import Tensor

from tether.shared.attention import moda_attention_reference


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
    B, _, Hq, D = q.shape
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
