"""Helpers every Triton op in tether.kernels shares: the device flag, host-side tile arithmetic, input
normalisation, autotuner options and the online-softmax step. Written once here, imported by the op folders.

Contract:
- `interpreting()`: whether Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1), read at each call, so
  a test that sets the variable (or patches this function) is seen by the next launch. The server reads it through
  this module only (tether.server.model_loading, tether.server.engine_core).
- `pow2`, `cdiv`: host-side integer helpers for launch grids and tile sizes. triton.next_power_of_2 / triton.cdiv
  are JIT functions whose Python calls cost microseconds, and these run once per layer per decode step.
- `last_dim_contiguous(x)`: x itself when its last stride is 1 (or x is None), else a contiguous copy; every
  kernel here indexes the last dim with unit stride.
- `FLOAT_DTYPES`, `dot_precision(dtype)`: the dtypes the kernels take, and the `input_precision` of their dots:
  "ieee" for fp32 (exact fp32 products, as the fp32 references compute; never TF32), "tf32" otherwise (which 16-bit
  dots ignore).
- `AUTOTUNE_CACHE`: keyword arguments for triton.autotune that keep its tuning results in Triton's disk cache where
  this Triton can (3.2+), so a restarted server skips the benchmarking (tether.server.warm_cache).
- `online_softmax_step` (JIT): one block of the flash-attention online softmax in base 2 with fp32 state; both
  MoDA kernels (moda/prefill.py, moda/verify.py) fold every key block through it.

Tests: the ops' own (`TRITON_INTERPRET=1 .venv/bin/python -m pytest -q tests/kernels`).
"""

from __future__ import annotations

import inspect
import os

import torch
import triton
import triton.language as tl
from torch import Tensor

LOG2E = 1.4426950408889634  # log2(e): the kernels take exp2 of scores scaled by scale * LOG2E
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
AUTOTUNE_CACHE = {"cache_results": True} if "cache_results" in inspect.signature(triton.autotune).parameters else {}


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


def pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, n - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for integers, b > 0."""
    return -(-a // b)


def last_dim_contiguous(x: Tensor | None) -> Tensor | None:
    """x with a unit last stride: x itself when it has one (or is None), else a contiguous copy."""
    return x if x is None or x.stride(-1) == 1 else x.contiguous()


def dot_precision(dtype: torch.dtype) -> str:
    """The `input_precision` of a kernel's dots for inputs of `dtype`: exact for fp32, tensor cores otherwise."""
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def online_softmax_step(s, v, m_i, l_i, acc, PREC: tl.constexpr):
    """Fold one block of base-2 scores s [BLOCK_M, BLOCK_N] (-inf where a key is not visible) and its values
    v [BLOCK_N, BLOCK_D] into the running max m_i, denominator l_i [BLOCK_M] and numerator acc [BLOCK_M, BLOCK_D]
    (all fp32). P is cast to v's dtype for the PV dot, as the references do. A row that has seen no key yet keeps
    m = -inf and 0 / 0 state (never NaN), so a caller can tell it apart by l_i == 0."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
    return m_new, l_i, acc
