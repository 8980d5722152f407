"""moda_backend's dispatch (tether.kernels.moda.backend): tree masks and short continuations after a long prefix go to
the split-K verify kernel reading the contiguous cache in place, other causal calls to the prefill kernel, the rest
to the reference; each against the reference on the same inputs. CPU: Triton's interpreter (TRITON_INTERPRET=1)."""

import os

import pytest
import torch

from tether.kernels.moda import backend as moda_ops
from tether.shared.attention import moda_attention_reference
from tether.shared.speculative import DraftTree

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton kernels need CUDA or TRITON_INTERPRET=1",
)
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def rel_rms(a, b):
    a, b = a.float(), b.float()
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt()).item()


def cache_inputs(B, Tq, prefix, Hq, Hkv, D, L, capacity, dtype=torch.float32, seed=0):
    """q and depth for Tq new tokens; keys/values as the model passes them from a KVCache: the first prefix + Tq
    rows of a [B, capacity, Hkv, D] buffer (NaN past them, so a read beyond the rows shows)."""
    g = torch.Generator().manual_seed(seed)
    Tk = prefix + Tq
    buf_k = torch.full((B, capacity, Hkv, D), float("nan"))
    buf_v = torch.full((B, capacity, Hkv, D), float("nan"))
    buf_k[:, :Tk], buf_v[:, :Tk] = torch.randn(B, Tk, Hkv, D, generator=g), torch.randn(B, Tk, Hkv, D, generator=g)
    q = torch.randn(B, Tq, Hq, D, generator=g)
    dk, dv = torch.randn(B, Tq, L, Hkv, D, generator=g), torch.randn(B, Tq, L, Hkv, D, generator=g)
    to = lambda t: t.to(DEV, dtype)  # noqa: E731
    return to(q), to(buf_k)[:, :Tk], to(buf_v)[:, :Tk], to(dk), to(dv)


@pytest.fixture
def routes(monkeypatch) -> list[str]:
    """Which kernel each moda_backend call ran."""
    taken = []
    for name in ("moda_attention", "moda_verify"):
        fn = getattr(moda_ops, name)
        monkeypatch.setattr(moda_ops, name, lambda *a, _f=fn, _n=name, **kw: taken.append(_n) or _f(*a, **kw))
    return taken


@pytest.mark.parametrize("batched_mask", [False, True], ids=["shared_mask", "per_row_mask"])
def test_tree_mask_runs_the_verify_kernel_in_place(routes, batched_mask):
    B, Tq, prefix = 2, 7, 40
    q, k, v, dk, dv = cache_inputs(B, Tq, prefix, Hq=8, Hkv=2, D=64, L=5, capacity=63)
    parents = [torch.tensor([-1, 0, 0, 1, 1, 2, 5]), torch.tensor([-1, 0, 1, 2, 0, 4, 4])]
    masks = [DraftTree(tokens=torch.zeros(Tq, dtype=torch.long), parents=p).ancestor_mask() for p in parents]
    mask = (torch.stack(masks) if batched_mask else masks[0]).to(DEV)
    o = moda_ops.moda_backend(q, k, v, dk, dv, scale=0.3, tree_mask=mask)
    assert routes == ["moda_verify"]
    assert torch.isfinite(o).all()
    assert rel_rms(o, moda_attention_reference(q, k, v, dk, dv, scale=0.3, tree_mask=mask)) < 5e-3


def test_short_continuation_after_a_long_prefix_runs_the_verify_kernel(routes):
    Tq, prefix = 3, moda_ops.VERIFY_MIN_PREFIX + 13
    q, k, v, dk, dv = cache_inputs(1, Tq, prefix, Hq=4, Hkv=4, D=32, L=2, capacity=prefix + 20)
    o = moda_ops.moda_backend(q, k, v, dk, dv)
    assert routes == ["moda_verify"]
    assert rel_rms(o, moda_attention_reference(q, k, v, dk, dv)) < 5e-3


def test_short_prefix_and_long_chunks_run_the_prefill_kernel(routes):
    q, k, v, dk, dv = cache_inputs(2, 5, 30, Hq=4, Hkv=2, D=32, L=3, capacity=40)
    assert rel_rms(moda_ops.moda_backend(q, k, v, dk, dv), moda_attention_reference(q, k, v, dk, dv)) < 5e-3
    q, k, v, dk, dv = cache_inputs(1, moda_ops.VERIFY_MAX_TQ + 1, moda_ops.VERIFY_MIN_PREFIX, Hq=2, Hkv=1, D=16, L=0,
                                   capacity=700)  # fmt: skip
    assert rel_rms(moda_ops.moda_backend(q, k, v, dk, dv), moda_attention_reference(q, k, v, dk, dv)) < 5e-3
    assert routes == ["moda_attention", "moda_attention"]


def test_rows_not_laid_out_as_a_cache_fall_back(routes):
    """Keys that are not rows of a [B, capacity, Hkv, D] buffer (here, head-major) cannot be paged in place: a tree
    mask then goes to the reference."""
    q, k, v, dk, dv = cache_inputs(1, 4, 9, Hq=4, Hkv=2, D=16, L=1, capacity=13)
    k_hm = k.transpose(1, 2).contiguous().transpose(1, 2)  # same values, [B, Hkv, T, D] memory
    mask = torch.ones(4, 4, dtype=torch.bool, device=DEV).tril()
    o = moda_ops.moda_backend(q, k_hm, v, dk, dv, tree_mask=mask)
    assert routes == []
    torch.testing.assert_close(o, moda_attention_reference(q, k, v, dk, dv, tree_mask=mask))


def test_as_pages_addresses_every_row():
    _, k, _, _, _ = cache_inputs(3, 2, 5, Hq=2, Hkv=2, D=8, L=0, capacity=11)
    pages, table = moda_ops.as_pages(k)
    assert table.shape == (3, 7) and pages.shape[1] == 1
    torch.testing.assert_close(pages[table.long(), 0], k)  # [B, Tk, Hkv, D] gathered back, no NaN read
