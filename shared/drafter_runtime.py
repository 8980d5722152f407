"""The torch drafters' client side: their caches as a draft backend, under the one drafting loop.

Purpose: MoADrafter and EagleDrafter (tether.shared.moa, tether.shared.eagle) keep their client caches on the
module, on whatever device it is. `TorchDraftBackend` presents them to tether.shared.draft_loop.DraftLoop as a
tether.shared.contracts.DraftBackend (numpy logits out, host masks and deltas in), and `DrafterBase` gives the
module the tether.shared.contracts.Drafter methods by running that loop, so the rules (chains, trees, sampled
proposals, feed, keep_drafts, discard_drafts) are the ones the ONNX drafter runs too.

Contract. A subclass provides, over caches of its own:
- `_reset(capacity)`: fresh, empty caches;
- `_adopt(delta, keep)`: the verified states of positions [delta.start, delta.start + n) (a DraftDelta of torch
  tensors); without `keep` the rows held after them are dropped, with it they stay as drafted;
- `_step(token)`: feed one token at the next row, logits [V] for the token after it;
- `_tree_step(tokens, positions, mask, parent_rows)`: feed F tree nodes as new rows at once (tokens, positions [F],
  mask [F, rows + F] bool, on the device), logits [F, V];
- `_drop_drafted(rows)`, `held_rows()`, `verified_length()`;
- and may override `_feed(tokens)` (several known tokens in one causal forward, where its states allow; EAGLE's
  cannot), logits [V] after the last.
Against the loop's numpy results DrafterBase differs only in type: sampled q_ids / q_probs come back as CPU tensors,
trees as a tether.shared.speculative.DraftTree, and sampled tokens are drawn with torch.multinomial from a
torch.Generator. Logits cross to the host once a step ([V] floats; [F, V] a tree level).

    drafter.begin(delta_for_prompt)
    tokens, q_ids, q_probs = drafter.draft(root_token, k=5, temperature=0.8)
    tree = drafter.draft_tree(root_token, depth=6, top_k=8, total_tokens=48)
    drafter.commit(delta_for_root_and_accepted, keep_drafts=True)    # or, when the round's answer never came:
    drafter.discard_drafts()
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from tether.shared.contracts import DeltaLike
from tether.shared.draft_loop import DraftLoop
from tether.shared.drafter import DraftDelta, DrafterConfig
from tether.shared.drafter_config import ArrayDelta
from tether.shared.logits_processing import LogitsProcessing
from tether.shared.model import Transformer
from tether.shared.speculative import DraftTree


def _as_tensors(delta: DraftDelta | ArrayDelta) -> DraftDelta:
    """A delta decoded torch-free (numpy arrays, tether.client.delta_gate) as the torch drafters take it."""
    if not any(isinstance(t, np.ndarray) for t in delta.tensors.values()):
        return delta
    tensors = {k: torch.from_numpy(t) if isinstance(t, np.ndarray) else t for k, t in delta.tensors.items()}
    return DraftDelta(delta.start, list(delta.tokens), tensors)


def _host(logits: Tensor) -> np.ndarray:
    return logits.float().cpu().numpy()


class TorchDraftBackend:
    """A torch drafter's caches as the loop's tether.shared.contracts.DraftBackend (module docstring)."""

    def __init__(self, drafter: DrafterBase):
        self.drafter = drafter
        self.vocab_size = drafter.target.cfg.vocab_size

    def begin(self, capacity: int | None) -> None:
        self.drafter._reset(capacity or self.drafter.target.cfg.max_seq_len)

    def commit(self, delta: DeltaLike, keep: bool) -> None:
        self.drafter._adopt(_as_tensors(delta), keep)

    def step(self, token: int) -> np.ndarray:
        return _host(self.drafter._step(token))

    def feed(self, tokens: list[int]) -> np.ndarray:
        return _host(self.drafter._feed(tokens))

    def tree_step(
        self, tokens: list[int], positions: list[int], mask: np.ndarray, parent_rows: list[int | None]
    ) -> np.ndarray:
        device = self.drafter.device
        ids, pos = (torch.tensor(xs, device=device) for xs in (tokens, positions))
        return _host(self.drafter._tree_step(ids, pos, torch.from_numpy(mask).to(device), parent_rows))

    def rows(self) -> int:
        return self.drafter.held_rows()

    def verified_length(self) -> int:
        return self.drafter.verified_length()

    def drop(self, rows: int) -> None:
        self.drafter._drop_drafted(rows)

    def sampler(self, generator: torch.Generator | None) -> Callable[[np.ndarray], int]:
        # Drawn on the CPU, so a seeded CPU generator gives the same drafts whatever device the model is on.
        return lambda q: int(torch.multinomial(torch.from_numpy(q), 1, generator=generator))


class DrafterBase(nn.Module):
    def __init__(self, target: Transformer, dcfg: DrafterConfig):
        super().__init__()
        # Not a submodule: the target's weights are the target's, never saved or trained with the drafter.
        object.__setattr__(self, "target", target)
        self.dcfg = dcfg

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    def trainable_state_dict(self) -> dict[str, Tensor]:
        return self.state_dict()

    def num_trainable(self) -> int:
        return sum(p.numel() for p in self.parameters())

    # ---- the client side: tether.shared.draft_loop over this module's caches ----------------------------

    @torch.inference_mode()
    def begin(self, delta: DeltaLike, capacity: int | None = None) -> None:
        """Start a sequence from the verified prompt (delta.start must be 0)."""
        # A loop of its own per begin: a shallow copy of the module (one per stream) drafts over caches of its own.
        self._loop = DraftLoop(TorchDraftBackend(self))
        self._loop.begin(delta, capacity)

    @torch.inference_mode()
    def commit(self, delta: DeltaLike, keep_drafts: bool = False) -> bool:
        """DraftLoop.commit: adopt the verified states of the round's root and accepted drafts; whether the rows
        drafted after them were kept."""
        return self._loop.commit(delta, keep_drafts)

    @torch.inference_mode()
    def draft(self, root: int, k: int, **controls: Any) -> tuple[list[int], Tensor | None, Tensor | None]:
        """DraftLoop.draft (its controls; `generator` a torch.Generator), with q_ids / q_probs as CPU tensors
        [k, min(support, V)] when sampling."""
        tokens, q_ids, q_probs = self._loop.draft(root, k, **controls)
        if q_ids is None or q_probs is None:
            return tokens, None, None
        return tokens, torch.from_numpy(q_ids), torch.from_numpy(q_probs)

    @torch.inference_mode()
    def feed(self, tokens: list[int], processing: LogitsProcessing | None = None) -> int | None:
        """DraftLoop.feed: step over decided tokens as drafted rows; the argmax after the last (None for none)."""
        return self._loop.feed(tokens, processing)

    @torch.inference_mode()
    def discard_drafts(self) -> None:
        """DraftLoop.discard_drafts: drop the rows of drafts never answered (a lost round)."""
        self._loop.discard_drafts()

    @torch.inference_mode()
    def draft_tree(
        self, root: int, *, depth: int, top_k: int, total_tokens: int, processing: LogitsProcessing | None = None
    ) -> DraftTree:
        """DraftLoop.draft_tree, as a DraftTree (its source_ids each node's GrowingTree id)."""
        tree = self._loop.draft_tree(root, depth=depth, top_k=top_k, total_tokens=total_tokens, processing=processing)
        return DraftTree.from_lists(tree)

    def _feed(self, tokens: list[int]) -> Tensor:
        """Logits [V] after the last of `tokens`, fed at the next rows: one step per token unless a subclass can feed
        them in one causal forward."""
        for t in tokens:
            logits = self._step(t)
        return logits
