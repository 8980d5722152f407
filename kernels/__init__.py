"""tether.kernels: Triton MoDA kernels with their pure-PyTorch references. Imported by the server only."""

from tether.kernels.moda import moda_attention, moda_backend
from tether.kernels.naive import moda_attention_naive

__all__ = ["moda_attention", "moda_attention_naive", "moda_backend"]
