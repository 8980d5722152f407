"""Fused pointwise ops (tether.kernels.pointwise), one launch each. kernel.py: `rope` (<- `rope_fwd` <-
`rope_fwd_kernel`) and `silu_mul` (<- `silu_mul_fwd` <- `silu_mul_fwd_kernel`); naive.py: `rope_naive`,
`silu_mul_naive`, the tests' references."""

from tether.kernels.pointwise.kernel import rope, rope_fwd, silu_mul, silu_mul_fwd

__all__ = ["rope", "rope_fwd", "silu_mul", "silu_mul_fwd"]
