"""tether.kernels: Triton MoDA kernels with their pure-PyTorch references. Imported by the server only."""
