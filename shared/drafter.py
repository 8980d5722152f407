"""What every drafter shares: its configuration, the target states it learns from, and its files.

Terms (the speculative terms themselves live in tether.shared.speculative):
- TargetStates: what the target computed for newly verified positions, on the server: every layer's K/V
  and the last block's output. Only the server ever holds these.
- DraftDelta: the part of those states a drafter's client side needs, computed on the server by
  `Drafter.server_delta` (MoA: one LSA vector per token plus the exact K/V of the TLI layers; EAGLE: the last
  hidden state). It is what crosses the wire after every verification round.
- The client side keeps its own caches and is driven by `begin` (after the prompt), `draft` (propose tokens
  after a root token) and `commit` (adopt the verified states of the accepted positions).

Files: drafter_config.json + drafter.safetensors in one directory, with the target's fingerprint in the
config so a drafter is never paired with a target it was not trained for. A drafter of a named kind is built or
loaded by tether.shared.drafter_loading (above the kinds, which import this module).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

# Re-exported: the torch-free definitions (tether.shared.drafter_config) are imported from here across the code.
from tether.shared.drafter_config import POSITION_AXIS as POSITION_AXIS
from tether.shared.drafter_config import DrafterConfig as DrafterConfig
from tether.shared.drafter_config import layer_config as layer_config


@dataclass
class TargetStates:
    """The target's states for n newly verified positions of one sequence (server side)."""

    k: Tensor  # [L, n, Hkv, D] every layer's attention keys (after RoPE)
    v: Tensor  # [L, n, Hkv, D]
    hidden: Tensor  # [n, dim] the last block's output, before the final norm

    def select(self, rows: Tensor | list[int]) -> TargetStates:
        idx = torch.as_tensor(rows, dtype=torch.long, device=self.k.device)
        return TargetStates(self.k[:, idx], self.v[:, idx], self.hidden[idx])


@dataclass
class DraftDelta:
    """What the client side needs for verified positions [start, start + n) (the wire payload)."""

    start: int  # position of the first row
    tokens: list[int]  # the verified tokens at those positions
    tensors: dict[str, Tensor] = field(default_factory=dict)  # drafter-specific, each [.., n, ..]

    @property
    def n(self) -> int:
        return len(self.tokens)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def split(self, max_bytes: int) -> list[DraftDelta]:
        """Consecutive deltas covering the same positions, each at most about `max_bytes` of raw tensor data
        (so that a long prompt's delta travels in messages under the transport's size limit)."""
        per = max(1, self.nbytes() // max(self.n, 1))
        step = max(1, max_bytes // per)
        if self.n <= step:
            return [self]
        parts = []
        for a in range(0, self.n, step):
            b = min(a + step, self.n)
            tensors = {k: t.narrow(POSITION_AXIS[k], a, b - a) for k, t in self.tensors.items()}
            parts.append(DraftDelta(self.start + a, self.tokens[a:b], tensors))
        return parts


def save_drafter(drafter: torch.nn.Module, path: str | Path, *, dtype: torch.dtype | None = None) -> None:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, t in drafter.trainable_state_dict().items():
        t = t.detach().to("cpu")
        tensors[name] = (t.to(dtype) if dtype is not None and t.is_floating_point() else t).contiguous()
    save_file(tensors, str(path / "drafter.safetensors"), metadata={"format": "pt"})
    (path / "drafter_config.json").write_text(json.dumps(drafter.dcfg.to_dict(), indent=2, sort_keys=True) + "\n")


def load_drafter_config(path: str | Path) -> DrafterConfig:
    f = Path(path) / "drafter_config.json"
    if not f.exists():
        raise FileNotFoundError(f"{path} is not a drafter directory: no drafter_config.json")
    return DrafterConfig.from_dict(json.loads(f.read_text()))


def load_drafter_weights(path: str | Path) -> dict[str, Tensor]:
    return load_file(str(Path(path) / "drafter.safetensors"))
