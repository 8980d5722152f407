"""The "flex" training attention is MoDA attention: the same output and gradients as the reference, from a sequence
part and its log-sum-exp merged with the depth part; flex_attention's own output and log-sum-exp match the
PyTorch sequence part; on CUDA (skipped elsewhere) the compiled kernel's gradients match too, and what one call
keeps for backward grows linearly in T, not as T x T."""

import pytest
import torch

from tether.server.train.attention import causal_attention_lse, flex_attention_lse, moda_attention_flex
from tether.shared.attention import moda_attention_reference

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled flex kernel needs CUDA")


def _inputs(B=2, T=37, Hq=6, Hkv=2, D=16, L=3, device="cpu", seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    shapes = [(B, T, Hq, D), (B, T, Hkv, D), (B, T, Hkv, D), (B, T, L, Hkv, D), (B, T, L, Hkv, D)]
    return [torch.randn(*s, generator=g, device=device).requires_grad_() for s in shapes]


def _value_and_grads(fn, inputs, **kw):
    out = fn(*inputs, **kw)
    weights = torch.randn(out.shape, generator=torch.Generator(out.device).manual_seed(1), device=out.device)
    return out, torch.autograd.grad((out * weights).sum(), inputs, allow_unused=True)  # L = 0: depth unused


@pytest.mark.parametrize("L", [3, 0])
def test_merge_matches_the_reference_in_value_and_gradient(L):
    inputs = _inputs(L=L)
    want, want_grads = _value_and_grads(moda_attention_reference, inputs, scale=0.3)
    got, grads = _value_and_grads(moda_attention_flex, inputs, scale=0.3)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for name, g, w in zip(("q", "k", "v", "depth_k", "depth_v"), grads, want_grads, strict=True):
        if L == 0 and name.startswith("depth"):
            assert g is None and w is None  # no depth entries: nothing to differentiate
        else:
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, msg=name)


def test_calls_outside_causal_self_attention_defer_to_the_reference():
    q, k, v, dk, dv = (t.detach() for t in _inputs(T=8))
    tree = torch.rand(8, 8, generator=torch.Generator().manual_seed(2)) < 0.5
    tree |= torch.eye(8, dtype=torch.bool)
    torch.testing.assert_close(moda_attention_flex(q, k, v, dk, dv, tree_mask=tree),
                               moda_attention_reference(q, k, v, dk, dv, tree_mask=tree))  # fmt: skip
    prefix_k, prefix_v = torch.cat([k, k], 1), torch.cat([v, v], 1)  # a cached prefix: Tk > Tq
    torch.testing.assert_close(moda_attention_flex(q, prefix_k, prefix_v, dk, dv),
                               moda_attention_reference(q, prefix_k, prefix_v, dk, dv))  # fmt: skip


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_attention_gives_the_sequence_part_and_its_natural_log_sum_exp():
    q, k, v, _, _ = (t.detach().transpose(1, 2) for t in _inputs(T=45))  # [B, H, T, D]
    want_out, want_lse = causal_attention_lse(q, k, v, 0.25)
    out, lse = flex_attention_lse(q, k, v, 0.25)
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)


@cuda
def test_the_compiled_kernel_matches_the_reference_on_cuda():
    inputs = _inputs(T=300, Hq=12, Hkv=4, D=64, L=5, device="cuda")
    want, want_grads = _value_and_grads(moda_attention_reference, inputs)
    got, grads = _value_and_grads(moda_attention_flex, inputs)
    torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)
    for g, w in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=2e-3, atol=2e-3)


@cuda
def test_what_one_call_keeps_for_backward_grows_linearly_in_t():
    def saved_bytes(T: int) -> int:
        total = 0

        def pack(t):
            nonlocal total
            total += t.numel() * t.element_size()
            return t

        inputs = _inputs(B=1, T=T, Hq=12, Hkv=4, D=64, L=22, device="cuda")
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            moda_attention_flex(*inputs)
        return total

    ratio = saved_bytes(2048) / saved_bytes(1024)
    assert ratio < 2.2  # the reference keeps several [B, H, T, T] scores: a ratio near 4
