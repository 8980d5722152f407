"""The MoDA prefill kernel against its naive reference and the model's reference backend.

Runs on a GPU, or on the CPU under Triton's interpreter (TRITON_INTERPRET=1, as `make test` sets it).
Every kernel call writes into a NaN-filled `out`, so an element the kernel fails to write fails the test.
"""

import os

import pytest
import torch

pytest.importorskip("triton")

if not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"):
    pytest.skip("needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)

from tether.kernels.moda import moda_attention, moda_attention_fwd, moda_backend  # noqa: E402
from tether.kernels.moda.naive import moda_attention_naive  # noqa: E402
from tether.shared import attention  # noqa: E402
from tether.shared.attention import moda_attention_reference  # noqa: E402
from tether.shared.model import DepthStream  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
TOL = 5e-3


def rel_rms(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.float(), ref.float()
    return ((out - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item()


def inputs(B, T, Hq, Hkv, D, L, dtype, *, Tk=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    Tk = T if Tk is None else Tk

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(device=DEVICE, dtype=dtype)

    # a few large query rows make the softmax peaky, so a misplaced key shows
    q = rnd(B, T, Hq, D) * 1.5
    return q, rnd(B, Tk, Hkv, D), rnd(B, Tk, Hkv, D), rnd(B, T, L, Hkv, D), rnd(B, T, L, Hkv, D)


def run_op(q, *args, **kw):
    """moda_attention into a NaN-filled output; checks every element was written."""
    out = torch.full_like(q, float("nan"))
    o = moda_attention(q, *args, out=out, **kw)
    assert o is out
    assert torch.isfinite(o).all(), f"{(~torch.isfinite(o)).sum().item()} elements not written"
    return o


# (B, T, Hq, Hkv, D, L, dtype)
CASES = [
    (2, 63, 2, 2, 64, 5, torch.float32),  # G = 1
    (1, 63, 4, 2, 128, 13, torch.float16),  # G = 2, D = 128
    (1, 130, 4, 1, 64, 1, torch.float32),  # G = 4
    (1, 63, 8, 1, 64, 0, torch.float16),  # G = 8, no depth
    (1, 130, 16, 2, 32, 13, torch.float16),  # G = 8, two KV heads
    (1, 17, 6, 2, 12, 2, torch.float32),  # G = 3, D = 12 (the tiny preset's head dim): padded head dim
    (2, 1, 4, 4, 16, 13, torch.float32),  # one token
    (1, 1025, 1, 1, 64, 5, torch.float16),  # long tail
]


@pytest.mark.parametrize("B,T,Hq,Hkv,D,L,dtype", CASES, ids=lambda x: str(x).replace("torch.", ""))
def test_matches_naive(B, T, Hq, Hkv, D, L, dtype):
    q, k, v, dk, dv = inputs(B, T, Hq, Hkv, D, L, dtype)
    o = run_op(q, k, v, dk, dv)
    ref = moda_attention_naive(q.float(), k.float(), v.float(), dk.float(), dv.float())
    assert o.dtype == dtype and o.shape == q.shape
    assert rel_rms(o, ref) < TOL


@pytest.mark.skipif(INTERPRET, reason="bf16 is not emulated faithfully by the Triton interpreter")
def test_bf16():
    q, k, v, dk, dv = inputs(1, 130, 8, 2, 128, 13, torch.bfloat16)
    ref = moda_attention_naive(q.float(), k.float(), v.float(), dk.float(), dv.float())
    assert rel_rms(run_op(q, k, v, dk, dv), ref) < TOL


GPU_CASES = [
    (2, 1025, 32, 8, 128, 13),  # G = 4
    (1, 4099, 16, 2, 64, 32),  # G = 8, D = 64
    (2, 777, 8, 8, 128, 0),  # G = 1, no depth
    (1, 2049, 32, 4, 128, 64),  # deep
]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="larger bf16 shapes run on a GPU")
@pytest.mark.parametrize("B,T,Hq,Hkv,D,L", GPU_CASES, ids=str)
def test_bf16_large_on_gpu(B, T, Hq, Hkv, D, L):
    q, k, v, dk, dv = inputs(B, T, Hq, Hkv, D, L, torch.bfloat16)
    ref = moda_attention_naive(q.float(), k.float(), v.float(), dk.float(), dv.float())
    out = moda_attention(q, k, v, dk, dv)
    assert torch.isfinite(out).all()
    assert rel_rms(out, ref) < TOL


@pytest.mark.skipif(not torch.cuda.is_available(), reason="larger bf16 shapes run on a GPU")
def test_bf16_varlen_on_gpu():
    cu = torch.tensor([0, 1, 1025, 1030, 3100], dtype=torch.int32, device=DEVICE)
    q, k, v, dk, dv = inputs(1, 3100, 32, 8, 128, 16, torch.bfloat16, seed=3)
    o = moda_attention(q, k, v, dk, dv, cu_seqlens=cu)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        ref = moda_attention_naive(*(t[:, a:b].float() for t in (q, k, v, dk, dv)))
        assert rel_rms(o[:, a:b], ref) < TOL


def test_no_depth_is_plain_causal_attention():
    q, k, v, dk, dv = inputs(1, 40, 4, 2, 32, 0, torch.float32)
    o_none = run_op(q, k, v, None, None)
    o_empty = run_op(q, k, v, dk, dv)  # [B, T, 0, Hkv, D]
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
    ).transpose(1, 2)
    assert rel_rms(o_none, ref) < TOL
    assert torch.equal(o_none, o_empty)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_varlen(dtype):
    # uneven lengths, including a one-token and an empty sequence; T = 130 packed tokens
    cu = torch.tensor([0, 1, 38, 38, 45, 130], dtype=torch.int32, device=DEVICE)
    q, k, v, dk, dv = inputs(1, 130, 4, 2, 64, 5, dtype, seed=1)
    o = run_op(q, k, v, dk, dv, cu_seqlens=cu)
    ref = moda_attention_naive(q.float(), k.float(), v.float(), dk.float(), dv.float(), cu_seqlens=cu)
    assert rel_rms(o, ref) < TOL
    # each sequence alone gives the same rows: nothing leaks across sequence boundaries
    bounds = cu.tolist()
    for bos, eos in zip(bounds[:-1], bounds[1:], strict=True):
        if eos > bos:
            s = slice(bos, eos)
            alone = run_op(q[:, s], k[:, s], v[:, s], dk[:, s], dv[:, s])
            assert rel_rms(o[:, s], alone) < 1e-5


@pytest.mark.parametrize("block_m,block_n", [(16, 16), (16, 64), (64, 16), (32, 64)])
def test_tile_shapes(block_m, block_n):
    """Tile sizes other than the autotuned one: causal boundaries, GQA groups split across tiles, depth slices
    longer and shorter than BLOCK_N, a cached prefix that is not a multiple of BLOCK_N."""
    q, k, v, dk, dv = inputs(1, 45, 6, 2, 32, 7, torch.float32, Tk=62, seed=2)
    out = torch.full_like(q, float("nan"))
    o = moda_attention_fwd(q, k, v, dk, dv, 0.3, config={"BLOCK_M": block_m, "BLOCK_N": block_n}, out=out)
    ref = moda_attention_naive(q, k, v, dk, dv, scale=0.3)
    assert torch.isfinite(o).all()
    assert rel_rms(o, ref) < TOL


@pytest.mark.parametrize("prefix", [14, 15, 16])
def test_prefix_at_block_edges(prefix):
    """A tile's first position sees keys up to t0 + prefix: that edge just before, on and after a key block end."""
    q, k, v, dk, dv = inputs(1, 40, 2, 2, 16, 2, torch.float32, Tk=40 + prefix, seed=7)
    out = torch.full_like(q, float("nan"))
    o = moda_attention_fwd(q, k, v, dk, dv, 0.25, config={"BLOCK_M": 16, "BLOCK_N": 16}, out=out)
    assert rel_rms(o, moda_attention_naive(q, k, v, dk, dv, scale=0.25)) < TOL


def test_prefix_and_non_causal():
    q, k, v, dk, dv = inputs(2, 23, 4, 2, 64, 5, torch.float16, Tk=70, seed=3)
    ref = moda_attention_naive(q.float(), k.float(), v.float(), dk.float(), dv.float())
    assert rel_rms(run_op(q, k, v, dk, dv), ref) < TOL
    ref_full = moda_attention_naive(q.float(), k.float(), v.float(), dk.float(), dv.float(), causal=False)
    assert rel_rms(run_op(q, k, v, dk, dv, causal=False), ref_full) < TOL


def test_naive_is_the_definition():
    """kernels/moda/naive.py is tether.shared.attention's reference (the one MoDA reference, which tests/shared holds
    to the definition spelt out); what it adds, no causal mask and packed sequences, is held to that definition
    here: moda_attention_bruteforce over all the keys, and over each packed sequence alone."""
    brute = attention.moda_attention_bruteforce
    q, k, v, dk, dv = inputs(2, 19, 6, 2, 16, 4, torch.float32, Tk=30, seed=4)
    assert rel_rms(moda_attention_naive(q, k, v, dk, dv, scale=0.2), brute(q, k, v, dk, dv, scale=0.2)) < 1e-5
    everything = torch.ones(19, 30, dtype=torch.bool, device=DEVICE)
    full = moda_attention_naive(q, k, v, dk, dv, scale=0.2, causal=False)
    assert rel_rms(full, brute(q, k, v, dk, dv, scale=0.2, tree_mask=everything)) < 1e-5
    q, k, v, dk, dv = inputs(1, 23, 4, 2, 16, 3, torch.float32, seed=8)
    packed = moda_attention_naive(q, k, v, dk, dv, cu_seqlens=torch.tensor([0, 9, 23], dtype=torch.int32))
    for a, b in ((0, 9), (9, 23)):
        assert rel_rms(packed[:, a:b], brute(*(t[:, a:b] for t in (q, k, v, dk, dv)))) < 1e-5


@pytest.mark.parametrize("prefix", [0, 9], ids=["prefill", "cached_prefix"])
def test_backend_contract(prefix):
    """moda_backend called as the model calls a backend: cache rows as keys (a prefix view of a larger buffer),
    depth from a DepthStream buffer (a strided view [B, T, n, Hkv, D] of [B, T, capacity, Hkv, D])."""
    B, T, Hq, Hkv, D, L = 2, 21, 4, 2, 32, 5
    q, k, v, dk, dv = inputs(B, T, Hq, Hkv, D, L, torch.float32, Tk=prefix + T, seed=5)
    cache_k = torch.zeros(B, prefix + T + 7, Hkv, D, device=DEVICE)
    cache_v = torch.zeros_like(cache_k)
    cache_k[:, : prefix + T], cache_v[:, : prefix + T] = k, v
    stream = DepthStream(k[:, :T], capacity=L + 3, grad=False)
    for i in range(L):
        stream.append(dk[:, :, i], dv[:, :, i])
    depth_k, depth_v = stream.read()
    assert not depth_k.is_contiguous()
    keys, vals = cache_k[:, : prefix + T], cache_v[:, : prefix + T]
    o = moda_backend(q, keys, vals, depth_k, depth_v, scale=D**-0.5)
    ref = moda_attention_reference(q, keys, vals, depth_k, depth_v, scale=D**-0.5)
    assert rel_rms(o, ref) < TOL
    # layer 0 reads no depth: (None, None)
    o0 = moda_backend(q, keys, vals, None, None, scale=D**-0.5)
    assert rel_rms(o0, moda_attention_reference(q, keys, vals, None, None, scale=D**-0.5)) < TOL


def test_backend_falls_back():
    """A mask over the whole key range and inputs that need gradients go to the reference."""
    q, k, v, dk, dv = inputs(1, 12, 4, 2, 16, 3, torch.float32, Tk=20, seed=6)
    full = torch.rand(12, 20, generator=torch.Generator().manual_seed(0)) < 0.5
    full[:, 8:] |= torch.eye(12, dtype=torch.bool)
    full = full.to(DEVICE)
    o = moda_backend(q, k, v, dk, dv, scale=0.25, tree_mask=full)
    torch.testing.assert_close(o, moda_attention_reference(q, k, v, dk, dv, scale=0.25, tree_mask=full))
    qg = q.clone().requires_grad_()
    moda_backend(qg, k, v, dk, dv, scale=0.25).sum().backward()  # the kernel has no backward: reference
    assert qg.grad is not None and torch.isfinite(qg.grad).all()


def test_model_with_kernel_backend(monkeypatch):
    """The tiny MoDA model gives the same logits with the kernels as its "triton" backend: prefill into a cache
    and a causal continuation against it (the prefill kernel), then a tree verify (the verify kernel, reading the
    cache's rows in place)."""
    from tiny_models import tiny_target

    from tether.kernels.moda import backend as moda_ops
    from tether.kernels.moda import moda_verify

    monkeypatch.setitem(attention._BACKENDS, "triton", moda_backend)
    kernel_calls = []

    def counted_prefill(*args, **kw):
        kernel_calls.append(("prefill", args[3] is not None))  # whether this layer had depth keys
        return moda_attention(*args, **kw)

    def counted_verify(*args, **kw):
        kernel_calls.append(("verify", args[6] is not None))
        return moda_verify(*args, **kw)

    monkeypatch.setattr(moda_ops, "moda_attention", counted_prefill)
    monkeypatch.setattr(moda_ops, "moda_verify", counted_verify)
    model = tiny_target(seed=1).to(DEVICE)
    ids = torch.randint(0, model.cfg.vocab_size, (2, 29), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    tree = torch.ones(4, 4, dtype=torch.bool, device=DEVICE).tril()
    tree[3, 2] = False
    logits = {}
    for backend in ("reference", "triton"):
        model.backend = backend
        with torch.no_grad():
            cache = model.new_cache(batch_size=2)
            pre = model.prefill(ids[:, :20], cache).logits
            more = model.prefill(ids[:, 20:25], cache).logits
            ver = model.verify(ids[:, 25:], cache, tree_mask=tree).logits
        logits[backend] = (pre, more, ver)
    for ref, got in zip(logits["reference"], logits["triton"], strict=True):
        assert rel_rms(got, ref) < 1e-4
    # every layer of every forward ran a kernel (layer 0 without depth)
    depth = [False, True, True]
    assert kernel_calls == [("prefill", d) for d in depth] * 2 + [("verify", d) for d in depth]
