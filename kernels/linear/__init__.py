"""Skinny linear layers (tether.kernels.linear): y = x @ W^T for a step's few rows at the HBM's pace, with the bias,
residual add or SwiGLU activation in the epilogue. kernel.py: `linear` (<- `linear_fwd` <- `linear_fwd_kernel`);
naive.py: `linear_naive`, the tests' reference."""

from tether.kernels.linear.kernel import MAX_ROWS, counters_needed, linear, linear_fwd, linear_fwd_kernel_autotuned

__all__ = ["MAX_ROWS", "counters_needed", "linear", "linear_fwd", "linear_fwd_kernel_autotuned"]
