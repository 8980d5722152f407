"""The skinny linear op (tether.kernels.linear) against its naive reference.

Rows 1-130 (not powers of two, over several row tiles), widths and depths that are not multiples of the tiles,
bias, residual and gated (SwiGLU) epilogues, split-K with the in-kernel reduction and its self-resetting counters,
leading dims, the fallback past MAX_ROWS, and batch invariance (a row's bits whatever rows come with it); every call
writes into NaN-filled outputs, so an element the kernel fails to write fails the test. On a machine without CUDA
the kernel runs in Triton's interpreter (TRITON_INTERPRET=1), fp32 and fp16 (bf16 needs a GPU).
"""

import os

import pytest
import torch
from interpreter_blas import BLAS_ROWS_REASON, blas_rows_placed_alike

pytest.importorskip("triton")

if not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"):
    pytest.skip("needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)

from tether.kernels.linear import MAX_ROWS, counters_needed, linear  # noqa: E402
from tether.kernels.linear.naive import linear_naive  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEV == "cuda" else [])
TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 5e-3}


def rel_rms(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.float(), ref.float()
    return ((out - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item()


def make(M, N, K, dtype, *, seed=0, lead=None, gated=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*(lead or (M,)), K, generator=g)
    w = torch.randn(2 * N if gated else N, K, generator=g) * K**-0.5
    b = torch.randn(N, generator=g)
    r = torch.randn(*(lead or (M,)), N, generator=g)
    return (t.to(DEV, dtype) for t in (x, w, b, r))


def check(out, ref, dtype):
    assert not out.isnan().any(), "unwritten or non-finite elements"
    err = rel_rms(out, ref)
    assert err < TOL[dtype], f"relative RMS error {err:.2e}"


def nan_out(shape, dtype):
    return torch.full(shape, float("nan"), dtype=dtype, device=DEV)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M,N,K", [(1, 48, 64), (7, 200, 100), (16, 64, 1025), (33, 130, 72), (130, 96, 40)])
def test_plain_bias_residual(dtype, M, N, K):
    x, w, b, r = make(M, N, K, dtype)
    check(linear(x, w, out=nan_out((M, N), dtype)), linear_naive(x, w), dtype)
    check(linear(x, w, b, out=nan_out((M, N), dtype)), linear_naive(x, w, b), dtype)
    out = linear(x, w, b, residual=r, out=nan_out((M, N), dtype))
    check(out, linear_naive(x, w, b, residual=r), dtype)
    assert out.dtype == dtype and out.shape == (M, N)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M,F,K", [(1, 40, 64), (9, 88, 130), (64, 24, 33)])
def test_gated_is_swiglu(dtype, M, F, K):
    x, w, _, _ = make(M, F, K, dtype, gated=True)
    out = linear(x, w, gated=True, out=nan_out((M, F), dtype))
    check(out, linear_naive(x, w, gated=True), dtype)
    # ... and what the unfused model computes: silu(gate(x)) * up(x)
    g, u = (x.float() @ w.float().T).chunk(2, -1)
    check(out, torch.nn.functional.silu(g) * u, dtype)


@pytest.mark.parametrize("split", [2, 3, 4])
@pytest.mark.parametrize("gated", [False, True])
def test_split_k_reduces_in_kernel_and_resets_counters(split, gated):
    dtype = torch.float32
    M, N, K = 5, 70, 200  # K = 7 steps of 32: uneven slices; split 4 leaves the last slice empty
    x, w, b, r = make(M, N, K, dtype, gated=gated)
    counters = torch.zeros(counters_needed(N), dtype=torch.int32, device=DEV)
    cfg = {"BLOCK_N": 16, "BLOCK_K": 32, "SPLIT_K": split, "num_warps": 4, "num_stages": 1}
    kw = {"gated": True} if gated else {"bias": b, "residual": r}
    ref = linear_naive(x, w, **kw)
    for _ in range(2):  # twice through the same counters: the first call must leave them at zero
        out = linear(x, w, **kw, out=nan_out((M, N), dtype), counters=counters, config=cfg)
        check(out, ref, dtype)
        assert int(counters.abs().sum()) == 0
    # Without counters the op allocates its own zeroed ones.
    check(linear(x, w, **kw, config=cfg), ref, dtype)


def test_pinned_tiles_agree_with_the_default():
    x, w, b, r = make(12, 100, 96, torch.float32)
    ref = linear(x, w, b, residual=r)
    for cfg in ({"BLOCK_N": 32, "BLOCK_K": 64, "SPLIT_K": 1}, {"BLOCK_N": 64, "BLOCK_K": 16, "SPLIT_K": 2}):
        out = linear(x, w, b, residual=r, out=nan_out((12, 100), torch.float32), config=cfg)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(DEV == "cpu" and not blas_rows_placed_alike(), reason=BLAS_ROWS_REASON)
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("split", [1, 3])
def test_a_rows_bits_do_not_depend_on_the_other_rows(gated, split):
    """Batch invariance (issue #44): one row's output, bit for bit, alone and at any place among 1 to 129 other
    rows (one row tile and three), with split-K's partials added in split order whoever finishes last."""
    dtype = torch.float32
    N, K = 70, 200
    x, w, b, r = make(130, N, K, dtype, gated=gated)
    cfg = {"BLOCK_N": 32, "BLOCK_K": 64, "SPLIT_K": split, "num_warps": 4, "num_stages": 1}
    kw = {"gated": True} if gated else {"bias": b}
    row = x[:1]
    alone = linear(row, w, **kw, config=cfg)
    for M, at in [(2, 1), (7, 3), (64, 63), (65, 64), (130, 0), (130, 77), (130, 129)]:
        batch = x[:M].clone()
        batch[at] = row[0]
        out = linear(batch, w, **kw, out=nan_out((M, N), dtype), config=cfg)
        assert torch.equal(out[at], alone[0]), (M, at)
        assert not out.isnan().any()


def test_leading_dims_and_strided_rows():
    x, w, b, r = make(0, 56, 48, torch.float16, lead=(3, 5))
    out = linear(x, w, b, residual=r)
    assert out.shape == (3, 5, 56)
    check(out, linear_naive(x, w, b, residual=r), torch.float16)
    wide = torch.randn(3, 5, 80, device=DEV, dtype=torch.float16)
    xs = wide[..., 10:58]  # rows with a stride of 80
    check(linear(xs, w), linear_naive(xs, w), torch.float16)


def test_many_rows_fall_back_with_the_same_contract():
    M = MAX_ROWS + 3
    x, w, b, r = make(M, 40, 32, torch.float32)
    check(linear(x, w, b, residual=r, out=nan_out((M, 40), torch.float32)), linear_naive(x, w, b, residual=r),
          torch.float32)  # fmt: skip
    xg, wg, _, _ = make(M, 20, 32, torch.float32, gated=True)
    check(linear(xg, wg, gated=True), linear_naive(xg, wg, gated=True), torch.float32)


def test_rejects_what_it_cannot_do():
    x, w, b, r = make(4, 32, 16, torch.float32)
    with pytest.raises(ValueError, match="weight"):
        linear(x, w.T.contiguous())
    with pytest.raises(ValueError, match="share"):
        linear(x, w.half())
    with pytest.raises(ValueError, match="gated"):
        linear(x, w[:31], gated=True)
    with pytest.raises(ValueError, match="residual"):
        linear(x, w, residual=r[:, :8])
    with pytest.raises(ValueError, match="counters"):
        linear(x, w, counters=torch.zeros(1, dtype=torch.int64, device=DEV))


@pytest.mark.parametrize("element_bytes", [4, 2])
@pytest.mark.parametrize("gated", [True, False])
def test_every_tuned_config_is_fitted_to_the_gpus_shared_memory(element_bytes, gated):
    """fp32 weights need twice a config's bytes: on an H100 / H200 (232,448 B a program) every gated config ran out
    of shared memory in fp32 (Triton refused 294,912 B), so `serve --dtype float32` failed at warm-up. Each config
    comes back fitted (fewer stages, then shallower K steps), one that fits as it was, and none is lost for 16 bits."""
    from tether.kernels.linear.kernel import fit_shared, shared_bytes, tuned_configs  # noqa: PLC0415

    limit, configs = 232_448, tuned_configs()
    assert shared_bytes(configs[0], 4, True) == 294_912  # the config Triton refused, as the estimate counts it
    fitted = fit_shared(configs, element_bytes, gated, limit)
    assert fitted and all(shared_bytes(c, element_bytes, gated) <= limit for c in fitted)
    fits = [c for c in configs if shared_bytes(c, element_bytes, gated) <= limit]
    assert all(any(f is c for f in fitted) for c in fits)  # those that fit are kept as they are
    assert len({(tuple(sorted(c.kwargs.items())), c.num_warps, c.num_stages) for c in fitted}) == len(fitted)
    if element_bytes == 2:
        assert len(fitted) >= len(fits) >= len(configs) - 2
