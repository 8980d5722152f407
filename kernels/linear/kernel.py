"""Skinny linear layers (Triton): y = x @ W^T for the few rows of a decode or verify step, at the HBM's pace.

A verify round of an 8B-shaped target multiplies 8-64 token rows by every weight matrix: each weight is read once
and each of its bytes does a handful of FLOPs, so the step is bound by reading the weights. cuBLAS picks tiles made
for large M there (measured on the H200: ~87% of the copy bandwidth, plus split-K reduction kernels of its own),
and the model adds separate kernels for the residual add and SwiGLU's activation. This op reads each weight tile
once per program with the rows' tile held in registers, and finishes in the same kernel:
- `bias`: y + bias;
- `residual`: residual + y (the block's "x = x + o_proj(o)" and "x = x + down_proj(h)"), y rounded to the output
  dtype first, as PyTorch rounds the Linear's output before the add;
- `gated=True`: W is [2F, K] (gate rows then up rows, tether.server.fuse's gate_up weight) and the result is
  silu(x W_gate^T) * (x W_up^T) [M, F], SwiGLU's activation, both halves rounded to the output dtype first as
  F.linear would, then the product in fp32 rounded once (tether.kernels.pointwise.silu_mul's rule).

Contract (`linear(x, weight, bias=None, *, residual=None, gated=False, out=None, counters=None)`):
- x [..., K] with a unit last stride (leading dims flattened to M rows), weight [N, K] contiguous,
  fp32 / fp16 / bf16 with one dtype for all; fp32 accumulation (IEEE fp32 dots for fp32 inputs). Returns [..., N]
  (or [..., F] gated) contiguous in x's dtype, or writes `out`. More rows than MAX_ROWS: the same result through
  F.linear and PyTorch ops (a long prefill is compute-bound and cuBLAS's territory; those rows are not
  batch-invariant).
- Batch-invariant: a row's result does not depend on how many rows come with it or where it sits among them, so a
  session's verdicts do not change with the load (issue #44). Every row goes through the same arithmetic: rows are
  taken in tiles of ROW_TILE whatever M is (a dot's instruction shape, hence its rounding, follows the tile's
  height), the config (tiles, split-K) is tuned per (N, K, GATED) and never per row count, and split-K's partials
  are added in split order, not in the order the programs finish.
- Split-K (the autotuner may split K over 2-4 programs per output tile when N is small): the partial sums go to an
  fp32 workspace and the last program of a tile to finish (an atomic counter per tile) adds them up, in split order,
  and writes the tile, so there is still one launch and no memset. `counters` (int32, zeroed, >= counters_needed(N)
  elements) may be given: every finishing program sets its tile's counter back to 0, so one buffer serves call after
  call and CUDA graph replays; calls that share one must not run concurrently (the fused model keeps one per layer
  weight and runs on one stream). Without it, a zeroed buffer is allocated per call.
- No host sync; the number of rows is not specialised on, so a new batch size never compiles. Autotuned per (N, K,
  GATED) with results in Triton's disk cache (server/warm_cache.py).

Layout: program (m, n, s) owns ROW_TILE rows (tile m) by BLOCK_N output columns (two sets, gate and up, when gated)
and the s-th of SPLIT_K slices of K; BLOCK_N down to 16 gives small N enough programs to keep every SM streaming.
Row tiles vary fastest in launch order, so the programs that read one weight tile run together and all but the
first find it in L2.

Pure-PyTorch reference: tether.kernels.linear.naive. Tests (CPU, through Triton's interpreter):

    TRITON_INTERPRET=1 .venv/bin/python -m pytest -q tests/kernels/test_linear.py
"""

from __future__ import annotations

import functools
import threading

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from tether.kernels.utils import AUTOTUNE_CACHE, FLOAT_DTYPES, cdiv, dot_precision, interpreting

MAX_ROWS = 1024  # more rows than this go to F.linear: a long prefill, compute-bound (a verify step stays below)
ROW_TILE = 64  # rows per program, whatever M is: the batch-invariance rule (module docstring)
MAX_SPLIT_K = 4
SPLIT_K_MAX_N = 8192  # wider outputs have programs enough without splitting K (and a workspace stays small)
_MIN_BLOCK_N = 16


@triton.jit
def _epilogue(
    acc,
    acc_up,
    rows,
    cols,
    M,
    N,
    bias,
    residual,
    out,
    stride_rm,
    stride_om,
    HAS_BIAS: tl.constexpr,
    HAS_RES: tl.constexpr,
    GATED: tl.constexpr,
):
    ok = (rows < M)[:, None] & (cols < N)[None, :]
    dt = out.dtype.element_ty
    if GATED:
        g = acc.to(dt).to(tl.float32)
        u = acc_up.to(dt).to(tl.float32)
        y = g / (1.0 + tl.exp(-g)) * u
    else:
        y = acc
        if HAS_BIAS:
            y += tl.load(bias + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        if HAS_RES:
            r = tl.load(residual + rows[:, None] * stride_rm + cols[None, :], mask=ok, other=0.0)
            y = y.to(dt).to(tl.float32) + r.to(tl.float32)
    tl.store(out + rows[:, None] * stride_om + cols[None, :], y.to(dt), mask=ok)


@triton.jit(do_not_specialize=["M"])
def linear_fwd_kernel(
    x,  # [M, K], row stride stride_xm
    w,  # [N, K] contiguous ([2N, K] when GATED: gate rows, then up rows)
    bias,  # [N] (HAS_BIAS only)
    residual,  # [M, N], row stride stride_rm (HAS_RES only)
    out,  # [M, N], row stride stride_om
    partial,  # [SPLIT_K, 2, M, N] fp32 workspace (SPLIT_K > 1 only)
    counters,  # [>= cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N)] int32, zero between calls (SPLIT_K > 1 only)
    M,
    N,
    K,
    stride_xm,
    stride_rm,
    stride_om,
    HAS_BIAS: tl.constexpr,
    HAS_RES: tl.constexpr,
    GATED: tl.constexpr,
    PREC: tl.constexpr,  # "ieee" for fp32 inputs, else "tf32" (unused by 16-bit dots)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    row_ok = rows < M
    col_ok = cols < N
    # This program's slice of K, whole BLOCK_K steps (the last slice may be short or empty).
    k_steps = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(k_steps, SPLIT_K)
    k_lo = pid_k * per_split * BLOCK_K
    k_hi = tl.minimum(K, k_lo + per_split * BLOCK_K)
    x_ptrs = x + rows[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
    w_ptrs = w + cols[:, None].to(tl.int64) * K + offs_k[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up_off = N.to(tl.int64) * K
    for k in range(k_lo, k_hi, BLOCK_K):
        k_ok = (k + offs_k) < K
        xk = tl.load(x_ptrs + k, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        wk = tl.load(w_ptrs + k, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(xk, tl.trans(wk), acc, input_precision=PREC)
        if GATED:
            wu = tl.load(w_ptrs + up_off + k, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            acc_up = tl.dot(xk, tl.trans(wu), acc_up, input_precision=PREC)
    if SPLIT_K == 1:
        _epilogue(acc, acc_up, rows, cols, M, N, bias, residual, out, stride_rm, stride_om, HAS_BIAS, HAS_RES, GATED)
    else:
        ok = row_ok[:, None] & col_ok[None, :]
        mn = rows[:, None] * N + cols[None, :]
        part = partial + pid_k.to(tl.int64) * 2 * M * N
        tl.store(part + mn, acc, mask=ok)
        if GATED:
            tl.store(part + M * N + mn, acc_up, mask=ok)
        tl.debug_barrier()  # every thread's partial is stored before the counter says so
        tile = pid_m * tl.cdiv(N, BLOCK_N) + pid_n
        done = tl.atomic_add(counters + tile, 1, sem="acq_rel")
        if done == SPLIT_K - 1:
            # The last of the tile's programs: every partial is visible (acquire). They are added in split order,
            # its own among them, so the sum does not depend on which program finished last.
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):
                part_s = partial + s * 2 * M * N
                acc += tl.load(part_s + mn, mask=ok, other=0.0, cache_modifier=".cg")
                if GATED:
                    acc_up += tl.load(part_s + M * N + mn, mask=ok, other=0.0, cache_modifier=".cg")
            _epilogue(
                acc, acc_up, rows, cols, M, N, bias, residual, out, stride_rm, stride_om, HAS_BIAS, HAS_RES, GATED
            )
            tl.atomic_xchg(counters + tile, 0)  # ready for the next call (or graph replay)


def _configs() -> list[triton.Config]:
    if interpreting():
        # One config (the interpreter benchmarks nothing), in large tiles: the interpreter's cost is per program and
        # per op, and with 16 x 32 tiles the fused model's LM head dominated every Triton-backend test (the TP server
        # test ran 3.7x longer). Tests pin small tiles and split-K through `config=`.
        return [triton.Config({"BLOCK_N": 128, "BLOCK_K": 128, "SPLIT_K": 1}, num_warps=4, num_stages=1)]
    return tuned_configs()


def tuned_configs() -> list[triton.Config]:
    """The configs the autotuner tries on a GPU (before pruning)."""
    # (BLOCK_N, BLOCK_K, num_warps, num_stages, SPLIT_K): small output tiles streaming long K slices, deep
    # pipelines to keep enough bytes in flight per SM; split-K for narrow outputs (pruned past SPLIT_K_MAX_N).
    shapes = [
        (16, 256, 4, 4, 1),
        (16, 256, 4, 6, 1),
        (16, 512, 4, 3, 1),
        (32, 256, 4, 4, 1),
        (32, 512, 8, 3, 1),
        (64, 128, 4, 4, 1),
        (64, 256, 8, 3, 1),
        (16, 256, 4, 4, 2),
        (32, 256, 4, 4, 2),
        (32, 256, 4, 4, 4),
    ]
    return [
        triton.Config({"BLOCK_N": n, "BLOCK_K": k, "SPLIT_K": s}, num_warps=w, num_stages=st)
        for n, k, w, st, s in shapes
    ]


def shared_bytes(config: triton.Config, element_bytes: int, gated: bool) -> int:
    """Shared memory a config's pipelined loads take: num_stages - 1 buffers of the rows' tile and the weight's
    (two weight tiles gated), the estimate that matched Triton's own count where it refused one (294,912 B: fp32,
    gated, BLOCK_N 16, BLOCK_K 256, 4 stages)."""
    n, k = config.kwargs["BLOCK_N"], config.kwargs["BLOCK_K"]
    return max(config.num_stages - 1, 1) * (ROW_TILE + n * (2 if gated else 1)) * k * element_bytes


def fit_shared(configs: list[triton.Config], element_bytes: int, gated: bool, limit: int) -> list[triton.Config]:
    """Each config as it fits `limit` bytes of shared memory: fewer stages (down to 2), then half as deep K steps
    (down to 32), first; configs that fit already come back as they are, duplicates once. The configs are tuned for
    16-bit weights, and fp32 ones (`--dtype float32` on a GPU) need twice the bytes: without this every config of a
    gated layer ran out of shared memory, the autotuner timed them all as infinite and launched the first anyway."""
    out, seen = [], set()
    for c in configs:
        kw, stages = dict(c.kwargs), c.num_stages
        fitted = triton.Config(kw, num_warps=c.num_warps, num_stages=stages)
        while shared_bytes(fitted, element_bytes, gated) > limit and (stages > 2 or kw["BLOCK_K"] > 32):
            if stages > 2:
                stages -= 1
            else:
                kw["BLOCK_K"] //= 2
            fitted = triton.Config(dict(kw), num_warps=c.num_warps, num_stages=stages)
        key = (tuple(sorted(fitted.kwargs.items())), fitted.num_warps, fitted.num_stages)
        if key not in seen:
            seen.add(key)
            out.append(fitted if key != (tuple(sorted(c.kwargs.items())), c.num_warps, c.num_stages) else c)
    return out


@functools.cache
def _max_shared(device_index: int) -> int:
    """The most shared memory one program may take on this GPU (Triton's own figure, the one it checks)."""
    return triton.runtime.driver.active.utils.get_device_properties(device_index)["max_shared_mem"]


def _prune(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
    """Split-K only for narrow outputs (the workspace is sized for those); every config fitted to the GPU's shared
    memory for this dtype (fit_shared); at least one config survives."""
    N, x = named_args["N"], named_args["x"]
    keep = [c for c in configs if c.kwargs["SPLIT_K"] == 1 or N <= SPLIT_K_MAX_N]
    # 64-row tiles with 512-wide K steps run out of shared memory at 4+ stages; skip the waste
    keep = [c for c in keep if c.kwargs["BLOCK_K"] * c.num_stages <= 1536] or keep
    keep = keep or configs[:1]
    if x.is_cuda:
        keep = fit_shared(keep, x.element_size(), bool(kwargs.get("GATED", False)), _max_shared(x.device.index))
    return keep


linear_fwd_kernel_autotuned = triton.autotune(
    configs=_configs(), key=["N", "K", "GATED"], prune_configs_by={"early_config_prune": _prune}, **AUTOTUNE_CACHE
)(linear_fwd_kernel)
_AUTOTUNE_LOCK = threading.Lock()


def counters_needed(n_out: int) -> int:
    """Elements of a `counters` buffer for an output N wide (one per smallest output tile of up to MAX_ROWS rows)."""
    return cdiv(n_out, _MIN_BLOCK_N) * cdiv(MAX_ROWS, ROW_TILE)


def linear_fwd(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    residual: Tensor | None,
    out: Tensor,
    gated: bool,
    counters: Tensor | None,
    config: dict | None = None,
) -> Tensor:
    """Launch the kernel (no checks: `linear` does them). x [M, K] (unit last stride, M <= MAX_ROWS), weight [N or
    2N, K] contiguous, residual / out [M, N] with unit last strides. `config` (BLOCK_N, BLOCK_K, SPLIT_K,
    num_warps, num_stages) bypasses the autotuner: tests and tuning."""
    M, K = x.shape
    N = out.shape[1]
    m_tiles = cdiv(M, ROW_TILE)
    split_max = MAX_SPLIT_K if N <= SPLIT_K_MAX_N else 1
    if config is not None:
        split_max = config["SPLIT_K"]
    partial = torch.empty(split_max, 2, M, N, dtype=torch.float32, device=x.device) if split_max > 1 else out
    if split_max > 1 and counters is None:
        counters = torch.zeros(counters_needed(N), dtype=torch.int32, device=x.device)
    args = (
        x,
        weight,
        bias if bias is not None else out,
        residual if residual is not None else out,
        out,
        partial,
        counters if counters is not None else out,
        M,
        N,
        K,
        x.stride(0),
        residual.stride(0) if residual is not None else 0,
        out.stride(0),
    )
    meta = dict(
        HAS_BIAS=bias is not None,
        HAS_RES=residual is not None,
        GATED=gated,
        PREC=dot_precision(x.dtype),
        BLOCK_M=ROW_TILE,
    )
    if config is not None:
        cfg = dict(config)
        num_warps, num_stages = cfg.pop("num_warps", 4), cfg.pop("num_stages", 3)
        grid = (m_tiles, cdiv(N, cfg["BLOCK_N"]), cfg["SPLIT_K"])
        linear_fwd_kernel[grid](*args, **meta, **cfg, num_warps=num_warps, num_stages=num_stages)
        return out

    def grid(m):
        return (m_tiles, triton.cdiv(N, m["BLOCK_N"]), m["SPLIT_K"])

    # The autotuner benchmarks on its first call per key; two threads tuning one key at once would interleave.
    with _AUTOTUNE_LOCK:
        linear_fwd_kernel_autotuned[grid](*args, **meta)
    return out


def linear(
    x: Tensor,  # [..., K]
    weight: Tensor,  # [N, K] ([2F, K] gated)
    bias: Tensor | None = None,  # [N]
    *,
    residual: Tensor | None = None,  # [..., N]: return residual + linear(x)
    gated: bool = False,  # return silu(x W[:F]^T) * (x W[F:]^T), [..., F]
    out: Tensor | None = None,  # [..., N or F] x's dtype, unit last stride
    counters: Tensor | None = None,  # int32 [>= counters_needed(N)], zeroed: split-K's per-tile counters
    config: dict | None = None,  # bypass the autotuner (tests, tuning)
) -> Tensor:
    """x W^T (+ bias) (+ residual), or SwiGLU's silu(gate) * up with `gated`; see the module docstring."""
    K = x.shape[-1]
    if weight.dim() != 2 or weight.shape[1] != K:
        raise ValueError(f"weight must be [N, {K}], got {tuple(weight.shape)}")
    if x.dtype not in FLOAT_DTYPES or weight.dtype != x.dtype:
        raise ValueError(f"x and weight must share one of fp32, fp16, bf16, got {x.dtype}, {weight.dtype}")
    if gated and (weight.shape[0] % 2 or bias is not None or residual is not None):
        raise ValueError("gated takes an even number of weight rows (gate, then up) and no bias or residual")
    N = weight.shape[0] // 2 if gated else weight.shape[0]
    lead = x.shape[:-1]
    if bias is not None and (bias.shape != (N,) or bias.dtype != x.dtype):
        raise ValueError(f"bias must be [{N}] {x.dtype}, got {tuple(bias.shape)} {bias.dtype}")
    if residual is not None and (residual.shape != (*lead, N) or residual.dtype != x.dtype):
        raise ValueError(f"residual must be {(*lead, N)} {x.dtype}, got {tuple(residual.shape)} {residual.dtype}")
    if out is not None and (out.shape != (*lead, N) or out.dtype != x.dtype or out.stride(-1) != 1):
        raise ValueError(f"out must be {(*lead, N)} {x.dtype} with a unit last stride, got {tuple(out.shape)}")
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    if M > MAX_ROWS or M == 0:
        return _linear_torch(x, weight, bias, residual, gated, out)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    w = weight if weight.is_contiguous() else weight.contiguous()
    if out is None:
        out = torch.empty(*lead, N, dtype=x.dtype, device=x.device)
    out2 = out.view(-1, N)
    res2 = None if residual is None else residual.reshape(-1, N)
    if res2 is not None and res2.stride(-1) != 1:
        res2 = res2.contiguous()
    if counters is not None and (counters.dtype != torch.int32 or counters.numel() < counters_needed(N)):
        raise ValueError(f"counters must be int32 with >= {counters_needed(N)} elements")
    linear_fwd(x2, w, bias, res2, out2, gated, counters, config)
    return out


def _linear_torch(
    x: Tensor, weight: Tensor, bias: Tensor | None, residual: Tensor | None, gated: bool, out: Tensor | None
) -> Tensor:
    """The same contract through PyTorch ops (many rows, or none)."""
    if gated:
        g, u = F.linear(x, weight).chunk(2, dim=-1)
        y = (F.silu(g.float()) * u.float()).to(x.dtype)
    else:
        y = F.linear(x, weight, bias)
        if residual is not None:
            y = residual + y
    if out is None:
        return y
    out.copy_(y)
    return out
