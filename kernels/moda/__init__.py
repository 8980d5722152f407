"""MoDA attention (tether.kernels.moda): one softmax per query over its layer's sequence keys and its own depth keys.

- prefill.py: `moda_attention` (<- `moda_attention_fwd` <- `moda_attention_fwd_kernel`), prefill / full sequence.
- verify.py: `moda_verify` (<- `moda_verify_fwd` <- `moda_verify_fwd_kernel` + `moda_verify_combine_kernel`), a
  few new tokens (causal or a tree) against the paged KV pool, split-K.
- backend.py: `moda_backend`, the model's attention backend (tether.shared.attention's contract) over both, with
  the shared reference as its fallback.
- naive.py: `moda_attention_naive`, `moda_verify_naive`, the tests' references.

    from tether.kernels.moda import moda_backend
    register_backend("triton", moda_backend)
"""

from tether.kernels.moda.backend import kernel_supports, moda_backend
from tether.kernels.moda.prefill import moda_attention, moda_attention_fwd
from tether.kernels.moda.verify import moda_verify, moda_verify_fwd, verify_config

__all__ = [
    "kernel_supports",
    "moda_attention",
    "moda_attention_fwd",
    "moda_backend",
    "moda_verify",
    "moda_verify_fwd",
    "verify_config",
]
