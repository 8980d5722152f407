"""The fused pointwise kernels (tether.kernels.pointwise: rope, silu_mul) against their fp32 references and the model's
own PyTorch code (shared.model.apply_rope, FeedForward): shapes that are not powers of two, strided views of fused
projections, cos/sin with batch 1 and batch B, NaN-prefilled outputs and NaN around every input so that an unwritten
element or a stray read fails. On a machine without CUDA the kernels run in Triton's interpreter (TRITON_INTERPRET=1).
"""

import dataclasses
import os

import pytest
import torch
import torch.nn.functional as F

from tether.kernels.pointwise import rope, silu_mul
from tether.kernels.pointwise.naive import rope_naive, silu_mul_naive
from tether.shared.config import PRESETS
from tether.shared.model import FeedForward, apply_rope, rope_cos_sin

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton kernels need CUDA or TRITON_INTERPRET=1",
)
DEV = "cuda" if torch.cuda.is_available() else "cpu"
CUDA_ONLY = pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 and CUDA graphs run on a GPU")
BF16 = pytest.param(torch.bfloat16, marks=CUDA_ONLY, id="bf16")
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.float16, id="fp16"), BF16]


def tol(dtype: torch.dtype) -> float:
    return 1e-5 if dtype == torch.float32 else 5e-3


def assert_close_rms(got, want, tol):
    """Every element finite (NaN-prefilled outputs: nothing left unwritten) and relative RMS error below `tol`."""
    got, want = got.float(), want.float()
    assert torch.isfinite(got).all(), "non-finite output (an element left unwritten, or a stray read)"
    err = ((got - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt()).item()
    assert err < tol, f"relative RMS error {err:.2e}"


def nan_padded(t: torch.Tensor, pad: tuple[int, ...]) -> torch.Tensor:
    """A view of t inside a NaN buffer `pad` larger along each dim (same values, other strides)."""
    buf = torch.full([n + p for n, p in zip(t.shape, pad, strict=True)], float("nan"), dtype=t.dtype, device=t.device)
    view = buf[tuple(slice(0, n) for n in t.shape)]
    view.copy_(t)
    return view


def rope_inputs(B, T, H, D, dtype, *, cos_batch, strided, seed=0, random_cos=False):
    """x [B, T, H, D] (strided: heads 1..H of a NaN-filled fused [B, T, (H + 3) * D] projection), and cos, sin
    [cos_batch, T, 1, D] fp32 inside NaN buffers one batch and one position larger. rope_cos_sin's tables at random
    positions, or (random_cos) unrelated values whose two halves differ."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, H, D, generator=g)
    if random_cos:
        cos, sin = torch.randn(2, cos_batch, T, 1, D, generator=g)
    else:
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
        positions = torch.randint(0, 4096, (cos_batch, 1), generator=g) + torch.arange(T)
        cos, sin = rope_cos_sin(inv_freq, positions)
    x = x.to(DEV, dtype)
    if strided:
        fused = torch.full((B, T, (H + 3) * D), float("nan"), dtype=dtype, device=DEV)
        fused[..., D : (H + 1) * D] = x.reshape(B, T, H * D)
        x = fused[..., D : (H + 1) * D].view(B, T, H, D)
        assert not x.is_contiguous()
    cos, sin = (nan_padded(t.to(DEV), (1, 1, 0, 0)) for t in (cos, sin))
    return x, cos, sin


ROPE_CASES = [
    # B, T, H, D, cos_batch, strided
    (2, 63, 6, 64, 1, False),
    (2, 63, 2, 128, 2, True),
    (1, 1025, 2, 48, 1, True),
    (3, 5, 6, 48, 3, False),
    (4, 1, 6, 128, 4, True),  # decode: one position per row
    (1, 7, 2, 256, 1, True),
    (2, 3, 2, 2, 1, False),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("B", "T", "H", "D", "cos_batch", "strided"), ROPE_CASES)
def test_rope_matches_reference(B, T, H, D, cos_batch, strided, dtype):
    x, cos, sin = rope_inputs(B, T, H, D, dtype, cos_batch=cos_batch, strided=strided)
    out = torch.full((B, T, H, D), float("nan"), dtype=dtype, device=DEV)
    o = rope(x, cos, sin, out=out)
    assert o is out and o.dtype == dtype
    assert_close_rms(o, rope_naive(x, cos, sin), tol(dtype))
    # The model's own code, rounded once to the same dtype: equal up to the last bit's rounding.
    torch.testing.assert_close(o, apply_rope(x, cos, sin))


def test_rope_reads_cos_sin_at_own_index():
    """cos/sin whose halves differ (not rope_cos_sin's tables): each element uses its own index's values."""
    x, cos, sin = rope_inputs(2, 9, 6, 48, torch.float32, cos_batch=2, strided=True, random_cos=True)
    torch.testing.assert_close(rope(x, cos, sin), apply_rope(x, cos, sin))
    assert_close_rms(rope(x, cos, sin), rope_naive(x, cos, sin), 1e-5)


def test_rope_default_out_and_checks():
    x, cos, sin = rope_inputs(2, 5, 2, 64, torch.float16, cos_batch=1, strided=True)
    o = rope(x, cos, sin)
    assert o.shape == x.shape and o.is_contiguous() and o.dtype == x.dtype
    torch.testing.assert_close(o, apply_rope(x, cos, sin))
    assert rope(x[:, :0], cos[:, :0], sin[:, :0]).shape == (2, 0, 2, 64)
    with pytest.raises(ValueError, match="head dim"):
        rope(x[..., :63], cos[..., :63], sin[..., :63])
    with pytest.raises(ValueError, match="cos must be"):
        rope(x, cos[:, :4], sin)
    with pytest.raises(ValueError, match="out must be"):
        rope(x, cos, sin, out=torch.empty(2, 5, 2, 64, device=DEV))


SILU_CASES = [
    # leading dims, F, layout: "contiguous", "sliced" (a column slice of a wider NaN buffer), "transposed"
    ((2, 63), 384, "contiguous"),
    ((1025,), 100, "sliced"),
    ((4, 1), 384, "sliced"),  # decode
    ((5, 3), 100, "transposed"),  # leading dims that cannot be viewed as rows: copied
    ((7,), 1, "contiguous"),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("lead", "F_", "layout"), SILU_CASES)
def test_silu_mul_matches_reference(lead, F_, layout, dtype):
    g = torch.Generator().manual_seed(1)
    x = (2 * torch.randn(*lead, 2 * F_, generator=g)).to(DEV, dtype)
    if layout == "sliced":
        x = nan_padded(x, (0,) * (len(lead) - 1) + (0, 24))
        assert not x.is_contiguous()
    elif layout == "transposed":
        x = x.transpose(0, 1).contiguous().transpose(0, 1)
        assert not x.is_contiguous()
    out = torch.full((*lead, F_), float("nan"), dtype=dtype, device=DEV)
    o = silu_mul(x, out=out)
    assert o is out
    assert_close_rms(o, silu_mul_naive(x), tol(dtype))
    gate, up = x.chunk(2, dim=-1)
    want = F.silu(gate) * up  # rounds silu to dtype first: allow two ulps in 16 bit
    rtol = {torch.float32: None, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(o, want, rtol=rtol, atol=None if rtol is None else 1e-5)


def test_silu_mul_in_feed_forward():
    """FeedForward with its gate and up projections' outputs concatenated: the kernel's activation gives the
    module's output."""
    torch.manual_seed(0)
    ffn = FeedForward(dataclasses.replace(PRESETS["tiny"], ffn_dim=100)).to(DEV)
    h = torch.randn(2, 63, ffn.gate_proj.in_features, device=DEV)
    with torch.no_grad():
        gu = torch.cat([ffn.gate_proj(h), ffn.up_proj(h)], dim=-1)
        torch.testing.assert_close(ffn.down_proj(silu_mul(gu)), ffn(h))
    o = silu_mul(gu)
    assert o.shape == (2, 63, 100) and o.is_contiguous()
    assert silu_mul(gu[:0]).shape == (0, 63, 100)
    with pytest.raises(ValueError, match="even"):
        silu_mul(gu[..., :199])


@CUDA_ONLY
def test_cuda_graph_capture():
    """Both ops capture in a CUDA graph (no host sync) and replay on new inputs."""
    x, cos, sin = rope_inputs(4, 1, 6, 128, torch.bfloat16, cos_batch=4, strided=True)
    gu = torch.randn(4, 1, 768, device=DEV, dtype=torch.bfloat16)
    rope(x, cos, sin), silu_mul(gu)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_rope, o_silu = rope(x, cos, sin), silu_mul(gu)
    x.copy_(torch.randn_like(x))
    gu.copy_(torch.randn_like(gu))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(o_rope, apply_rope(x, cos, sin))
    assert_close_rms(o_silu, silu_mul_naive(gu), 5e-3)
