"""Token sampling: greedy, temperature and nucleus (top-p), the one place these are defined.

Contract: `probabilities(logits, temperature, top_p)` is the distribution a sampler draws from; with
temperature 0 it is the one-hot argmax. `sample_token` draws from it, and drafters sample their proposals from
it. The speculative verifier applies the same temperature and top-p rule to the target's logits in float64
(tether.shared.speculative.target_probs), so lossless rejection sampling compares like with like.

    tok = sample_token(logits[-1], temperature=0.8, top_p=0.95, generator=torch.Generator().manual_seed(0))
"""

from __future__ import annotations

import torch
from torch import Tensor


def probabilities(logits: Tensor, temperature: float = 0.0, top_p: float = 1.0) -> Tensor:
    """logits [..., V] -> probabilities [..., V] in fp32 after temperature and top-p truncation."""
    if temperature < 0 or not 0 < top_p <= 1:
        raise ValueError(f"need temperature >= 0 and 0 < top_p <= 1, got {temperature}, {top_p}")
    logits = logits.float()
    if temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    probs = (logits / temperature).softmax(-1)
    if top_p < 1:
        sorted_p, order = probs.sort(-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token always survives).
        drop = (sorted_p.cumsum(-1) - sorted_p) >= top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample_token(
    logits: Tensor, *, temperature: float = 0.0, top_p: float = 1.0, generator: torch.Generator | None = None
) -> int:
    """One token id from logits [V]."""
    if temperature == 0:
        return int(logits.argmax(-1))
    p = probabilities(logits, temperature, top_p)
    # Drawn on the CPU so a seeded CPU generator gives the same tokens whatever device the model is on.
    return int(torch.multinomial(p.cpu(), 1, generator=generator))
