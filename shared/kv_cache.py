"""A contiguous per-sequence KV cache for the target model (the in-process engine and the client's TLI layers).

Contract: `k` and `v` are [n_layers, B, capacity, Hkv, D]; positions [0, length) are committed. A forward over
new tokens writes their K/V at [length, length + T) ("pending") and attends to [0, length + T), but does not
commit: the caller decides what survives. `advance(T)` keeps all pending rows (prefill, plain decoding);
`accept(path)` keeps a subset in order (tree verification: the accepted root-to-leaf path) and compacts it;
`truncate(n)` rewinds. Depth K/V are not cached: MoDA's depth keys are same-position only, so each forward
rebuilds them for its own tokens.

The server's batched verifier uses a paged pool with the same per-layer row layout instead. Both satisfy
tether.shared.contracts.SequenceCache: this one has no in-place attention (`attend` is None), and `reserve` /
`release` only check and do nothing, its memory being taken whole at construction.
"""

from __future__ import annotations

import torch
from torch import Tensor

from tether.shared.config import ModelConfig
from tether.shared.contracts import gathering_attend


class KVCache:
    def __init__(
        self,
        cfg: ModelConfig,
        batch_size: int = 1,
        capacity: int | None = None,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        layers: int | None = None,
    ):
        """`layers` sizes a cache for only the last few layers (the client's TLI layers); default all."""
        self.capacity = capacity or cfg.max_seq_len
        self.n_layers = cfg.n_layers if layers is None else layers
        shape = (self.n_layers, batch_size, self.capacity, cfg.n_kv_heads, cfg.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)  # [n_layers, B, capacity, Hkv, D]
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.length = 0

    @property
    def batch_size(self) -> int:
        return self.k.shape[1]

    def write(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store the new rows [B, T, Hkv, D] as pending and return every visible row: [B, length + T, Hkv, D]."""
        end = self.length + k.shape[1]
        if end > self.capacity:
            raise ValueError(f"KV cache full: {end} positions needed, capacity {self.capacity}")
        self.k[layer, :, self.length : end] = k
        self.v[layer, :, self.length : end] = v
        return self.k[layer, :, :end], self.v[layer, :, :end]

    attend = gathering_attend  # no in-place kernel path: the model writes the rows and gathers them

    def reserve(self, n: int) -> None:
        """Room for n rows past the committed length is already allocated; only the capacity is checked."""
        if self.length + n > self.capacity:
            raise ValueError(f"KV cache full: {self.length + n} positions needed, capacity {self.capacity}")

    def release(self) -> None:
        """Nothing to give back: the buffers go with the cache."""

    def advance(self, n: int) -> None:
        """Commit the first n pending rows."""
        if self.length + n > self.capacity:
            raise ValueError(f"cannot advance past capacity {self.capacity}")
        self.length += n

    def accept(self, path: Tensor | list[int]) -> None:
        """Commit the pending rows at offsets `path` (increasing), moving them to consecutive positions."""
        idx = torch.as_tensor(path, dtype=torch.long, device=self.k.device)
        n = idx.numel()
        if n and bool((idx[1:] <= idx[:-1]).any()):
            raise ValueError("accepted path offsets must be strictly increasing")
        src = self.length + idx
        # Gather before writing: the source and destination ranges overlap.
        self.k[:, :, self.length : self.length + n] = self.k[:, :, src].clone()
        self.v[:, :, self.length : self.length + n] = self.v[:, :, src].clone()
        self.length += n

    def append(self, k: Tensor, v: Tensor) -> None:
        """Commit rows given for every layer at once: [n_layers, B, T, Hkv, D]."""
        end = self.length + k.shape[2]
        if end > self.capacity:
            raise ValueError(f"KV cache full: {end} positions needed, capacity {self.capacity}")
        self.k[:, :, self.length : end] = k
        self.v[:, :, self.length : end] = v
        self.length = end

    def truncate(self, n: int) -> None:
        """Forget everything from position n on."""
        if not 0 <= n <= self.length:
            raise ValueError(f"truncate({n}) outside [0, {self.length}]")
        self.length = n

    def overwrite(self, start: int, k: Tensor, v: Tensor) -> None:
        """Replace committed rows [start, start + T) in every layer with exact K/V [n_layers, B, T, Hkv, D]
        (how the client adopts the server's K/V for verified positions)."""
        end = start + k.shape[2]
        if end > self.length:
            raise ValueError(f"overwrite [{start}, {end}) reaches past the committed length {self.length}")
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
