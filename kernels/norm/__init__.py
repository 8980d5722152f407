"""Fused RMSNorm (tether.kernels.norm), optionally after the residual add, in one launch. kernel.py: `rms_norm`
(<- `rms_norm_fwd` <- `rms_norm_fwd_kernel`); naive.py: `rms_norm_naive`, the tests' reference."""

from tether.kernels.norm.kernel import rms_norm, rms_norm_fwd

__all__ = ["rms_norm", "rms_norm_fwd"]
