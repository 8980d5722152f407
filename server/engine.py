"""The in-process speculative engine: target and drafter in one process (server-only mode, tests, benchmarks).

Contract: `SpeculativeEngine(target, drafter).generate(prompt_ids, ...)` yields, round by round, the tokens
each verification adds (first the token after the prompt, then each round's accepted drafts and its bonus
token), and keeps `self.stats` (rounds, target forwards, mean tau). Each round runs exactly the protocol the
gRPC split will run: the client side drafts after the root token; the server side (tether.server.verifier,
which gRPC sessions will run too) verifies root + drafts in one target forward, commits the accepted path and
returns the drafter's delta for the newly verified positions, which the client side adopts (commit).
With `drafter=None` it decodes plainly.
Greedy output equals plain greedy decoding token for token; sampled output follows the target's distribution.
`controls=SamplingControls(...)` instead of temperature / top_p / top_k adds min_p, the penalties and logit_bias
(tether.shared.logits_processing): the verifier processes each position's logits with its own context, the
drafter proposes from the same rule with the same counts, so both statements hold with them too.
A generation ends after the first token of `stop_ids` (every end-of-text id of the model, the request's stop
tokens) or `eos_id`, that token included.

    engine = SpeculativeEngine(target, drafter, k=5)                       # chain drafting
    engine = SpeculativeEngine(target, drafter, tree=(6, 8, 48))           # EAGLE-2 tree: depth, top_k, nodes
    for tokens in engine.generate(prompt_ids, 64, temperature=0.0):
        print(tokens)
    engine.generate(prompt_ids, 64, controls=SamplingControls(presence_penalty=0.5, logit_bias={0: -100}),
                    stop_ids=tokenizer.eos_ids)
    engine.stats.tau
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from dataclasses import dataclass, field

import torch

from tether.server.kv_pool import KVPool
from tether.server.verifier import DECODE_CHUNK, SequenceVerifier, target_states
from tether.shared.contracts import SpeculativeDrafter, Target
from tether.shared.logits_processing import LogitsProcessing, SamplingControls
from tether.shared.speculative import DraftTree, Verdict, through_stop

__all__ = ["SpeculativeEngine", "EngineStats", "target_states"]

BLOCK_SIZE = 16  # positions per KV block of the engine's own pool


@dataclass
class EngineStats:
    rounds: int = 0  # verification rounds (target forwards after the prefill)
    drafted: int = 0  # draft tokens proposed
    accepted: int = 0  # draft tokens accepted
    taus: list[int] = field(default_factory=list)  # tokens gained per round

    @property
    def tau(self) -> float:
        """Mean acceptance length: tokens gained per verification round."""
        return sum(self.taus) / len(self.taus) if self.taus else 0.0

    def add(self, verdict: Verdict, drafted: int) -> None:
        self.rounds += 1
        self.drafted += drafted
        self.accepted += verdict.accepted
        self.taus.append(verdict.tau)


class SpeculativeEngine:
    def __init__(
        self,
        target: Target,
        drafter: SpeculativeDrafter | None = None,
        *,
        k: int = 5,
        support: int = 8,
        tree: tuple[int, int, int] | None = None,
        pool: KVPool | None = None,
    ):
        """`pool`: the paged pool the sequence lives in on the "triton" backend (an Engine's, warmed up: its
        rounds replay the step graphs captured over it); None: one of its own, made on first use."""
        self.target = target
        self.drafter = drafter
        self.k = k  # draft tokens per round (chain drafting)
        self.support = support  # top-K support of the drafter distribution sent with a sampled draft
        self.tree = tree  # (depth, top_k, total_tokens): EAGLE-2 dynamic tree drafting instead of a chain
        self.stats = EngineStats()
        self._pool = pool

    @torch.inference_mode()
    def generate(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        *,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        eos_id: int | None = None,
        generator: torch.Generator | None = None,
        controls: SamplingControls | None = None,
        stop_ids: Collection[int] = (),
    ) -> Iterator[list[int]]:
        """The rule is temperature / top_p / top_k, or `controls` (all of it, those three included). It ends after
        a token of `stop_ids` or `eos_id`."""
        stops = frozenset(stop_ids) | ({eos_id} if eos_id is not None else set())
        self.stats = EngineStats()
        per_round = self.tree[2] if self.tree else self.k + 1
        capacity = min(len(prompt_ids) + max_new_tokens + per_round, self.target.cfg.max_seq_len)
        # top_k is the verifier's: drafts proposed without it stay lossless, the target's rule decides.
        server = SequenceVerifier(
            self.target,
            self.drafter,
            capacity=capacity,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            generator=generator,
            pool=self._pool_for(capacity),
            controls=controls,
        )
        try:
            yield from self._rounds(server, prompt_ids, max_new_tokens, stops, generator)
        finally:
            server.release()

    def propose(
        self,
        root: int,
        room: int,
        left: int,
        controls: SamplingControls,
        processing: LogitsProcessing | None,
        generator: torch.Generator | None,
    ) -> DraftTree:
        """The next round's draft after `root`: `room` draft nodes fit after it in the cache, `left` tokens are still
        wanted (the bonus counts, so a chain drafts at most left - 1); the drafter proposes from the sampling rule
        `controls` with `processing` (the logit_bias and penalties of the position after the root), sampling from
        `generator`. A chain of k (or an EAGLE-2 tree with `tree`), empty without a drafter or room. The drafter
        must hold the verified states up to the root (begin, then commit after each round)."""
        k = min(self.k, left - 1, room)
        if self.drafter is not None and self.tree and room > 0:
            depth, top_k, total = self.tree
            return self.drafter.draft_tree(
                root, depth=depth, top_k=top_k, total_tokens=min(total, room + 1), processing=processing
            )
        if self.drafter is not None and k > 0:
            drafts, q_ids, q_probs = self.drafter.draft(
                root,
                k,
                temperature=controls.temperature,
                top_p=controls.top_p,
                support=self.support,
                generator=generator,
                min_p=controls.min_p,
                processing=processing,
            )
            return DraftTree.chain(root, drafts, q_ids, q_probs)
        return DraftTree.chain(root, [])

    def _pool_for(self, capacity: int) -> KVPool | None:
        """On the "triton" backend the sequence lives in a paged pool, so its rounds run as the server's replayed
        steps do (tether.server.step); kept across calls, so the step graphs are captured once."""
        if self.target.backend != "triton":
            return None
        blocks = -(-capacity // BLOCK_SIZE)
        if self._pool is None or self._pool.num_blocks < blocks:
            t = self.target
            self._pool = KVPool(t.cfg, blocks, BLOCK_SIZE, device=t.device, dtype=t.dtype)
        return self._pool

    def _rounds(
        self,
        server: SequenceVerifier,
        prompt_ids: list[int],
        max_new_tokens: int,
        stops: frozenset[int],
        generator: torch.Generator | None,
    ):
        capacity = server.cache.capacity
        controls = server.controls
        root, delta = server.open(prompt_ids)
        produced = 1
        context = [*prompt_ids, root]  # the drafting side's own count of the sequence, as an edge client keeps it
        yield [root]
        if self.drafter is not None:
            scratch = self.tree[0] * self.tree[1] if self.tree else 0  # rows a tree's candidates occupy
            self.drafter.begin(delta, capacity + scratch)
        while produced < max_new_tokens and root not in stops and server.room > 0:
            if self.drafter is None:  # plain decoding: chained one-token steps, each a round of tau 1
                new = server.decode(root, min(DECODE_CHUNK, max_new_tokens - produced, server.room))
                for token in new:
                    self.stats.add(Verdict([0], token), 0)
                new = through_stop(new, stops)
                produced += len(new)
                root = new[-1]
                yield new
                continue
            processing = controls.processing(context, len(prompt_ids), self.target.cfg.vocab_size)
            tree = self.propose(root, server.room - 1, max_new_tokens - produced, controls, processing, generator)
            verdict, delta = server.verify(tree)
            if self.drafter is not None:
                self.drafter.commit(delta)
            self.stats.add(verdict, len(tree) - 1)
            new = verdict.emitted_tokens(tree)
            new = through_stop(new, stops)[: max_new_tokens - produced]
            produced += len(new)
            context += new
            root = new[-1]
            yield new
