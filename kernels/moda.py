"""Public MoDA ops: `moda_attention` (prefill / full sequence) and `moda_backend` (the model's backend contract)."""

from tether.kernels.moda_prefill import moda_attention, moda_attention_fwd, moda_backend

__all__ = ["moda_attention", "moda_attention_fwd", "moda_backend"]
