"""What a caller sends, checked before it is used: the service's handlers call these before they allocate, store
or log anything of a request.

Contract: every check either returns the value in the form the service uses or raises a
tether.server.errors.RequestError with its reason: REASON_INVALID_REQUEST for malformed values (ids not of the
server's shape, token ids outside the vocabulary, NaN or out-of-range sampling values, each named by its field,
unknown codecs, malformed draft distributions, a draft tree whose parents are not one earlier node per token or
that has more nodes than the limit), REASON_TOO_LONG for lengths past the limits or past what the whole KV pool
can hold (never retryable), REASON_MODEL_MISMATCH for another model's fingerprint. Messages never echo what the
caller sent, but for the number of a control out of its range.

    check = Checks(vocab_size, model_fingerprint, pool)
    prompt = check.tokens(req.prompt, "prompt", limit=1536)
    controls = check.sampling(req.sampling)  # a SamplingControls; check.stop_ids(req.sampling): a frozenset
    tree = check.draft_tree(round_msg, limit=64)  # a chain, or a tree when round_msg.parents is set
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch

from tether.server.errors import Reason, RequestError
from tether.server.kv_pool import KVPool
from tether.shared.codecs import Codec
from tether.shared.ids import is_session_id
from tether.shared.logits_processing import ControlError, SamplingControls
from tether.shared.openai_api import MAX_LOGPROBS
from tether.shared.speculative import DraftTree
from tether.v1 import tether_pb2 as pb

Q_SUM_TOLERANCE = 1e-3  # how far a draft distribution's sum may be from 1 (float32 rows; DraftTree's own bound)
MAX_STOP_TOKEN_IDS = 256  # SamplingParams.stop_token_ids per request


def invalid(message: str, field: str | None = None) -> RequestError:
    return RequestError(Reason.REASON_INVALID_REQUEST, message, field=field)


def sampling_controls(s: pb.SamplingParams) -> SamplingControls:
    """The request's sampling rule as tether.shared.logits_processing's SamplingControls (top_p 0 and an unset
    repetition_penalty read as off), or REASON_INVALID_REQUEST naming the field that is out of range. The one place
    the wire's SamplingParams becomes the verifier's rule (Session, Resync, Generate, the HTTP API)."""
    # NaN fails every comparison, so the chained range checks refuse it too.
    if not (math.isfinite(s.temperature) and 0 <= s.temperature <= 100):
        raise invalid("temperature must be a finite number in [0, 100]", "temperature")
    if not (math.isfinite(s.top_p) and 0 <= s.top_p <= 1):
        raise invalid("top_p must be in [0, 1]", "top_p")
    try:
        return SamplingControls(
            temperature=s.temperature,
            top_p=s.top_p or 1.0,
            top_k=s.top_k,
            min_p=s.min_p,
            presence_penalty=s.presence_penalty,
            frequency_penalty=s.frequency_penalty,
            repetition_penalty=s.repetition_penalty if s.HasField("repetition_penalty") else 1.0,
            logit_bias=s.logit_bias,
        )
    except ControlError as e:  # its message names the control: the proto field of the same name
        raise invalid(str(e), e.control) from None


def requested_logprobs(s: pb.SamplingParams) -> int | None:
    """How many most probable tokens to report with each emitted token's logprob (None: no logprobs), at most
    MAX_LOGPROBS, or REASON_INVALID_REQUEST naming logprobs."""
    if not s.HasField("logprobs"):
        return None
    if s.logprobs > MAX_LOGPROBS:
        raise invalid(f"logprobs must be in [0, {MAX_LOGPROBS}]", "logprobs")
    return s.logprobs


def check_codec(value: int) -> Codec:
    try:
        return Codec(value)
    except ValueError:
        raise invalid(f"unknown delta codec {value}") from None


MAX_CODEC_OFFER = 32  # far more than there are codecs: a longer offer is no client's


def pick_codec(delta_codec: int, accepted: Sequence[int]) -> Codec:
    """The codec a session's deltas travel in: the first of the client's offer (`accept_codecs`, its preference
    first) that this server knows, skipping a newer client's others; from a client that offers none (older
    clients), `delta_codec`. An offer with none known, or too long, is refused."""
    if not accepted:
        return check_codec(delta_codec)
    if len(accepted) > MAX_CODEC_OFFER:
        raise invalid(f"accept_codecs lists {len(accepted)} codecs, at most {MAX_CODEC_OFFER}")
    known = {int(c) for c in Codec}
    for value in accepted:
        if value in known:
            return Codec(value)
    raise invalid(f"none of the codecs offered ({', '.join(map(str, accepted))}) is one this server sends")


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
        ids = tokens[:]  # a protobuf repeated field's slice is a list, made 2x faster than list() walks it
        if type(ids) is not list:
            ids = list(ids)
        if ids and max(ids) >= self.vocab:  # ids are unsigned on the wire
            raise invalid(f"{what}: a token id is outside [0, {self.vocab})")
        return ids

    def sampling(self, s: pb.SamplingParams) -> SamplingControls:
        """`sampling_controls`, its logit_bias ids and stop_token_ids within the vocabulary too, logprobs bounded."""
        controls = sampling_controls(s)
        try:
            controls.check_vocab(self.vocab)
        except ControlError as e:
            raise invalid(str(e), e.control) from None
        self.stop_ids(s)
        requested_logprobs(s)
        return controls

    def stop_ids(self, s: pb.SamplingParams) -> frozenset[int]:
        """The request's stop_token_ids: at most MAX_STOP_TOKEN_IDS, each in the vocabulary."""
        if len(s.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise invalid(
                f"stop_token_ids holds {len(s.stop_token_ids)} ids, the limit is {MAX_STOP_TOKEN_IDS}", "stop_token_ids"
            )
        if any(t >= self.vocab for t in s.stop_token_ids):
            raise invalid(f"stop_token_ids: a token id is outside [0, {self.vocab})", "stop_token_ids")
        return frozenset(s.stop_token_ids)

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

    def draft_tree(self, req: pb.DraftRound, limit: int) -> DraftTree:
        """The round as the verifier's DraftTree: a chain, or a tree when `parents` is set (tether.v1 DraftRound),
        of at most `limit` draft nodes; with q (sampling), one well-formed distribution per draft node."""
        if req.parents and len(req.tokens) > limit:
            # A tree past the advertised ModelInfo.max_tree_nodes is a field out of range. A chain that long keeps
            # the answer older clients have always had (too long).
            raise invalid(f"a draft tree has at most {limit} nodes, this one has {len(req.tokens)}")
        drafts = self.tokens(req.tokens, "draft", limit)
        q_ids, q_probs = self.proposals(req.q, drafts) if req.q else (None, None)
        chain = DraftTree.chain(req.root, drafts, q_ids, q_probs)
        if not req.parents:
            return chain
        parents = tree_parents(req.parents, len(drafts))
        return dataclasses.replace(chain, parents=torch.tensor([-1, *parents], dtype=torch.long))

    def proposals(self, q: Sequence[pb.SparseDistribution], drafts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(q_ids, q_probs) [k, K]: one distribution per draft node, as DraftTree takes them, each giving its own
        node's token a positive probability (it was drawn from it)."""
        widths = {len(d.ids) for d in q} | {len(d.probs) for d in q}
        if len(q) != len(drafts) or len(widths) != 1 or not 0 < next(iter(widths)) <= self.vocab:
            raise invalid("q needs one row per draft token, all of one width in [1, vocab]")
        q_ids = torch.tensor([list(d.ids) for d in q], dtype=torch.long)  # [k, K]
        q_probs = torch.tensor([list(d.probs) for d in q], dtype=torch.float32)  # [k, K]
        if bool((q_ids >= self.vocab).any()):
            raise invalid(f"q: a token id is outside [0, {self.vocab})")
        if not bool(torch.isfinite(q_probs).all()) or bool((q_probs < 0).any()) or bool((q_probs > 1).any()):
            raise invalid("q: probabilities must be finite and in [0, 1]")
        # DraftTree's own test of a distribution, made here so that a bad row is the caller's error, not the server's.
        if bool(((q_probs.double().sum(-1) - 1).abs() > Q_SUM_TOLERANCE).any()):
            raise invalid(f"q: each row's probabilities must sum to 1 (within {Q_SUM_TOLERANCE:g})")
        # The verifier would find this only once it tested the node, after the target's forward.
        own = torch.where(q_ids == torch.tensor(drafts, dtype=torch.long)[:, None], q_probs, 0.0).sum(-1)  # [k]
        if not bool((own > 0).all()):
            raise invalid("q: a draft token has no probability in its own row")
        return q_ids, q_probs


def tree_parents(parents: Sequence[int], nodes: int) -> list[int]:
    """A tree round's parent numbers, checked: one per draft node, each the root (0) or an earlier node."""
    if len(parents) != nodes:
        raise invalid(f"parents needs one entry per draft token: {nodes}, got {len(parents)}")
    checked = list(parents)
    # Node i + 1's parent must come before it: this also rules out negative numbers and cycles.
    if any(not 0 <= p <= i for i, p in enumerate(checked)):
        raise invalid("parents: each node's parent must be the root (0) or a node before it")
    return checked
