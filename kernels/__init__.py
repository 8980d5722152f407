"""tether.kernels."""
