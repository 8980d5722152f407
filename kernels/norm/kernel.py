"""Fused RMSNorm (Triton), optionally with the residual add before it: one launch where PyTorch takes ~8.

The server's decode and verify steps are launch-bound, and tether.shared.model.RMSNorm is a chain of small kernels
(float cast, pow, mean, add eps, rsqrt, mul, cast, mul by the weight). This op does the whole chain in one pass
over each row, with fp32 statistics.

Contract (`rms_norm(x, weight, eps, residual=None)`; x [..., D], weight [D], fp32 / fp16 / bf16, D <= 8192):
- Without residual it returns what RMSNorm.forward computes,
  `weight * (xf * rsqrt(mean(xf ** 2, -1) + eps)).to(x.dtype)` with xf = x.float(): the normalised row is rounded
  to x's dtype BEFORE the weight multiplies it, and the product is rounded once to the expression's result dtype
  (torch.promote_types(x.dtype, weight.dtype): bf16 for a bf16 model). The mean and rsqrt may differ from
  PyTorch's in the last bits (another summation order), so results agree to rounding, not bit for bit.
- With `residual` (same shape and dtype as x) it first forms s = x + residual rounded to x's dtype (what `x +
  residual` gives in PyTorch), and returns (rms_norm(s), s): the fused "x = x + sublayer(x); h = norm(x)".
- `out` / `residual_out` may be given (contiguous, x's shape; out in the result dtype, residual_out in x's dtype),
  e.g. static buffers of a CUDA graph; residual_out may be x or residual itself (every element is read before the
  program that owns it writes it). Otherwise they are allocated with torch.empty.
- Any leading dims (flattened to rows; rows may be strided, the last dim must be contiguous or is made so), any
  D up to 8192 (not only powers of two: the tail is masked). No host sync and no allocation beyond the outputs, so
  it can be captured in a CUDA graph. The number of rows is not specialised on: a new batch size compiles nothing.

Layout: one program per row; for small D (< 1024) a program takes several rows (up to 16, ~1K elements), so short
rows do not leave most of a program's lanes idle.

    h = rms_norm(x, norm.weight, norm.eps)
    h, x = rms_norm(sublayer_out, norm.weight, norm.eps, residual=x)

Test: `TRITON_INTERPRET=1 .venv/bin/python -m pytest -q tests/kernels/test_norm.py` on a CPU (the interpreter), or
without TRITON_INTERPRET on a GPU (adds the bf16 cases). The reference is tether.kernels.norm.naive.rms_norm_naive.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from tether.kernels.utils import FLOAT_DTYPES, cdiv, pow2

MAX_D = 8192


@triton.jit(do_not_specialize=["n_rows"])
def rms_norm_fwd_kernel(
    x,  # [n_rows, D], row stride stride_x
    residual,  # [n_rows, D], row stride stride_r (RESIDUAL only)
    weight,  # [D]
    out,  # [n_rows, D] contiguous, the result dtype
    res_out,  # [n_rows, D] contiguous, x's dtype: s = x + residual (RESIDUAL only)
    n_rows,
    stride_x,
    stride_r,
    eps,
    D: tl.constexpr,
    RESIDUAL: tl.constexpr,
    BLOCK_R: tl.constexpr,  # rows per program
    BLOCK_D: tl.constexpr,  # next power of two >= D
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < D
    ok = (rows < n_rows)[:, None] & col_ok[None, :]
    rows64 = rows.to(tl.int64)
    xin = tl.load(x + rows64[:, None] * stride_x + cols[None, :], mask=ok, other=0.0)
    if RESIDUAL:
        r = tl.load(residual + rows64[:, None] * stride_r + cols[None, :], mask=ok, other=0.0)
        xin = (xin.to(tl.float32) + r.to(tl.float32)).to(x.dtype.element_ty)  # s, rounded as torch rounds x + r
        tl.store(res_out + rows64[:, None] * D + cols[None, :], xin, mask=ok)
    xf = xin.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, 1) / D + eps)  # [BLOCK_R], fp32 statistics
    w = tl.load(weight + cols, mask=col_ok, other=0.0).to(tl.float32)
    # Round the normalised row to x's dtype first, then one product rounded to the result dtype (RMSNorm's order).
    y = (xf * rstd[:, None]).to(x.dtype.element_ty).to(tl.float32) * w[None, :]
    tl.store(out + rows64[:, None] * D + cols[None, :], y.to(out.dtype.element_ty), mask=ok)


def rms_norm_config(D: int) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_D, num_warps) for rows of D elements: ~1K elements per program for short rows (up to 16
    rows), one row otherwise; one warp per 256 elements, 1 to 8."""
    block_d = pow2(D)
    block_r = max(1, min(16, 1024 // block_d))
    return block_r, block_d, min(8, max(1, block_r * block_d // 256))


def rms_norm_fwd(
    x: Tensor, residual: Tensor | None, weight: Tensor, eps: float, out: Tensor, res_out: Tensor | None
) -> None:
    """Launch the kernel (no checks: `rms_norm` does them). x, residual [n_rows, D] with unit last strides; weight
    [D] contiguous; out, res_out [n_rows, D] contiguous."""
    n_rows, D = x.shape
    if n_rows == 0:
        return
    block_r, block_d, num_warps = rms_norm_config(D)
    has_res = residual is not None
    rms_norm_fwd_kernel[(cdiv(n_rows, block_r),)](
        x,
        residual if has_res else x,
        weight,
        out,
        res_out if has_res else out,
        n_rows,
        x.stride(0),
        residual.stride(0) if has_res else 0,
        eps,
        D=D,
        RESIDUAL=has_res,
        BLOCK_R=block_r,
        BLOCK_D=block_d,
        num_warps=num_warps,
    )


def _rows(t: Tensor, D: int) -> Tensor:
    """t as [n_rows, D] with a unit last stride (a view when the leading dims allow it, else a contiguous copy)."""
    t = t.reshape(-1, D)
    return t if t.stride(-1) == 1 else t.contiguous()


def _check_out(buf: Tensor, x: Tensor, dtype: torch.dtype, name: str) -> None:
    if buf.shape != x.shape or buf.dtype != dtype or buf.device != x.device or not buf.is_contiguous():
        raise ValueError(
            f"{name} must be contiguous {tuple(x.shape)} {dtype} on {x.device}, got "
            f"{tuple(buf.shape)} {buf.dtype} on {buf.device}"
        )


def rms_norm(
    x: Tensor,  # [..., D]
    weight: Tensor,  # [D]
    eps: float,
    *,
    residual: Tensor | None = None,  # like x: normalise s = x + residual, and return s too
    out: Tensor | None = None,  # x's shape, the result dtype, contiguous
    residual_out: Tensor | None = None,  # x's shape and dtype, contiguous; may be x or residual (in place)
) -> Tensor | tuple[Tensor, Tensor]:
    """RMSNorm of x's last dim, as tether.shared.model.RMSNorm computes it, in one launch; with `residual`,
    (rms_norm(x + residual), x + residual). See the module docstring for the contract."""
    D = x.shape[-1]
    if weight.shape != (D,):
        raise ValueError(f"weight must be [{D}], got {tuple(weight.shape)}")
    if D > MAX_D:
        raise ValueError(f"rows of {D} > {MAX_D} elements are not supported")
    if x.dtype not in FLOAT_DTYPES or weight.dtype not in FLOAT_DTYPES:
        raise ValueError(f"x and weight must be fp32, fp16 or bf16, got {x.dtype}, {weight.dtype}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"residual must be {tuple(x.shape)} {x.dtype}, got {tuple(residual.shape)} {residual.dtype}")
    out_dtype = torch.promote_types(x.dtype, weight.dtype)
    if out is None:
        out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    else:
        _check_out(out, x, out_dtype, "out")
    if residual is not None:
        if residual_out is None:
            residual_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        else:
            _check_out(residual_out, x, x.dtype, "residual_out")
    w = weight if weight.is_contiguous() else weight.contiguous()
    rms_norm_fwd(
        _rows(x, D),
        None if residual is None else _rows(residual, D),
        w,
        float(eps),
        out.view(-1, D),
        None if residual is None else residual_out.view(-1, D),
    )
    return out if residual is None else (out, residual_out)
