"""The model's attention backend built on the MoDA kernels.

- `moda_attention` (prefill.py): prefill / full sequence, causal, optional cached prefix.
- `moda_verify` (verify.py): a few new tokens (causal or a tree) against a paged cache, split-K.
- `moda_backend`: tether.shared.attention's backend contract served by those kernels. The server registers it as
  "triton" on CUDA (tether.server.generate.attention_backend); the model never imports it.

Dispatch in `moda_backend`, for inputs the kernels take (CUDA or the CPU interpreter, fp16 / bf16 / fp32, D <= 256,
no gradients: the kernels have no backward):
- a tree mask among the new tokens ([Tq, Tq] or [B, Tq, Tq]), or up to 64 causal new tokens after a prefix of
  >= 512 cached rows: `moda_verify`, reading the contiguous cache rows in place as pages of one position (its
  split-K fills the GPU where the prefill kernel would run one program per head over the whole prefix);
- otherwise causal: `moda_attention`;
- anything else (a mask over the whole key range, gradients, another device): the PyTorch reference.

    from tether.kernels.moda import moda_backend
    register_backend("triton", moda_backend)
"""

from __future__ import annotations

import torch
from torch import Tensor

from tether.kernels.moda.prefill import moda_attention
from tether.kernels.moda.verify import moda_verify
from tether.kernels.utils import FLOAT_DTYPES, interpreting
from tether.shared.attention import moda_attention_reference

__all__ = ["as_pages", "kernel_supports", "moda_backend"]

VERIFY_MAX_TQ = 64  # new tokens up to which a causal continuation goes to the split-K verify kernel
VERIFY_MIN_PREFIX = 512  # cached rows from which it does (shorter prefixes are not split)


def kernel_supports(q: Tensor) -> bool:
    """Whether the kernels can run on q's device in this process (CUDA, or the Triton CPU interpreter)."""
    return (q.is_cuda or (interpreting() and q.device.type == "cpu")) and q.dtype in FLOAT_DTYPES


def as_pages(k: Tensor) -> tuple[Tensor, Tensor] | None:
    """A cache's rows k [B, Tk, Hkv, D] (a prefix view of a [B, capacity, Hkv, D] buffer is fine) seen as the
    verify kernel's pages of one position, without a copy: (pages [N, 1, Hkv, D], block table [B, Tk] int32).
    None when the rows are not laid out as such a buffer."""
    B, Tk, Hkv, D = k.shape
    row = Hkv * D
    if k.stride(3) != 1 or k.stride(2) != D or k.stride(1) != row or (B > 1 and k.stride(0) % row):
        return None
    per_seq = k.stride(0) // row if B > 1 else Tk  # positions between two sequences in the buffer
    pages = k.as_strided(((B - 1) * per_seq + Tk, 1, Hkv, D), (row, row, D, 1))
    table = (
        torch.arange(Tk, device=k.device, dtype=torch.int32)
        + per_seq * torch.arange(B, device=k.device, dtype=torch.int32)[:, None]
    )
    return pages, table


def _verify_path(q, k, v, depth_k, depth_v, scale, tree_mask) -> Tensor | None:
    B, Tq = q.shape[:2]
    Tk = k.shape[1]
    if k.stride() != v.stride():
        return None
    paged_k, paged_v = as_pages(k), as_pages(v)
    if paged_k is None or paged_v is None:
        return None
    lens = torch.full((B,), Tk, device=q.device, dtype=torch.int32)
    q_lens = torch.full((B,), Tq, device=q.device, dtype=torch.int32)
    mask = None if tree_mask is None else tree_mask.to(device=q.device, dtype=torch.bool)
    return moda_verify(
        q, paged_k[0], paged_v[0], paged_k[1], lens, q_lens, depth_k, depth_v, tree_mask=mask, scale=scale
    )


def moda_backend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    depth_k: Tensor | None = None,
    depth_v: Tensor | None = None,
    *,
    scale: float | None = None,
    tree_mask: Tensor | None = None,
) -> Tensor:
    """The model's attention backend contract (tether.shared.attention) served by the Triton kernels; see the
    module docstring for which kernel takes which call."""
    Tq, Tk = q.shape[1], k.shape[1]
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, depth_k, depth_v))
    same_dtype = all(t is None or t.dtype == q.dtype for t in (k, v, depth_k, depth_v))
    runnable = not needs_grad and same_dtype and kernel_supports(q) and q.shape[-1] <= 256 and Tk >= Tq
    if runnable:
        local_tree = tree_mask is not None and tree_mask.shape[-2:] == (Tq, Tq) and tree_mask.dim() in (2, 3)
        decode = tree_mask is None and Tq <= VERIFY_MAX_TQ and Tk - Tq >= VERIFY_MIN_PREFIX
        if local_tree or decode:
            o = _verify_path(q, k, v, depth_k, depth_v, scale, tree_mask)
            if o is not None:
                return o
        if tree_mask is None:
            return moda_attention(q, k, v, depth_k, depth_v, causal=True, scale=scale)
    return moda_attention_reference(q, k, v, depth_k, depth_v, scale=scale, tree_mask=tree_mask)
