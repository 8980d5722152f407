"""Each emitted token's log-probabilities on the edge, for callers that ask (the edge's HTTP API: logprobs and
top_logprobs): the server's for the tokens it verified, the drafter's own for the tokens drafted offline.

Contract:
- `server_logprobs(entries, tokens, top, vocab)` -> list[TokenLogprobs] | None: what the server reported with a
  message's emitted tokens (Opened.first_logprob, Verdict.logprobs, ResyncReply.target_logprob: the target's
  processed distribution, tether.server.logprob_wire), checked before use: one entry per token, each of that
  token, at most `top` top tokens inside the vocabulary, every logprob a finite number <= 0 (JSON has no NaN or
  infinity; the server clamps a removed token at LOGPROB_FLOOR). ValueError names what is wrong. None when the
  server sent no entries at all: a server older than SamplingParams.logprobs, which ignores it.
- `drafter_logprobs(logits, token, top, cfg)` -> TokenLogprobs: a token drafted offline, which the target never
  scored, reported under the drafter's own distribution (`logits` [V], processed as for drafting: logit_bias and
  penalties applied) by the same rule and definition as the server's (tether.shared.sampling.token_logprobs:
  temperature, top-k, top-p, min-p; a greedy position at temperature 1). The rule's distribution, not the drafter's
  `support`-wide proposal a sampled token was drawn from: that is a truncation of it for the server's acceptance
  test, and would report other values than a drafter with a wider support.
Why the drafter's values and not null: a token drafted offline was chosen by the drafter, so its logprob under
the drafter is what produced it; every entry stays a number (OpenAI's chat schema has no null logprob, and typed
clients read one as 0, probability 1), and the caller is told which entries are the drafter's
(tether.shared.openai_responses.with_offline: "drafter_logprobs").

    entries = server_logprobs(verdict.logprobs, accepted + [verdict.bonus], 5, vocab)
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from tether.client.session_types import ClientConfig
from tether.shared.sampling import LOGPROB_FLOOR, TokenLogprobs, token_logprobs
from tether.v1 import tether_pb2 as pb

ROUNDING = 1e-3  # a float32 log-softmax of a near-certain token may land a hair above 0


def _logprob(value: float) -> float:
    if not (math.isfinite(value) and LOGPROB_FLOOR <= value <= ROUNDING):
        raise ValueError(f"logprob {value} is not a log-probability in [{LOGPROB_FLOOR}, 0]")
    return min(float(value), 0.0)


def server_logprobs(
    entries: Sequence[pb.TokenLogprob], tokens: Sequence[int], top: int, vocab: int
) -> list[TokenLogprobs] | None:
    """See the module docstring."""
    if not entries:
        return None
    if len(entries) != len(tokens):
        raise ValueError(f"{len(entries)} logprob entries for {len(tokens)} tokens")
    out = []
    for e, token in zip(entries, tokens, strict=True):
        if e.token != token:
            raise ValueError(f"a logprob entry of token {e.token} where token {token} was emitted")
        if len(e.top_ids) != len(e.top_logprobs) or len(e.top_ids) > top:
            raise ValueError(f"{len(e.top_ids)} top ids and {len(e.top_logprobs)} top logprobs, {top} asked")
        if any(t >= vocab for t in e.top_ids):
            raise ValueError(f"a top token outside the vocabulary of {vocab}")
        top_pairs = tuple((int(t), _logprob(v)) for t, v in zip(e.top_ids, e.top_logprobs, strict=True))
        out.append(TokenLogprobs(int(token), _logprob(e.logprob), top_pairs))
    return out


def drafter_logprobs(logits: np.ndarray, token: int, top: int, cfg: ClientConfig) -> TokenLogprobs:
    """See the module docstring."""
    return token_logprobs(logits, token, top, cfg.temperature, cfg.top_p, cfg.top_k, cfg.min_p)
