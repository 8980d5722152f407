"""Fused pointwise ops for the server's decode and verify steps (Triton): RoPE and SwiGLU's activation, one launch
each.

Those steps are launch-bound: shared.model.apply_rope launches about eight kernels (chunk, neg, cat, casts, two
multiplies, the add, the cast back) and `F.silu(g) * u` two or three. Each op here is a single launch with no host
sync and no data-dependent shapes, so it can be captured in a CUDA graph.

- `rope(x, cos, sin)`: exactly shared.model.apply_rope (rotate-half layout). x [B, T, H, D] in any float dtype,
  arbitrary strides for B, T and H with a unit last stride (e.g. a head slice of a fused [B, T, (Hq + 2 Hkv) * D]
  projection viewed as [B, T, H, D]); cos, sin [B or 1, T, 1, D] (fp32, from shared.model.rope_cos_sin; batch 1
  broadcasts over B). Element d of a row reads cos/sin at its own index d (the two halves of cos/sin are equal
  when they come from rope_cos_sin, but nothing relies on it):
      out[..., d]        = x[..., d] * cos[d] - x[..., d + D/2] * sin[d]              (d < D/2)
      out[..., d + D/2]  = x[..., d + D/2] * cos[d + D/2] + x[..., d] * sin[d + D/2]
  computed in fp32 and rounded once to x.dtype. Returns a contiguous [B, T, H, D] (or writes `out=`). D even,
  up to 256, any size (masked).
- `silu_mul(x)`: SwiGLU's activation. x [..., 2F] (gate then up, unit last stride, any leading dims: flattened to
  rows) -> a contiguous [..., F] = silu(x[..., :F]) * x[..., F:] in x.dtype (or writes `out=`), F any size
  (masked). Everything is computed in fp32 and rounded once; PyTorch's `F.silu(g) * u` rounds silu(g) to x.dtype
  before the multiply, so 16-bit results can differ from it by an ulp or so (well within the kernels' test
  tolerance; fp32 inputs agree to rounding).

Shapes that change from step to step (rows, T) are not specialised on, and the tiles depend only on D (rope) or F
(silu_mul), so a new batch size or draft length never compiles a new variant inside a round.

Pure-PyTorch references: tether.kernels.pointwise.naive. Tests (CPU, through Triton's interpreter):

    TRITON_INTERPRET=1 .venv/bin/python -m pytest -q tests/kernels/test_pointwise.py
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from tether.kernels.utils import cdiv, pow2

# Elements a program handles (rope: x elements of its rows; silu_mul: output elements). Small pointwise tiles: 4
# warps move 8-32 elements per thread, and a decode step's few rows fit in one or a few programs.
_TILE = 4096


@triton.jit(do_not_specialize=["n_rows", "T"])
def rope_fwd_kernel(
    x,  # [B, T, H, D], unit last stride
    cos,  # [B or 1, T, 1, D], unit last stride
    sin,  # [B or 1, T, 1, D], unit last stride
    o,  # [B, T, H, D] contiguous
    n_rows,  # B * T * H
    T,
    stride_xb,
    stride_xt,
    stride_xh,
    stride_cb,  # 0 when cos has batch 1
    stride_ct,
    stride_sb,
    stride_st,
    H: tl.constexpr,
    HALF: tl.constexpr,  # D // 2
    BLOCK_R: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # flat (b, t, h) index
    row_ok = rows < n_rows
    h = rows % H
    bt = rows // H
    t = (bt % T).to(tl.int64)
    b = (bt // T).to(tl.int64)
    offs = tl.arange(0, BLOCK_HALF)
    ok = row_ok[:, None] & (offs < HALF)[None, :]
    x1_ptrs = x + (b * stride_xb + t * stride_xt + h.to(tl.int64) * stride_xh)[:, None] + offs[None, :]
    c1_ptrs = cos + (b * stride_cb + t * stride_ct)[:, None] + offs[None, :]
    s1_ptrs = sin + (b * stride_sb + t * stride_st)[:, None] + offs[None, :]
    x1 = tl.load(x1_ptrs, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(x1_ptrs + HALF, mask=ok, other=0.0).to(tl.float32)
    c1 = tl.load(c1_ptrs, mask=ok, other=0.0).to(tl.float32)
    c2 = tl.load(c1_ptrs + HALF, mask=ok, other=0.0).to(tl.float32)
    s1 = tl.load(s1_ptrs, mask=ok, other=0.0).to(tl.float32)
    s2 = tl.load(s1_ptrs + HALF, mask=ok, other=0.0).to(tl.float32)
    o1 = x1 * c1 - x2 * s1  # rotated = cat(-x2, x1)
    o2 = x2 * c2 + x1 * s2
    o_ptrs = o + rows.to(tl.int64)[:, None] * (2 * HALF) + offs[None, :]
    tl.store(o_ptrs, o1.to(o.dtype.element_ty), mask=ok)
    tl.store(o_ptrs + HALF, o2.to(o.dtype.element_ty), mask=ok)


@triton.jit(do_not_specialize=["n_rows"])
def silu_mul_fwd_kernel(
    x,  # [n_rows, 2F], unit last stride
    o,  # [n_rows, F] contiguous
    n_rows,
    F,
    stride_xr,
    BLOCK_R: tl.constexpr,
    BLOCK_F: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    ok = (rows < n_rows)[:, None] & (cols < F)[None, :]
    r64 = rows.to(tl.int64)[:, None]
    g_ptrs = x + r64 * stride_xr + cols[None, :]
    g = tl.load(g_ptrs, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(g_ptrs + F, mask=ok, other=0.0).to(tl.float32)
    out = g / (1.0 + tl.exp(-g)) * u  # silu(g) = g * sigmoid(g), as PyTorch spells it; one rounding at the end
    tl.store(o + r64 * F + cols[None, :], out.to(o.dtype.element_ty), mask=ok)


def rope_fwd(x: Tensor, cos: Tensor, sin: Tensor, out: Tensor) -> Tensor:
    """Launch the RoPE kernel (no checks: `rope` does them). x, cos, sin have unit last strides; out is contiguous."""
    B, T, H, D = x.shape
    n_rows = B * T * H
    block_half = pow2(D // 2)
    block_r = max(1, _TILE // (2 * block_half))  # depends on D only: no new variant when B or T change
    stride_cb = 0 if cos.shape[0] == 1 else cos.stride(0)
    stride_sb = 0 if sin.shape[0] == 1 else sin.stride(0)
    rope_fwd_kernel[(cdiv(n_rows, block_r),)](
        x,
        cos,
        sin,
        out,
        n_rows,
        T,
        x.stride(0),
        x.stride(1),
        x.stride(2),
        stride_cb,
        cos.stride(1),
        stride_sb,
        sin.stride(1),
        H=H,
        HALF=D // 2,
        BLOCK_R=block_r,
        BLOCK_HALF=block_half,
        num_warps=4,
    )
    return out


def rope(x: Tensor, cos: Tensor, sin: Tensor, *, out: Tensor | None = None) -> Tensor:
    """Rotary embedding of x [B, T, H, D] (rotate-half layout), exactly shared.model.apply_rope in one launch.

    cos, sin: [B or 1, T, 1, D] (fp32, from shared.model.rope_cos_sin). x may be any strided view with a unit last
    stride (one is copied otherwise). Returns a contiguous [B, T, H, D] in x's dtype, or writes `out` (contiguous,
    same shape and dtype) and returns it."""
    if x.dim() != 4:
        raise ValueError(f"x must be [B, T, H, D], got {tuple(x.shape)}")
    B, T, H, D = x.shape
    if D % 2 or D > 256:
        raise ValueError(f"head dim must be even and <= 256, got {D}")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dim() != 4 or t.shape[0] not in (1, B) or t.shape[1:] != (T, 1, D):
            raise ValueError(f"{name} must be [{B} or 1, {T}, 1, {D}], got {tuple(t.shape)}")
    if out is None:
        out = torch.empty(B, T, H, D, dtype=x.dtype, device=x.device)
    elif out.shape != x.shape or out.dtype != x.dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {tuple(x.shape)} {x.dtype}, got {tuple(out.shape)} {out.dtype}")
    if out.numel() == 0:
        return out
    x, cos, sin = (t if t.stride(-1) == 1 else t.contiguous() for t in (x, cos, sin))
    return rope_fwd(x, cos, sin, out)


def silu_mul_fwd(x: Tensor, out: Tensor) -> Tensor:
    """Launch the SwiGLU activation kernel (no checks: `silu_mul` does them). x [rows, 2F] with a unit last stride;
    out [rows, F] contiguous."""
    n_rows, F = out.shape
    block_f = min(pow2(F), 1024)
    block_r = max(1, _TILE // block_f)  # depends on F only
    grid = (cdiv(n_rows, block_r), cdiv(F, block_f))
    silu_mul_fwd_kernel[grid](x, out, n_rows, F, x.stride(0), BLOCK_R=block_r, BLOCK_F=block_f, num_warps=4)
    return out


def silu_mul(x: Tensor, *, out: Tensor | None = None) -> Tensor:
    """SwiGLU's activation: x [..., 2F] (gate, then up) -> silu(x[..., :F]) * x[..., F:] [..., F] in x's dtype, in
    one launch (fp32 inside, one rounding: see the module docstring). Leading dims are flattened to rows (a copy
    only when they cannot be viewed so). Returns a contiguous [..., F], or writes `out` (contiguous, that shape,
    x's dtype) and returns it."""
    if x.dim() == 0 or x.shape[-1] % 2:
        raise ValueError(f"the last dim must be even (gate and up halves), got {tuple(x.shape)}")
    F = x.shape[-1] // 2
    shape = (*x.shape[:-1], F)
    if out is None:
        out = torch.empty(shape, dtype=x.dtype, device=x.device)
    elif out.shape != shape or out.dtype != x.dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {shape} {x.dtype}, got {tuple(out.shape)} {out.dtype}")
    if out.numel() == 0:
        return out
    rows = x.reshape(-1, 2 * F)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    silu_mul_fwd(rows, out.view(-1, F))
    return out
