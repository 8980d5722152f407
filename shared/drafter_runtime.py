"""The client-side drafting loop every drafter shares: begin, draft, commit.

Contract: a drafter subclass provides `_reset(capacity)` (fresh caches), `_adopt(delta)` (take verified states
of positions [delta.start, delta.start + n) and make the next draft start after them) and `_step(token)`
(feed one token at the next position, return logits [V] for the token after it). This class turns those into
chain drafts. With temperature > 0 each draft token is sampled from the drafter's distribution truncated to its
top-`support` tokens, and that exact truncated distribution is returned with it, so the verifier's rejection
sampling stays lossless while the message that carries q stays small.

    drafter.begin(delta_for_prompt)
    tokens, q_ids, q_probs = drafter.draft(root_token, k=5, temperature=0.8)
    drafter.commit(delta_for_root_and_accepted)
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from tether.shared.drafter import DraftDelta, DrafterConfig
from tether.shared.model import Transformer
from tether.shared.sampling import probabilities


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

    @torch.inference_mode()
    def begin(self, delta: DraftDelta, capacity: int | None = None) -> None:
        """Start a sequence from the verified prompt (delta.start must be 0)."""
        if delta.start != 0:
            raise ValueError("begin() takes the prompt's delta, which starts at position 0")
        self._reset(capacity or self.target.cfg.max_seq_len)
        self._adopt(delta)

    @torch.inference_mode()
    def commit(self, delta: DraftDelta) -> None:
        """Adopt the verified states of the round's root and accepted drafts; drafts after them are dropped."""
        self._adopt(delta)

    @torch.inference_mode()
    def draft(
        self,
        root: int,
        k: int,
        *,
        temperature: float = 0.0,
        top_p: float = 1.0,
        support: int = 8,
        generator: torch.Generator | None = None,
    ) -> tuple[list[int], Tensor | None, Tensor | None]:
        """A chain of k draft tokens after `root` (the token at the first unverified position).
        Returns the tokens and, when sampling, q_ids/q_probs [k, support]: the distributions they came from."""
        tokens: list[int] = []
        q_ids, q_probs = [], []
        token = root
        for _ in range(k):
            logits = self._step(token)
            if temperature == 0:
                token = int(logits.argmax())
            else:
                p = probabilities(logits, temperature, top_p).cpu()
                top = p.topk(min(support, p.numel()))
                q = top.values / top.values.sum()
                token = int(top.indices[torch.multinomial(q, 1, generator=generator)])
                q_ids.append(top.indices)
                q_probs.append(q)
            tokens.append(token)
        if temperature == 0:
            return tokens, None, None
        return tokens, torch.stack(q_ids), torch.stack(q_probs)
