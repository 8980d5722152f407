"""tether.kernels: the server's Triton kernels, one folder per op, each op beside its pure-PyTorch reference.

- moda/: Mixture-of-Depths Attention. prefill.py (`moda_attention`: prefill / full sequence, causal, optional cached
  prefix), verify.py (`moda_verify`: a few new tokens against the paged KV pool, split-K), backend.py
  (`moda_backend`: tether.shared.attention's backend contract served by both), naive.py (their references).
- linear/: the weight-streaming GEMM of a step's few rows, epilogues included (`linear`).
- norm/: RMSNorm, optionally after the residual add, in one launch (`rms_norm`).
- pointwise/: RoPE and SwiGLU's activation, one launch each (`rope`, `silu_mul`).
- utils.py: what the ops share: the interpreter flag, host-side tile arithmetic, the online-softmax step.

Each op folder holds kernel.py (or one file per mode, as moda/) and naive.py, the spelt-out fp32 reference its
tests compare against. Naming: `<op>_fwd_kernel` (the Triton kernel) -> `<op>_fwd` (the launch, no checks) ->
`<op>` (the checked public op). Imported by the server only (tether.shared never imports triton or this package).

Tests, one file per op: `TRITON_INTERPRET=1 .venv/bin/python -m pytest -q tests/kernels` on a CPU, or on a GPU
without TRITON_INTERPRET.
"""

from tether.kernels.linear import linear
from tether.kernels.moda import moda_attention, moda_backend, moda_verify
from tether.kernels.norm import rms_norm
from tether.kernels.pointwise import rope, silu_mul

__all__ = ["linear", "moda_attention", "moda_backend", "moda_verify", "rms_norm", "rope", "silu_mul"]
