"""MoDA prefill: causal flash attention over the sequence keys plus each query's own depth keys, one softmax.

For query row t (of KV head h) the kernel attends, under one online softmax with fp32 state, to
- the sequence keys k[b, j, h] for j <= t + P (P = Tk - T rows of a cached prefix; P = 0 for plain prefill), and
- the depth keys depth_k[b, t, l, h] for l < L (what token t wrote at earlier layers: same position only).

Layout choices (the MoDA paper's "flash layout, chunk-aware, group-aware" kernel):
- group-aware GQA: the G = Hq / Hkv query heads of one KV head are folded into time. Program rows are
  r = t * G + g, so one tile of BLOCK_M rows covers BLOCK_M / G positions of all G heads and every K/V tile is
  loaded once for the whole group. Any G works (a tile may start in the middle of a position's group).
- chunk-aware depth: depth K/V are position-major ([B, T, L, Hkv, D], i.e. [B, T*L, Hkv, D]), so the depth
  keys of a tile's positions t0..t1 are one contiguous slice of (t1 - t0 + 1) * L rows (any strides: the
  model's DepthStream views work without a copy). The kernel scores that slice with tensor-core dots
  [BLOCK_M, D] x [D, BLOCK_N] and masks each row to its own L columns. Each row thus pays for ~BLOCK_M / G * L
  depth columns of which L are live (against ~T / 2 sequence keys). The alternative, a loop over l loading
  [BLOCK_M, D] per l and reducing row dot products on CUDA cores, has no waste but runs at ~1/15 of tensor-core
  throughput: by that estimate the dots win for BLOCK_M / G <= ~16-32 (G >= 4 at BLOCK_M = 64-128, our GQA
  models) and lose for G = 1-2, where the autotuner's BLOCK_M = 64 configs limit the waste. The dots also share
  one code path (and the update helper) with the sequence loop.
- sequence loop in two phases: blocks every row of the tile sees in full (no mask), then the causal boundary
  blocks (masked); tiles run in reverse order so the longest (last) tiles start first.
- varlen: with cu_seqlens the batch is packed (B == 1); program (i, n, h) takes tile i of sequence n and
  exits at once past the sequence's end.
- precision: fp32 softmax state and accumulator; P is cast to V's dtype for the PV dot (as the reference does).
  fp32 inputs use IEEE fp32 dots (not TF32), fp16 / bf16 tensor cores. Offsets along T are int64 (a depth
  buffer [T, L, Hkv, D] passes 2**31 elements at T = 64K, L = 64, Hkv = 8, D = 128).

Reference: naive.py's `moda_attention_naive`. Tests (CPU, through Triton's interpreter):

    TRITON_INTERPRET=1 .venv/bin/python -m pytest -q tests/kernels/test_moda_prefill.py
"""

from __future__ import annotations

import threading

import torch
import triton
import triton.language as tl
from torch import Tensor

from tether.kernels.utils import (
    AUTOTUNE_CACHE,
    LOG2E,
    dot_precision,
    interpreting,
    last_dim_contiguous,
    online_softmax_step,
    pow2,
)

_AUTOTUNE_LOCK = threading.Lock()


def _autotune_configs() -> list[triton.Config]:
    if interpreting():
        # One small deterministic config: the interpreter benchmarks nothing and runs fastest with few programs.
        return [triton.Config({"BLOCK_M": 32, "BLOCK_N": 32}, num_warps=4, num_stages=1)]
    # Hopper-oriented (BLOCK_M, BLOCK_N, num_warps, num_stages). Chosen from an sm_90a AOT compile (ptxas -v) at
    # D = 128: all spill-free and within 227 KB of shared memory; 128x64 with 4 warps spills, 128x128 at 4 stages
    # runs out of shared memory.
    shapes = [
        (128, 64, 8, 2),
        (128, 64, 8, 3),
        (128, 64, 8, 4),
        (128, 32, 8, 2),
        (128, 32, 8, 3),
        (128, 128, 8, 2),
        (64, 64, 4, 2),
        (64, 64, 4, 3),
        (64, 64, 8, 3),
        (64, 32, 4, 3),
    ]
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s) for m, n, w, s in shapes]


@triton.jit(do_not_specialize=["T", "Tk", "L"])
def moda_attention_fwd_kernel(
    q,  # [B, T, Hq, D]
    k,  # [B, Tk, Hkv, D]
    v,  # [B, Tk, Hkv, D]
    dk,  # [B, T, L, Hkv, D]
    dv,  # [B, T, L, Hkv, D]
    o,  # [B, T, Hq, D]
    cu_seqlens,  # [N + 1] int32, or None
    qk_scale,  # softmax scale * log2(e)
    T,
    Tk,
    L,
    stride_qb,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_dkb,
    stride_dkt,
    stride_dkl,
    stride_dkh,
    stride_dvb,
    stride_dvt,
    stride_dvl,
    stride_dvh,
    stride_ob,
    stride_ot,
    stride_oh,
    G: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_DEPTH: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    i_m = tl.num_programs(0) - 1 - tl.program_id(0)  # longest causal tiles first
    i_n, i_h = tl.program_id(1), tl.program_id(2)
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        T = (tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos).to(tl.int32)
        Tk = T
        q += bos * stride_qt
        k += bos * stride_kt
        v += bos * stride_vt
        o += bos * stride_ot
        if HAS_DEPTH:
            dk += bos * stride_dkt
            dv += bos * stride_dvt
    else:
        b = i_n.to(tl.int64)
        q += b * stride_qb
        k += b * stride_kb
        v += b * stride_vb
        o += b * stride_ob
        if HAS_DEPTH:
            dk += b * stride_dkb
            dv += b * stride_dvb
    if i_m * BLOCK_M >= T * G:
        return
    P = Tk - T  # cached prefix rows every query sees

    # rows of this tile: r = t * G + g (GQA folded into time)
    offs_r = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    t_r = offs_r // G  # [BLOCK_M] position of each row
    g_r = offs_r % G  # [BLOCK_M] head within the group
    mask_r = offs_r < T * G
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    t_lo = (i_m * BLOCK_M) // G
    t_hi = tl.minimum((i_m * BLOCK_M + BLOCK_M - 1) // G, T - 1)

    q_rows = t_r.to(tl.int64) * stride_qt + (i_h * G + g_r) * stride_qh
    qb = tl.load(q + q_rows[:, None] + offs_d[None, :], mask=mask_r[:, None] & mask_d[None, :], other=0.0)

    k += i_h * stride_kh
    v += i_h * stride_vh
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # phase 1: key blocks every row of the tile sees whole (no mask on scores)
    if CAUSAL:
        n_full = ((t_lo + P + 1) // BLOCK_N) * BLOCK_N
        n_end = t_hi + P + 1
    else:
        n_full = (Tk // BLOCK_N) * BLOCK_N
        n_end = Tk
    for start in range(0, n_full, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        kb = tl.load(k + offs_n.to(tl.int64)[None, :] * stride_kt + offs_d[:, None], mask=mask_d[:, None], other=0.0)
        vb = tl.load(v + offs_n.to(tl.int64)[:, None] * stride_vt + offs_d[None, :], mask=mask_d[None, :], other=0.0)
        s = tl.dot(qb, kb, input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
        m_i, l_i, acc = online_softmax_step(s, vb, m_i, l_i, acc, DOT_PRECISION)
    # phase 2: the causal boundary (or the key tail), masked
    for start in range(n_full, n_end, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        mask_n = offs_n < Tk
        kb = tl.load(
            k + offs_n.to(tl.int64)[None, :] * stride_kt + offs_d[:, None],
            mask=mask_d[:, None] & mask_n[None, :],
            other=0.0,
        )
        vb = tl.load(
            v + offs_n.to(tl.int64)[:, None] * stride_vt + offs_d[None, :],
            mask=mask_n[:, None] & mask_d[None, :],
            other=0.0,
        )
        s = tl.dot(qb, kb, input_precision=DOT_PRECISION) * qk_scale
        visible = mask_n[None, :]
        if CAUSAL:
            visible = visible & (offs_n[None, :] <= t_r[:, None] + P)
        s = tl.where(visible, s, float("-inf"))
        m_i, l_i, acc = online_softmax_step(s, vb, m_i, l_i, acc, DOT_PRECISION)

    # phase 3: depth keys of the tile's positions, one contiguous position-major slice; row t sees only its own L
    if HAS_DEPTH:
        dk += i_h * stride_dkh
        dv += i_h * stride_dvh
        n_cols = (t_hi - t_lo + 1) * L
        for start in range(0, n_cols, BLOCK_N):
            offs_c = start + tl.arange(0, BLOCK_N)
            mask_c = offs_c < n_cols
            t_c = t_lo + offs_c // L  # [BLOCK_N] position owning each depth column
            l_c = offs_c % L
            dkb = tl.load(
                dk + (t_c.to(tl.int64) * stride_dkt + l_c * stride_dkl)[None, :] + offs_d[:, None],
                mask=mask_d[:, None] & mask_c[None, :],
                other=0.0,
            )
            dvb = tl.load(
                dv + (t_c.to(tl.int64) * stride_dvt + l_c * stride_dvl)[:, None] + offs_d[None, :],
                mask=mask_c[:, None] & mask_d[None, :],
                other=0.0,
            )
            s = tl.dot(qb, dkb, input_precision=DOT_PRECISION) * qk_scale
            s = tl.where(mask_c[None, :] & (t_c[None, :] == t_r[:, None]), s, float("-inf"))
            m_i, l_i, acc = online_softmax_step(s, dvb, m_i, l_i, acc, DOT_PRECISION)

    acc = acc / l_i[:, None]
    o_rows = t_r.to(tl.int64) * stride_ot + (i_h * G + g_r) * stride_oh
    tl.store(
        o + o_rows[:, None] + offs_d[None, :],
        acc.to(o.dtype.element_ty),
        mask=mask_r[:, None] & mask_d[None, :],
    )


# Tuning results go to Triton's disk cache (AUTOTUNE_CACHE): a restarted server then skips the benchmarking (the
# compiled kernels are cached anyway), which took most of a cold warm-up on the H200.
moda_attention_fwd_kernel_autotuned = triton.autotune(
    configs=_autotune_configs(), key=["G", "D", "CAUSAL", "HAS_DEPTH", "IS_VARLEN"], **AUTOTUNE_CACHE
)(moda_attention_fwd_kernel)


def moda_attention_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    depth_k: Tensor | None,
    depth_v: Tensor | None,
    scale: float,
    causal: bool = True,
    cu_seqlens: Tensor | None = None,
    out: Tensor | None = None,
    *,
    config: dict | None = None,
) -> Tensor:
    """Launch moda_attention_fwd_kernel. Shapes as moda_attention; k, v may hold Tk >= T rows (a causal prefix).

    config: optional {"BLOCK_M", "BLOCK_N"[, "num_warps", "num_stages"]} to bypass the autotuner (tests).
    """
    B, T, Hq, D = q.shape
    Tk, Hkv = k.shape[1], k.shape[2]
    if k.shape != (B, Tk, Hkv, D) or v.shape != k.shape:
        raise ValueError(
            f"k, v must be [B, Tk, Hkv, D] matching q {tuple(q.shape)}: {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if Hq % Hkv:
        raise ValueError(f"Hq ({Hq}) must be a multiple of Hkv ({Hkv})")
    if Tk < T:
        raise ValueError(f"fewer keys ({Tk}) than queries ({T})")
    if not (k.dtype == v.dtype == q.dtype):
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if D > 256:
        raise ValueError(f"head dim {D} > 256 is not supported")
    L = 0 if depth_k is None else depth_k.shape[2]
    if L:
        if depth_v is None or depth_k.shape != (B, T, L, Hkv, D) or depth_v.shape != depth_k.shape:
            raise ValueError(
                f"depth_k, depth_v must be [B, T, L, Hkv, D] = [{B}, {T}, L, {Hkv}, {D}]: {tuple(depth_k.shape)}, "
                f"{None if depth_v is None else tuple(depth_v.shape)}"
            )
        if not (depth_k.dtype == depth_v.dtype == q.dtype):
            raise ValueError(f"depth dtypes {depth_k.dtype}, {depth_v.dtype} differ from q's {q.dtype}")
    if cu_seqlens is not None:
        if B != 1 or Tk != T:
            raise ValueError("with cu_seqlens the inputs are packed: B == 1 and k, v have the queries' T rows")
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            raise ValueError("cu_seqlens must be [N + 1]")
        cu_seqlens = cu_seqlens.to(device=q.device, dtype=torch.int32)
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    elif out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be {tuple(q.shape)} {q.dtype} with a unit last stride")
    if out.numel() == 0:
        return out

    q, k, v = last_dim_contiguous(q), last_dim_contiguous(k), last_dim_contiguous(v)
    if L:
        dk, dv = last_dim_contiguous(depth_k), last_dim_contiguous(depth_v)
        sdk, sdv = dk.stride()[:4], dv.stride()[:4]
    else:
        dk, dv, sdk, sdv = None, None, (0, 0, 0, 0), (0, 0, 0, 0)
    G = Hq // Hkv
    if cu_seqlens is not None:
        n_seq = cu_seqlens.numel() - 1
        rows = int((cu_seqlens[1:] - cu_seqlens[:-1]).max().item()) * G
    else:
        n_seq, rows = B, T * G

    def grid(meta):
        return (triton.cdiv(rows, meta["BLOCK_M"]), n_seq, Hkv)

    args = (
        q,
        k,
        v,
        dk,
        dv,
        out,
        cu_seqlens,
        scale * LOG2E,
        T,
        Tk,
        L,
        *q.stride()[:3],
        *k.stride()[:3],
        *v.stride()[:3],
        *sdk,
        *sdv,
        *out.stride()[:3],
    )
    consts = dict(
        G=G,
        D=D,
        BLOCK_D=max(16, pow2(D)),
        CAUSAL=causal,
        HAS_DEPTH=L > 0,
        IS_VARLEN=cu_seqlens is not None,
        # fp32 inputs get true fp32 dots (what the reference computes); fp16 / bf16 ignore it
        DOT_PRECISION=dot_precision(q.dtype),
    )
    if config is None:
        # Triton's autotuner keeps the call's arguments on the shared kernel object while it benchmarks: two
        # threads tuning at once (the server prefills from its gRPC threads) crash it (triton-lang/triton#11494).
        with _AUTOTUNE_LOCK:
            moda_attention_fwd_kernel_autotuned[grid](*args, **consts)
    else:
        cfg = dict(config)
        launch = {name: cfg.pop(name) for name in ("num_warps", "num_stages") if name in cfg}
        moda_attention_fwd_kernel[grid({**cfg})](*args, **consts, **cfg, **launch)
    return out


def moda_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    depth_k: Tensor | None = None,
    depth_v: Tensor | None = None,
    *,
    causal: bool = True,
    scale: float | None = None,
    cu_seqlens: Tensor | None = None,
    out: Tensor | None = None,
) -> Tensor:
    """MoDA attention (prefill / full sequence), forward only.

    Args:
        q: [B, T, Hq, D] queries (RoPE applied), fp16 / bf16 / fp32.
        k, v: [B, T, Hkv, D] sequence keys/values, Hq a multiple of Hkv. Without cu_seqlens they may hold
            Tk > T rows: the first Tk - T are a cached prefix every query sees.
        depth_k, depth_v: [B, T, L, Hkv, D] position-major depth keys/values (the memory of [B, T*L, Hkv, D]);
            None or L = 0 gives plain attention. Any strides with a unit last one (DepthStream views work).
        causal: query t sees sequence keys j <= t (+ prefix); False: all keys.
        scale: softmax scale for both parts, default D ** -0.5.
        cu_seqlens: int32 [N + 1] cumulative lengths of a packed batch (B == 1, T = total tokens); each
            sequence attends only within itself.
        out: optional [B, T, Hq, D] output to write into (unit last stride).

    Returns:
        o: [B, T, Hq, D] in q's dtype (fp32 accumulation).
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return moda_attention_fwd(q, k, v, depth_k, depth_v, scale, causal, cu_seqlens, out)
