"""Server-side speculation (`serve --server-draft`): Generate and the HTTP API draft with the full drafter on the server
and verify with the target, speculative decoding with no edge in it: the baseline a datacenter client compares with.

Contract (`ServerDraftDecoder`, the engine's `decoding` when the mode is on: tether.server.engine_core):
- It is server-only decoding (tether.server.plain_decoding.PlainDecoder) with the same checks, the same lifecycle
  (the paged pool's KV lent and given back however the stream ends, REASON_CAPACITY on a full pool, `released`),
  the same stop ids, length rule and log-probabilities, and the same output: greedy text identical to plain greedy
  decoding, sampled text distributed exactly as plain sampling under the whole rule (temperature, top_p, top_k,
  min_p, penalties, logit_bias). Only the way to the tokens differs: each round the drafter proposes a chain of up to
  `k` tokens after the last decided one (tether.server.engine.SpeculativeEngine.propose, what `tether-server
  generate` drafts with) and the verifier decides it (tether.server.rounds.verify_batch: greedy acceptance, or the
  lossless rejection sampling of tether.shared.speculative), so every token is the target's.
- Per stream: a drafter of its own over the engine's weights (a shallow copy: the parameters are shared, its caches
  are not), a sampling stream for the drafts apart from the verifier's (seeded from the request's seed), and the
  verifier's own cache. Streams never share drafting state, so several at once cannot corrupt each other.
- A stream alone drafts, verifies and adopts a round in one call on a model thread. While others decode, a round is
  drafted on a model thread and verified by the batcher (tether.server.batcher) in one step with every other
  stream's and every Session's rounds; its delta (host bfloat16, as the wire's) is adopted on the model thread just
  before the next draft. Drafter states that went through bfloat16 may draft other tokens than a float32 one would:
  the acceptance can move, never the text.
- `stats`: rounds, drafted and accepted tokens over every stream since the engine started (tau), on the event loop.

    engine = Engine(target, drafter, tokenizer, config, model_fingerprint=fp, server_draft=5)
    async for chunk in engine.decoding.decode(prompt, pb.SamplingParams(), 64):
        ...
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np
import torch

from tether.server.engine import SpeculativeEngine
from tether.server.plain_decoding import PlainDecoder, PlainSteps
from tether.server.verifier import SequenceVerifier
from tether.shared.contracts import SpeculativeDrafter
from tether.shared.drafter import DraftDelta
from tether.shared.drafter_config import ArrayDelta
from tether.shared.speculative import DraftTree, Verdict
from tether.v1 import tether_pb2 as pb

DRAFT_SEED = 0x5EED_D2AF7  # the drafts' sampling stream is the request's seed plus this: apart from the verifier's


def on_device(delta: DraftDelta | ArrayDelta, device: torch.device) -> DraftDelta:
    """A delta as the torch drafter adopts it: a batcher round's (numpy bfloat16 bits) as bfloat16 tensors on the
    drafter's device; a delta already in torch as it is."""
    if not isinstance(delta, ArrayDelta):
        return delta
    tensors = {
        k: torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16).to(device)
        for k, a in delta.tensors.items()
    }
    return DraftDelta(delta.start, list(delta.tokens), tensors)


@dataclass
class DraftStats:
    """Every server-draft stream's rounds since the engine started (constant memory: a server runs for months)."""

    rounds: int = 0  # verified rounds after the prefills
    drafted: int = 0  # draft tokens proposed
    accepted: int = 0  # draft tokens accepted

    @property
    def tau(self) -> float:
        """Tokens gained per round: the accepted drafts and each round's bonus."""
        return (self.accepted + self.rounds) / self.rounds if self.rounds else 0.0

    def add(self, verdict: Verdict, drafted: int) -> None:
        self.rounds += 1
        self.drafted += drafted
        self.accepted += verdict.accepted


class DraftedSteps(PlainSteps):
    """One server-draft generation's rounds (see the module docstring): PlainSteps whose tokens come from drafts."""

    def __init__(
        self, ver: SequenceVerifier, decoder: ServerDraftDecoder, spec: SpeculativeEngine, generator: torch.Generator
    ):
        super().__init__(ver, decoder.work, decoder.batcher)
        self.spec = spec  # its drafter is this stream's own
        self.generator = generator  # the drafts' sampling stream
        self.totals = decoder.stats
        self.pending: DraftDelta | ArrayDelta | None = None  # a batcher round's delta, adopted before the next draft
        self.last: tuple[Verdict, int] | None = None  # the last round's verdict and draft length, for `totals`

    @torch.inference_mode()
    def open(self, prompt: list[int], stop) -> int:
        token, delta = self.ver.open(prompt, stop)
        self.spec.drafter.begin(delta, self.ver.cache.capacity)
        return token

    @torch.inference_mode()
    def _propose(self, root: int, left: int) -> DraftTree:
        """On a model thread: the drafter adopts the last round's delta if it has not, then drafts after `root`."""
        if self.pending is not None:
            self.spec.drafter.commit(on_device(self.pending, self.spec.drafter.device))
            self.pending = None
        ver = self.ver
        return self.spec.propose(root, ver.room - 1, left, ver.controls, ver.processing_at(root), self.generator)

    @torch.inference_mode()
    def alone(self, root: int, left: int) -> list[int]:
        tree = self._propose(root, left)
        verdict, delta = self.ver.verify(tree)
        self.spec.drafter.commit(delta)
        self.last = verdict, len(tree) - 1
        return verdict.emitted_tokens(tree)

    async def draft(self, root: int, left: int) -> DraftTree:
        self.work = self.models.submit(self._propose, root, left)
        return await self.models.wait(self.work)

    def emitted(self, tree: DraftTree, verdict: Verdict, delta) -> list[int]:
        self.pending, self.last = delta, (verdict, len(tree) - 1)
        return verdict.emitted_tokens(tree)

    async def next(self, root: int, left: int, alone: bool) -> list[int]:
        tokens = await super().next(root, left, alone)
        self.totals.add(*self.last)  # here, on the event loop: one writer
        return tokens


class ServerDraftDecoder(PlainDecoder):
    """Generate's and the HTTP API's decoding with server-side drafts (see the module docstring)."""

    def __init__(self, *args, drafter: SpeculativeDrafter, k: int):
        super().__init__(*args)
        if k < 1:
            raise ValueError(f"server-side drafting takes at least one draft token a round, got k = {k}")
        self.server_part = drafter  # every stream's verifier makes its deltas with the engine's drafter
        self.drafter, self.k = drafter, k
        self.stats = DraftStats()

    def steps(self, ver: SequenceVerifier, sampling: pb.SamplingParams) -> DraftedSteps:
        own = copy.copy(self.drafter)  # shares the parameters; begin() gives it caches of its own
        spec = SpeculativeEngine(self.target, own, k=self.k)
        generator = torch.Generator().manual_seed((sampling.seed + DRAFT_SEED) % 2**63)
        return DraftedSteps(ver, self, spec, generator)
