"""Token sampling: greedy, temperature, top-k, nucleus (top-p) and min-p, the one place these are defined.

Contract: `probabilities_np(logits, temperature, top_p, top_k, min_p)` is the distribution a sampler draws from, on
numpy (the edge's onnxruntime drafter uses it as is); with temperature 0 it is the one-hot argmax. The rule, in
order: divide by the temperature and softmax; keep the `top_k` most probable tokens (ties to the lower id; 0 or >= V
keeps all) and renormalise; keep the smallest prefix of those, most probable first, whose mass reaches `top_p` (the
first always survives) and renormalise; drop the tokens whose probability is below `min_p` times the largest (0
keeps all) and renormalise. vLLM and transformers apply top-k before top-p in the same way (transformers keeps every
token tied with the k-th; here exactly k survive); min-p comes last as in vLLM's sampler. The logits this rule takes
are the processed ones when a sequence has penalties or a logit_bias (tether.shared.logits_processing).
`proposal(p, width)` is a drafted token's proposal: the `width` most probable tokens of p, renormalised, which both
drafters draw from and send as q; `top_k_ids(x, k)` the k largest ids of each row, as a stable sort orders them,
without sorting the vocabulary. `token_logprobs(logits, token, top, ...)` is what an API reports of a sampled
token: the log-probabilities of the distribution it was drawn from (see its docstring), its own and the `top` most
probable. `probabilities` and `sample_token` are the same rule for torch tensors (torch
drafters, the model's own `generate`, the server's plain decoding): they compute it through `probabilities_np`, so
the two ends cannot drift apart, and return to the tensor's device. The speculative verifier applies the same rule
to the target's logits in float64 on the device (tether.shared.speculative.target_probs), so lossless rejection
sampling compares like with like. Importing this module does not import torch.

    p = probabilities_np(logits_np[-1], temperature=0.8, top_p=0.95, top_k=40)
    tok = sample_token(logits[-1], temperature=0.8, top_p=0.95, generator=torch.Generator().manual_seed(0))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch
    from torch import Tensor


def check_rule(temperature: float, top_p: float, top_k: int = 0, min_p: float = 0.0) -> None:
    """ValueError unless temperature >= 0, 0 < top_p <= 1, top_k >= 0 and 0 <= min_p <= 1 (what every caller of
    the rule needs)."""
    if temperature < 0 or not 0 < top_p <= 1 or top_k < 0 or not 0 <= min_p <= 1:
        raise ValueError(
            f"need temperature >= 0, 0 < top_p <= 1, top_k >= 0 and 0 <= min_p <= 1, "
            f"got {temperature}, {top_p}, {top_k}, {min_p}"
        )


def probabilities_np(
    logits: np.ndarray, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0
) -> np.ndarray:
    """logits [..., V] -> probabilities [..., V] in fp32 after temperature, top-k, top-p and min-p truncation.
    Greedy takes the argmax in the logits' own precision (float64 processed logits keep their order)."""
    check_rule(temperature, top_p, top_k, min_p)
    if temperature == 0:
        best = np.asarray(logits).argmax(-1)
        return (np.arange(np.shape(logits)[-1]) == best[..., None]).astype(np.float32)
    x = np.asarray(logits, dtype=np.float32)
    x = x / np.float32(temperature)
    p = np.exp(x - x.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    cut_k = 0 < top_k < p.shape[-1]
    if top_p < 1 or cut_k:
        order = np.argsort(-p, axis=-1, kind="stable")
        sorted_p = np.take_along_axis(p, order, -1)
        if cut_k:
            sorted_p[..., top_k:] = 0
            sorted_p /= sorted_p.sum(-1, keepdims=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token always survives).
        if top_p < 1:
            sorted_p[(np.cumsum(sorted_p, -1) - sorted_p) >= top_p] = 0
        p = np.zeros_like(p)
        np.put_along_axis(p, order, sorted_p, -1)
        p /= p.sum(-1, keepdims=True)
    if min_p > 0:
        p = np.where(p < np.float32(min_p) * p.max(-1, keepdims=True), np.float32(0), p)
        p /= p.sum(-1, keepdims=True)
    return p


LOGPROB_FLOOR = -9999.0  # reported for a token the rule removed (probability 0), as vLLM's OpenAI server clamps


@dataclass(frozen=True)
class TokenLogprobs:
    """One generated token's log-probabilities (natural log), as an API reports them."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # the most probable tokens (id, logprob), most probable first


def token_logprobs(
    logits: np.ndarray,
    token: int,
    top: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
) -> TokenLogprobs:
    """The log-probabilities of the distribution `token` was drawn from, given its (processed) logits [V]: the
    sampling rule's (temperature, then top-k, top-p and min-p, renormalised over the tokens they keep, as
    `probabilities_np` keeps them), computed as a float64 log-softmax so that small probabilities keep their
    digits; a greedy position reports the rule at temperature 1 (vLLM's processed logprobs do the same). A token
    the rule removed reports LOGPROB_FLOOR."""
    t = temperature or 1.0
    kept = probabilities_np(logits, t, top_p, top_k, min_p) > 0  # [V]
    z = np.asarray(logits, dtype=np.float64) / t
    m = z[kept].max()
    lp = np.where(kept, z - (m + np.log(np.exp(z[kept] - m).sum())), LOGPROB_FLOOR)  # [V]
    best = top_k_ids(lp, top) if top > 0 else np.zeros(0, np.intp)
    return TokenLogprobs(int(token), float(lp[token]), tuple((int(i), float(lp[i])) for i in best))


def top_k_ids(x: np.ndarray, k: int) -> np.ndarray:
    """The ids of the k largest values of x [..., V] along its last axis, largest first, ties to the lower id:
    `np.argsort(-x, axis=-1, kind="stable")[..., :k]` (k clipped to V), without sorting all V. A draft tree's
    level and a sampled draft step each took a full sort of the vocabulary (~0.9 ms a level of the default tree on
    a 2-core CPU, a third of drafting it); this partitions at the k-th value, then sorts the values at or above it."""
    n = x.shape[-1]
    k = min(max(k, 0), n)
    rows = x.reshape(-1, n)
    kth = -np.partition(-rows, k - 1, axis=-1)[:, k - 1] if 0 < 4 * k < n else None  # [rows] each k-th largest
    if kth is None or np.isnan(kth).any():  # a partition saves little, or NaN orders only as the sort puts it
        return np.argsort(-x, axis=-1, kind="stable")[..., :k]
    out = np.empty((rows.shape[0], k), dtype=np.intp)
    for r, (row, t) in enumerate(zip(rows, kth, strict=True)):
        # Every value above the k-th and every one equal to it, in id order, so the stable sort breaks ties as the
        # full one does.
        at_least = np.flatnonzero(row >= t)
        out[r] = at_least[np.argsort(-row[at_least], kind="stable")[:k]]
    return out.reshape(*x.shape[:-1], k)


def proposal(p: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    """The proposal a drafted token is drawn from: the `width` most probable ids of p [V] (ties to the lower id)
    and their probabilities renormalised, int64 [w] and fp32 [w], w = min(width, V)."""
    top = top_k_ids(p, width)
    q = p[top] / p[top].sum()
    return top.astype(np.int64), q.astype(np.float32)


def probabilities(
    logits: Tensor, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0
) -> Tensor:
    """probabilities_np for a tensor: logits [..., V] -> fp32 [..., V] on the logits' device."""
    import torch

    p = probabilities_np(logits.detach().float().cpu().numpy(), temperature, top_p, top_k, min_p)
    return torch.from_numpy(p).to(logits.device)


def sample_token(
    logits: Tensor,
    *,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    generator: torch.Generator | None = None,
) -> int:
    """One token id from logits [V] (float64 processed logits keep their precision for greedy's argmax)."""
    import torch

    if temperature == 0:
        return int(logits.argmax(-1))
    # Drawn on the CPU so a seeded CPU generator gives the same tokens whatever device the model is on.
    p = torch.from_numpy(probabilities_np(logits.detach().float().cpu().numpy(), temperature, top_p, top_k, min_p))
    return int(torch.multinomial(p, 1, generator=generator))
