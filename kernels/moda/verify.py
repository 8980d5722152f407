"""MoDA verify/decode attention over the paged KV pool (Triton), flash-decoding style (split-K over the cache).

One softmax per query over (tether.shared.attention has the definition):
- the row's committed prefix: cache positions [0, cache_lens[b] - q_lens[b]), read in place through the block table;
- the row's new tokens: cache positions [cache_lens[b] - q_lens[b], cache_lens[b]), causal among themselves, or as
  `tree_mask` says;
- the query's own depth keys depth_k[b, i] (same position only, L of them; L may be 0).

Conventions:
- `cache_lens` counts the new tokens too: their K/V are ALREADY in the cache, scattered into their slots before
  attention (what server/kv_pool.py's SlotView and PagedCache.write do), so the table covers positions
  [0, cache_lens[b]). `KVPool.block_tables(seqs)` gives committed lengths; pass `lens + q_lens` while the round's
  rows are pending.
- Row b uses its first q_lens[b] queries (1 <= q_lens[b] <= min(Kmax, cache_lens[b])). Padded query rows
  (i >= q_lens[b]) are never read and their output rows are left untouched (whatever `out` held: pass your own
  `out=` to choose). Lengths are not checked on the device (that would cost a sync); out-of-range values are
  undefined behaviour.
- A query that sees no key at all (an all-False tree row, no prefix, L = 0) gets zeros, not NaN.

Split-K design (flash-decoding): grid (m tiles, B * Hkv, num_splits). With num_splits == S > 1, split 0 takes the
row's new-token block (<= Kmax keys, masked) and its depth keys, and splits 1..S-1 each take a chunk of the committed
prefix; every program runs one online softmax and writes
an fp32 partial (acc / l and lse = m + log2 l, base 2), and `moda_verify_combine_kernel` merges the partials per (row,
query, head) with a log-sum-exp weighting. The new tokens and depth get their own program, the first launched,
because that serial work at the end of a prefix chunk made every chunk's program wait for the slowest one (measured:
a 20-100 us tail with L = 32). With num_splits == 1 one program does everything and writes the normalised output
directly (no partials, no second launch).

Batch invariance (the default, `num_splits=None`; issue #44): a row's output does not depend on the other rows of
the batch, their number, their lengths or the padding, so a session's verdicts do not change with the load. Every
decision that shapes a row's arithmetic is the row's own: its prefix is cut from position 0 into chunks of
max(min_chunk_keys, prefix / max_chunks) keys (verify_config: 256 and 32, so a lone row still spreads over the SMs as
the earlier batch-wide heuristic did), always split (S = 1 + the most chunks the table's width allows; a row's unused
split slots are empty and weigh exactly 0), query tiles of a fixed 64 rows (a dot's instruction shape follows the
tile), and the combine adds the partials 64 at a time in split order. An explicit `num_splits` (tuning, benchmarks)
instead cuts each row's prefix into S - 1 equal chunks and sizes the query tile by the batch's Kmax, as the first
versions did.

Depth keys are chunk-aware, as in the prefill kernel: a tile's queries own a contiguous run of depth rows of the
position-major [Kmax * L] layout, scored with tensor-core dots and masked to each row's own L (a per-layer loop of
row dot products was latency-bound).

GQA is group-aware: a program owns one (row, KV head) and a tile of BLOCK_M = up to 64 query rows r = i * G + g
(new token i, head g of the group), so each K/V tile of the cache is loaded once for all G heads and all k tokens
(G * k <= 64 in one tile: k = 8 drafts with G = 8; larger products take more m tiles).

fp16 / bf16 / fp32 inputs, fp32 softmax and accumulation (q is cast to the cache's dtype for the dots; an fp32 cache
gets exact fp32 dots, no TF32); head dims up to 256 (non powers of two are masked).

    o = moda_verify(q, pool.k[layer], pool.v[layer], table, lens + q_lens, q_lens, depth_k, depth_v,
                    tree_mask=mask)  # [B, Kmax, Hq, D]

Reference: naive.py's `moda_verify_naive`. Tests (CPU, through Triton's interpreter):

    TRITON_INTERPRET=1 .venv/bin/python -m pytest -q tests/kernels/test_moda_verify.py
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from tether.kernels.utils import LOG2E, cdiv, dot_precision, last_dim_contiguous, online_softmax_step, pow2

INVARIANT_TILE_M = 64  # query rows per program under the batch-invariant rule, whatever the batch's Kmax


@triton.jit
def _attend_tile(
    q_tile,  # [BLOCK_M, BLOCK_D]
    k_rows,  # [BLOCK_N] pointers to the first element of each key row
    v_rows,  # [BLOCK_N] pointers to the first element of each value row
    kv_ok,  # [BLOCK_N] rows to load
    vis,  # [BLOCK_M, BLOCK_N] visibility
    offs_d,
    d_ok,
    m_i,
    l_i,
    acc,
    qk_scale,
    PREC: tl.constexpr,
):
    """One online-softmax step over BLOCK_N key rows given by their addresses (paged cache rows, or depth rows): load
    them in the query's dtype, score, mask by `vis`, fold into the state (utils.online_softmax_step)."""
    dtype = q_tile.dtype
    nd_ok = kv_ok[:, None] & d_ok[None, :]
    kt = tl.load(k_rows[:, None] + offs_d[None, :], mask=nd_ok, other=0.0).to(dtype)
    vt = tl.load(v_rows[:, None] + offs_d[None, :], mask=nd_ok, other=0.0).to(dtype)
    s = tl.dot(q_tile, tl.trans(kt), input_precision=PREC) * qk_scale  # [BLOCK_M, BLOCK_N], base 2
    s = tl.where(vis, s, float("-inf"))
    return online_softmax_step(s, vt, m_i, l_i, acc, PREC)


@triton.jit
def _paged_rows(k_head, v_head, bt_row, pos, kv_ok, stride_kn, stride_ks, stride_vn, stride_vs, BS: tl.constexpr):
    """Addresses of cache positions `pos` [BLOCK_N]: position p lives in block bt_row[p // BS] at offset p % BS."""
    blk = tl.load(bt_row + pos // BS, mask=kv_ok, other=0).to(tl.int64)
    off = pos % BS
    return k_head + blk * stride_kn + off * stride_ks, v_head + blk * stride_vn + off * stride_vs


# Arguments that change with a round's shape (Kmax, the split count, the table's width, the tree mask's strides) are
# not specialised on: Triton would compile a new variant whenever one became 1 or a multiple of 16, and a compile
# inside a client's round is an outage (a server warms its kernels up before it listens: server.batcher.warm_up).
# Batch strides stay specialised: they are Kmax x Hq x D and the like, multiples of 16 for real head sizes, and
# without that the compiler cannot vectorise the q, depth and output rows (measured: 4K-16K verifies 1.3-1.8x
# slower on the H200). L, the depth keys per query, is fixed per layer: warm-up's forwards see every value.
@triton.jit(do_not_specialize=["stride_bt", "stride_mb", "stride_mi", "Kmax", "S", "CHUNKS", "MIN_KEYS"])
def moda_verify_fwd_kernel(
    q,  # [B, Kmax, Hq, D]
    k_cache,  # [num_blocks, block_size, Hkv, D]
    v_cache,  # [num_blocks, block_size, Hkv, D]
    block_table,  # [B, max_blocks] int32
    cache_lens,  # [B] int32: prefix + new tokens
    q_lens,  # [B] int32
    depth_k,  # [B, Kmax, L, Hkv, D]
    depth_v,  # [B, Kmax, L, Hkv, D]
    tree_mask,  # [B, Kmax, Kmax] uint8 (batch stride 0 for a shared mask)
    o,  # [B, Kmax, Hq, D]                 (num_splits == 1)
    o_part,  # [B, Kmax, Hq, S, D] fp32    (num_splits > 1)
    lse_part,  # [B, Kmax, Hq, S] fp32, base 2
    qk_scale,  # softmax scale * log2(e)
    stride_qb,
    stride_qt,
    stride_qh,
    stride_kn,
    stride_ks,
    stride_kh,
    stride_vn,
    stride_vs,
    stride_vh,
    stride_bt,
    stride_dkb,
    stride_dkt,
    stride_dkl,
    stride_dkh,
    stride_dvb,
    stride_dvt,
    stride_dvl,
    stride_dvh,
    stride_mb,
    stride_mi,
    stride_ob,
    stride_ot,
    stride_oh,
    Kmax,
    L,
    S,
    CHUNKS,  # a row's prefix is cut into at most CHUNKS chunks (<= S - 1) ...
    MIN_KEYS,  # ... of at least MIN_KEYS keys (a multiple of BLOCK_N; 0 with CHUNKS = S - 1: S - 1 equal chunks)
    HKV: tl.constexpr,
    G: tl.constexpr,
    D: tl.constexpr,
    BS: tl.constexpr,  # cache block size (positions per block)
    TREE: tl.constexpr,
    SPLIT: tl.constexpr,
    PREC: tl.constexpr,  # dot input precision: "ieee" for an fp32 cache (no TF32), else "tf32" (unused for 16 bit)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid_m, pid_bh, pid_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, hkv = pid_bh // HKV, pid_bh % HKV
    q_len = tl.load(q_lens + b)
    prefix = tl.load(cache_lens + b) - q_len
    if pid_m * BLOCK_M < q_len * G:
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # r = i * G + g
        qi, head = rows // G, hkv * G + rows % G  # [BLOCK_M] new-token index, query head
        row_ok = qi < q_len
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < D
        rd_ok = row_ok[:, None] & d_ok[None, :]
        b64 = b.to(tl.int64)
        q_ptrs = q + b64 * stride_qb + qi[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
        q_tile = tl.load(q_ptrs, mask=rd_ok, other=0.0).to(k_cache.dtype.element_ty)  # [BLOCK_M, BLOCK_D]
        k_head, v_head = k_cache + hkv * stride_kh, v_cache + hkv * stride_vh
        bt_row = block_table + b64 * stride_bt

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

        # 1. The committed prefix: all of it with one split, else chunk pid_s - 1 of S - 1 (split 0 takes the
        # new tokens and the depth keys instead: it is launched first, so that serial work never trails a wave).
        if SPLIT:
            chunk = tl.maximum(MIN_KEYS, tl.cdiv(tl.cdiv(prefix, CHUNKS), BLOCK_N) * BLOCK_N)
            start = tl.maximum(pid_s - 1, 0) * chunk
            end = tl.where(pid_s == 0, 0, tl.minimum(start + chunk, prefix))
        else:
            start = 0
            end = prefix
        # The block ids of the next tile are loaded one step ahead: the K/V addresses depend on them, and a table
        # load in the same step put a dependent memory round trip in front of every tile's K/V loads (measured on
        # the H200: 15-30% of the kernel's time at 16K-128K with 64-key tiles).
        pos = start + tl.arange(0, BLOCK_N)
        blk = tl.load(bt_row + pos // BS, mask=pos < end, other=0)
        for n0 in range(start, end, BLOCK_N):
            pos = n0 + tl.arange(0, BLOCK_N)
            kv_ok = pos < end
            blk_next = tl.load(bt_row + (pos + BLOCK_N) // BS, mask=pos + BLOCK_N < end, other=0)
            off = (pos % BS).to(tl.int64)
            k_rows = k_head + blk.to(tl.int64) * stride_kn + off * stride_ks
            v_rows = v_head + blk.to(tl.int64) * stride_vn + off * stride_vs
            m_i, l_i, acc = _attend_tile(
                q_tile, k_rows, v_rows, kv_ok, kv_ok[None, :], offs_d, d_ok, m_i, l_i, acc, qk_scale, PREC
            )
            blk = blk_next

        if pid_s == 0:
            # 2. The new tokens (cache positions [prefix, prefix + q_len)): causal, or the tree mask.
            for j0 in range(0, q_len, BLOCK_N):
                j = j0 + tl.arange(0, BLOCK_N)
                kv_ok = j < q_len
                vis = row_ok[:, None] & kv_ok[None, :]
                if TREE:
                    m_ptrs = tree_mask + b64 * stride_mb + qi[:, None] * stride_mi + j[None, :]
                    vis = vis & (tl.load(m_ptrs, mask=vis, other=0) != 0)
                else:
                    vis = vis & (j[None, :] <= qi[:, None])
                k_rows, v_rows = _paged_rows(
                    k_head, v_head, bt_row, prefix + j, kv_ok, stride_kn, stride_ks, stride_vn, stride_vs, BS
                )
                m_i, l_i, acc = _attend_tile(
                    q_tile, k_rows, v_rows, kv_ok, vis, offs_d, d_ok, m_i, l_i, acc, qk_scale, PREC
                )

            # 3. Depth keys, chunk-aware: the tile's queries own the contiguous depth rows [q_lo * L, q_hi * L) of
            # the position-major [Kmax * L] layout; score them with tensor-core dots, each row masked to its own L.
            q_lo = (pid_m * BLOCK_M) // G
            q_hi = tl.minimum(((pid_m + 1) * BLOCK_M - 1) // G + 1, q_len)
            dk_base = depth_k + b64 * stride_dkb + hkv * stride_dkh
            dv_base = depth_v + b64 * stride_dvb + hkv * stride_dvh
            for j0 in range(q_lo * L, q_hi * L, BLOCK_N):
                j = j0 + tl.arange(0, BLOCK_N)
                kv_ok = j < q_hi * L
                owner, layer = j // L, j % L
                vis = row_ok[:, None] & (qi[:, None] == owner[None, :])
                k_rows = dk_base + owner * stride_dkt + layer * stride_dkl
                v_rows = dv_base + owner * stride_dvt + layer * stride_dvl
                m_i, l_i, acc = _attend_tile(
                    q_tile, k_rows, v_rows, kv_ok, vis, offs_d, d_ok, m_i, l_i, acc, qk_scale, PREC
                )

        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        out = acc / l_safe[:, None]
        if SPLIT:
            row_off = b64 * Kmax * HKV * G + qi * (HKV * G) + head  # [B, Kmax, Hq] flat index
            lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
            tl.store(lse_part + row_off * S + pid_s, lse, mask=row_ok)
            tl.store(o_part + (row_off * S + pid_s)[:, None] * D + offs_d[None, :], out, mask=rd_ok)
        else:
            o_ptrs = o + b64 * stride_ob + qi[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
            tl.store(o_ptrs, out.to(o.dtype.element_ty), mask=rd_ok)


@triton.jit(do_not_specialize=["Kmax", "S"])
def moda_verify_combine_kernel(
    o_part,  # [B, Kmax, Hq, S, D] fp32
    lse_part,  # [B, Kmax, Hq, S] fp32, base 2
    o,  # [B, Kmax, Hq, D]
    q_lens,  # [B] int32
    stride_ob,
    stride_ot,
    stride_oh,
    Kmax,
    S,
    HQ: tl.constexpr,
    D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid_bt, h = tl.program_id(0), tl.program_id(1)
    b, i = pid_bt // Kmax, pid_bt % Kmax
    row = pid_bt.to(tl.int64) * HQ + h  # flat [B, Kmax, Hq] index
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    # The row's length is loaded beside the partials, not before them (one memory round trip less): a padded row's
    # partials were never written, so its result is garbage, and its store is masked off.
    q_len = tl.load(q_lens + b)
    # BLOCK_S partials at a time, in split order: past a row's own chunks every partial weighs exactly 0, so the
    # sums do not depend on S (batch invariance).
    m = tl.max(tl.load(lse_part + row * S + offs_s, mask=offs_s < S, other=float("-inf")), 0)
    for s0 in range(BLOCK_S, S, BLOCK_S):
        m = tl.maximum(
            m, tl.max(tl.load(lse_part + row * S + s0 + offs_s, mask=s0 + offs_s < S, other=float("-inf")), 0)
        )
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    num = tl.zeros([BLOCK_D], dtype=tl.float32)
    den = tl.zeros([BLOCK_S], dtype=tl.float32)
    for s0 in range(0, S, BLOCK_S):
        s_ok = s0 + offs_s < S
        lse = tl.load(lse_part + row * S + s0 + offs_s, mask=s_ok, other=float("-inf"))  # [BLOCK_S]
        parts = tl.load(
            o_part + (row * S + s0 + offs_s)[:, None] * D + offs_d[None, :],
            mask=s_ok[:, None] & (offs_d < D)[None, :],
            other=0.0,
        )  # [BLOCK_S, BLOCK_D]
        w = tl.exp2(lse - m_safe)  # empty splits weigh 0
        num += tl.sum(w[:, None] * parts, 0)
        den += w
    out = num / tl.maximum(tl.sum(den, 0), 1e-30)
    b64 = b.to(tl.int64)
    tl.store(
        o + b64 * stride_ob + i * stride_ot + h * stride_oh + offs_d,
        out.to(o.dtype.element_ty),
        mask=(offs_d < D) & (offs_d * 0 + i < q_len),
    )


def verify_config(device: torch.device) -> dict:
    """Tile and launch settings of the verify kernel on this device: BLOCK_N (keys per step), num_warps,
    num_stages, combine_warps, and the batch-invariant split's min_chunk_keys (a multiple of BLOCK_N) and
    max_chunks. The best of sweeps on the H200 (BENCHMARKS.md: BLOCK_N 32-128, 4-8 warps, 2-4 stages, 8-65 splits,
    k = 1 to 32, 4K-128K): 64-key tiles in 3 stages keep two programs per SM for every query tile (<= 64 rows), and
    a lone long row did best in about 33 splits of >= 256 keys (one wave of two programs per SM at 8 KV heads); also
    a sound default elsewhere."""
    return {"BLOCK_N": 64, "num_warps": 4, "num_stages": 3, "combine_warps": 1, "min_chunk_keys": 256, "max_chunks": 32}


def _tile_m(G: int, kmax: int) -> int:
    return max(16, min(64, pow2(G * kmax)))


def moda_verify_fwd(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_table: Tensor,
    cache_lens: Tensor,
    q_lens: Tensor,
    depth_k: Tensor | None,
    depth_v: Tensor | None,
    tree_mask: Tensor | None,
    scale: float,
    num_splits: int,
    out: Tensor,
    config: dict,
    chunks: tuple[int, int] | None = None,
) -> Tensor:
    """Launch the kernels (no checks: `moda_verify` does them); config: see `verify_config`; `chunks`: (most
    chunks, least keys a chunk) of each row's prefix; None: S - 1 equal chunks."""
    B, kmax, Hq, D = q.shape
    _, bs, Hkv, _ = k_cache.shape
    G = Hq // Hkv
    L = 0 if depth_k is None else depth_k.shape[2]
    if L == 0:
        depth_k = depth_v = q.new_empty(1, 1, 1, 1, 1)
    if tree_mask is None:
        mask, stride_mb, stride_mi = q_lens, 0, 0  # never read
    else:
        mask = tree_mask.view(torch.uint8) if tree_mask.dtype == torch.bool else tree_mask.to(torch.uint8)
        if mask.stride(-1) != 1:
            mask = mask.contiguous()
        stride_mb, stride_mi = (0, mask.stride(0)) if mask.dim() == 2 else (mask.stride(0), mask.stride(1))
    block_m, block_n = config.get("BLOCK_M") or _tile_m(G, kmax), config["BLOCK_N"]
    block_d = max(16, pow2(D))
    prec = dot_precision(k_cache.dtype)  # an fp32 cache gets exact fp32 dots
    split = num_splits > 1
    if split:
        o_part = torch.empty(B, kmax, Hq, num_splits, D, dtype=torch.float32, device=q.device)
        lse_part = torch.empty(B, kmax, Hq, num_splits, dtype=torch.float32, device=q.device)
    else:
        o_part = lse_part = out  # never read
    grid = (cdiv(G * kmax, block_m), B * Hkv, num_splits)
    moda_verify_fwd_kernel[grid](
        q,
        k_cache,
        v_cache,
        block_table,
        cache_lens,
        q_lens,
        depth_k,
        depth_v,
        mask,
        out,
        o_part,
        lse_part,
        scale * LOG2E,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_table.stride(0),
        depth_k.stride(0),
        depth_k.stride(1),
        depth_k.stride(2),
        depth_k.stride(3),
        depth_v.stride(0),
        depth_v.stride(1),
        depth_v.stride(2),
        depth_v.stride(3),
        stride_mb,
        stride_mi,
        out.stride(0),
        out.stride(1),
        out.stride(2),
        kmax,
        L,
        num_splits,
        *(chunks or (max(num_splits - 1, 1), 0)),
        HKV=Hkv,
        G=G,
        D=D,
        BS=bs,
        TREE=tree_mask is not None,
        SPLIT=split,
        PREC=prec,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        num_warps=config["num_warps"],
        num_stages=config["num_stages"],
    )
    if split:
        # One combine variant for any split count (64 partials a pass): a power of two per split count meant a
        # compile each time a growing context crossed one.
        moda_verify_combine_kernel[(B * kmax, Hq)](
            o_part,
            lse_part,
            out,
            q_lens,
            out.stride(0),
            out.stride(1),
            out.stride(2),
            kmax,
            num_splits,
            HQ=Hq,
            D=D,
            BLOCK_S=64,
            BLOCK_D=block_d,
            num_warps=config.get("combine_warps", 1),
        )
    return out


def moda_verify(
    q: Tensor,  # [B, Kmax, Hq, D]
    k_cache: Tensor,  # [num_blocks, block_size, Hkv, D]: one layer of the pool
    v_cache: Tensor,  # [num_blocks, block_size, Hkv, D]
    block_table: Tensor,  # [B, max_blocks] int32 (-1 past each row's blocks)
    cache_lens: Tensor,  # [B] int32: committed prefix + new tokens (the new tokens' K/V are already in the cache)
    q_lens: Tensor,  # [B] int32: new tokens per row, 1 <= q_lens[b] <= min(Kmax, cache_lens[b])
    depth_k: Tensor | None = None,  # [B, Kmax, L, Hkv, D] each query's own depth keys (L may be 0; None: none)
    depth_v: Tensor | None = None,  # [B, Kmax, L, Hkv, D]
    *,
    tree_mask: Tensor | None = None,  # [B, Kmax, Kmax] or [Kmax, Kmax] bool, True: new query i sees new key j
    scale: float | None = None,  # default D ** -0.5, for both parts
    num_splits: int | None = None,  # split slots (tuning); None: batch-invariant fixed chunks (module docstring)
    out: Tensor | None = None,  # [B, Kmax, Hq, D] q.dtype; padded rows are left untouched
    config: dict | None = None,  # verify_config's keys (and an optional BLOCK_M): bypass it, for tuning
) -> Tensor:
    """MoDA attention of each row's new tokens over its paged cache and depth keys; returns [B, Kmax, Hq, D] in
    q's dtype. See the module docstring for the conventions and the split-K design."""
    B, kmax, Hq, D = q.shape
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape or k_cache.shape[-1] != D:
        raise ValueError(
            f"k/v cache must be [num_blocks, block_size, Hkv, {D}], got {tuple(k_cache.shape)}, {tuple(v_cache.shape)}"
        )
    Hkv = k_cache.shape[2]
    if Hq % Hkv:
        raise ValueError(f"{Hq} query heads are not a multiple of {Hkv} KV heads")
    if D > 256:
        raise ValueError(f"head dim {D} > 256 is not supported")
    if block_table.dim() != 2 or block_table.shape[0] != B or cache_lens.shape != (B,) or q_lens.shape != (B,):
        raise ValueError(
            f"block_table must be [{B}, max_blocks] and cache_lens, q_lens [{B}], got "
            f"{tuple(block_table.shape)}, {tuple(cache_lens.shape)}, {tuple(q_lens.shape)}"
        )
    if (depth_k is None) != (depth_v is None):
        raise ValueError("depth_k and depth_v come together")
    if depth_k is not None and (
        depth_k.shape != depth_v.shape
        or depth_k.dim() != 5
        or depth_k.shape[:2] != (B, kmax)
        or depth_k.shape[3:] != (Hkv, D)
    ):
        raise ValueError(
            f"depth_k/depth_v must be [{B}, {kmax}, L, {Hkv}, {D}], got {tuple(depth_k.shape)}, {tuple(depth_v.shape)}"
        )
    if tree_mask is not None and tree_mask.shape[-2:] != (kmax, kmax):
        raise ValueError(f"tree_mask must be [{B}, {kmax}, {kmax}] or [{kmax}, {kmax}], got {tuple(tree_mask.shape)}")
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.stride(-1) != 1:
        raise ValueError(f"out must be {tuple(q.shape)} with a unit last stride, got {tuple(out.shape)}")
    if B == 0 or kmax == 0:
        return out
    scale = D**-0.5 if scale is None else float(scale)
    config = verify_config(q.device) if config is None else config
    chunks = None
    if num_splits is None:
        # Batch-invariant: the most chunks the table's width allows (a bound, no device sync), the query tile fixed.
        chunks = (config.get("max_chunks", 32), config.get("min_chunk_keys", 256))
        if chunks[1] % config["BLOCK_N"] or min(chunks) < 1:
            raise ValueError(
                f"min_chunk_keys {chunks[1]} must be a positive multiple of BLOCK_N {config['BLOCK_N']}, "
                f"max_chunks {chunks[0]} positive"
            )
        num_splits = 1 + max(1, min(chunks[0], cdiv(block_table.shape[1] * k_cache.shape[1], chunks[1])))
        config = {**config, "BLOCK_M": config.get("BLOCK_M") or INVARIANT_TILE_M}
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    q, k_cache, v_cache, depth_k, depth_v = map(last_dim_contiguous, (q, k_cache, v_cache, depth_k, depth_v))
    block_table, cache_lens, q_lens = (
        t if t.dtype == torch.int32 and t.is_contiguous() else t.to(torch.int32).contiguous()
        for t in (block_table, cache_lens, q_lens)
    )
    return moda_verify_fwd(
        q,
        k_cache,
        v_cache,
        block_table,
        cache_lens,
        q_lens,
        depth_k,
        depth_v,
        tree_mask,
        scale,
        num_splits,
        out,
        config,
        chunks,
    )
