"""What a caller sends, checked before it is used: the service's handlers call these before they allocate, store
or log anything of a request.

Contract: every check either returns the value in the form the service uses or raises a
tether.server.errors.RequestError with its reason: REASON_INVALID_REQUEST for malformed values (ids not of the
server's shape, token ids outside the vocabulary, NaN or out-of-range sampling values, unknown codecs, malformed
draft distributions), REASON_TOO_LONG for lengths past the limits or past what the whole KV pool can hold (never
retryable), REASON_MODEL_MISMATCH for another model's fingerprint. Messages never echo what the caller sent.

    check = Checks(vocab_size, model_fingerprint, pool)
    prompt = check.tokens(req.prompt, "prompt", limit=1536)
    check_sampling(req.sampling)
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from tether.server.errors import Reason, RequestError
from tether.server.kv_pool import KVPool
from tether.shared.codecs import Codec
from tether.shared.ids import is_session_id
from tether.shared.speculative import DraftTree
from tether.v1 import tether_pb2 as pb


def invalid(message: str) -> RequestError:
    return RequestError(Reason.REASON_INVALID_REQUEST, message)


def check_sampling(s: pb.SamplingParams) -> None:
    # NaN fails every comparison, so the chained range checks refuse it too.
    if not (math.isfinite(s.temperature) and 0 <= s.temperature <= 100):
        raise invalid("temperature must be a finite number in [0, 100]")
    if not (math.isfinite(s.top_p) and 0 <= s.top_p <= 1):
        raise invalid("top_p must be in [0, 1]")


def check_codec(value: int) -> Codec:
    try:
        return Codec(value)
    except ValueError:
        raise invalid(f"unknown delta codec {value}") from None


def check_id(text: str, what: str) -> None:
    if not is_session_id(text):
        raise invalid(f"{what} must be the 32 lowercase hex digits the server handed out")


class Checks:
    """The checks that depend on the model and the pool this server runs."""

    def __init__(self, vocab_size: int, model_fingerprint: str, pool: KVPool):
        self.vocab, self.model_fingerprint, self.pool = vocab_size, model_fingerprint, pool

    def tokens(self, tokens: Sequence[int], what: str, limit: int) -> list[int]:
        if len(tokens) > limit:
            raise RequestError(Reason.REASON_TOO_LONG, f"{what}: {len(tokens)} tokens, the limit is {limit}")
        ids = list(tokens)
        if any(t >= self.vocab for t in ids):
            raise invalid(f"{what}: a token id is outside [0, {self.vocab})")
        return ids

    def fingerprint(self, fingerprint: str) -> None:
        if fingerprint and fingerprint != self.model_fingerprint:
            ours = self.model_fingerprint[:12]
            raise RequestError(Reason.REASON_MODEL_MISMATCH, f"the client holds another model than this one ({ours})")

    def fits_pool(self, positions: int, what: str) -> None:
        """A sequence the whole KV pool cannot hold is refused for good, not as a retryable capacity problem."""
        blocks = -(-(positions + 1) // self.pool.block_size)
        if blocks > self.pool.num_blocks:
            held = self.pool.num_blocks
            raise RequestError(Reason.REASON_TOO_LONG, f"the {what} needs {blocks} KV blocks, the pool holds {held}")

    def draft_tree(self, req: pb.DraftRound, drafts: list[int]) -> DraftTree:
        """The round as the verifier's DraftTree; with q (sampling), one well-formed distribution per draft."""
        if not req.q:
            return DraftTree.chain(req.root, drafts)
        widths = {len(d.ids) for d in req.q} | {len(d.probs) for d in req.q}
        if len(req.q) != len(drafts) or len(widths) != 1 or not 0 < next(iter(widths)) <= self.vocab:
            raise invalid("q needs one row per draft token, all of one width in [1, vocab]")
        q_ids = torch.tensor([list(d.ids) for d in req.q], dtype=torch.long)  # [k, K]
        q_probs = torch.tensor([list(d.probs) for d in req.q], dtype=torch.float32)  # [k, K]
        if bool((q_ids >= self.vocab).any()):
            raise invalid(f"q: a token id is outside [0, {self.vocab})")
        if not bool(torch.isfinite(q_probs).all()) or bool((q_probs < 0).any()) or bool((q_probs > 1).any()):
            raise invalid("q: probabilities must be finite and in [0, 1]")
        return DraftTree.chain(req.root, drafts, q_ids, q_probs)
