"""The in-process speculative engine: target and drafter in one process (server-only mode, tests, benchmarks).

Contract: `SpeculativeEngine(target, drafter).generate(prompt_ids, ...)` yields, round by round, the tokens
each verification adds (first the token after the prompt, then each round's accepted drafts and its bonus
token), and keeps `self.stats` (rounds, target forwards, mean tau). Each round runs exactly the protocol the
gRPC split will run: the client side drafts after the root token; the server verifies root + drafts in one
target forward, commits the accepted path to its KV cache, computes the drafter's delta for the newly
verified positions (server_delta) and the client adopts it (commit). With `drafter=None` it decodes plainly.
Greedy output equals plain greedy decoding token for token; sampled output follows the target's distribution.

    engine = SpeculativeEngine(target, drafter, k=5)                       # chain drafting
    engine = SpeculativeEngine(target, drafter, tree=(6, 8, 48))           # EAGLE-2 tree: depth, top_k, nodes
    for tokens in engine.generate(prompt_ids, 64, temperature=0.0):
        print(tokens)
    engine.stats.tau
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from tether.shared.drafter import TargetStates
from tether.shared.drafter_runtime import DrafterBase
from tether.shared.model import ForwardOutput, Transformer
from tether.shared.sampling import sample_token
from tether.shared.speculative import DraftTree, Verdict, verify


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


def target_states(out: ForwardOutput) -> TargetStates:
    """The batch-1 forward's states for all its new positions."""
    return TargetStates(k=out.k[:, 0], v=out.v[:, 0], hidden=out.hidden[0][0])


class SpeculativeEngine:
    def __init__(
        self,
        target: Transformer,
        drafter: DrafterBase | None = None,
        *,
        k: int = 5,
        support: int = 8,
        tree: tuple[int, int, int] | None = None,
    ):
        self.target = target
        self.drafter = drafter
        self.k = k  # draft tokens per round (chain drafting)
        self.support = support  # top-K support of the drafter distribution sent with a sampled draft
        self.tree = tree  # (depth, top_k, total_tokens): EAGLE-2 dynamic tree drafting instead of a chain
        self.stats = EngineStats()

    @torch.inference_mode()
    def generate(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        *,
        temperature: float = 0.0,
        top_p: float = 1.0,
        eos_id: int | None = None,
        generator: torch.Generator | None = None,
    ) -> Iterator[list[int]]:
        target = self.target
        self.stats = EngineStats()
        if not prompt_ids:
            raise ValueError("the prompt must hold at least one token")
        per_round = self.tree[2] if self.tree else self.k + 1
        capacity = min(len(prompt_ids) + max_new_tokens + per_round, target.cfg.max_seq_len)
        if len(prompt_ids) >= capacity:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens leaves no room under max_seq_len")
        cache = target.new_cache(1, capacity)
        want = (target.cfg.n_layers,)
        prompt = torch.tensor([prompt_ids], device=target.device)
        out = target.prefill(prompt, cache, hidden_layers=want, return_kv=self.drafter is not None)
        root = sample_token(out.logits[0, -1], temperature=temperature, top_p=top_p, generator=generator)
        produced = 1
        yield [root]
        if self.drafter is not None:
            scratch = self.tree[0] * self.tree[1] if self.tree else 0  # rows a tree's candidates occupy
            self.drafter.begin(self.drafter.server_delta(target_states(out), 0, prompt_ids), capacity + scratch)
        while produced < max_new_tokens and root != eos_id:
            room = cache.capacity - cache.length - 1  # rows left after the root's
            if room < 0:
                return
            k = min(self.k, max_new_tokens - produced - 1, room)
            if self.drafter is not None and self.tree and room > 0:
                depth, top_k, total = self.tree
                tree = self.drafter.draft_tree(root, depth=depth, top_k=top_k, total_tokens=min(total, room + 1))
            elif self.drafter is not None and k > 0:
                drafts, q_ids, q_probs = self.drafter.draft(
                    root, k, temperature=temperature, top_p=top_p, support=self.support, generator=generator
                )
                tree = DraftTree.chain(root, drafts, q_ids, q_probs)
            else:
                tree = DraftTree.chain(root, [])
            start = cache.length
            ids = tree.tokens[None].to(target.device)
            out = target.verify(
                ids,
                cache,
                tree_mask=tree.ancestor_mask().to(target.device),
                positions=tree.positions(start).to(target.device),
                hidden_layers=want,
                return_kv=self.drafter is not None,
            )
            verdict = verify(tree, out.logits[0], temperature=temperature, top_p=top_p, generator=generator)
            cache.accept(verdict.path)
            if self.drafter is not None:
                states = target_states(out).select(verdict.path)
                tokens = tree.tokens[verdict.path].tolist()
                self.drafter.commit(self.drafter.server_delta(states, start, tokens))
            self.stats.add(verdict, len(tree) - 1)
            new = verdict.emitted_tokens(tree)
            if eos_id is not None and eos_id in new:
                new = new[: new.index(eos_id) + 1]
            new = new[: max_new_tokens - produced]
            produced += len(new)
            root = new[-1]
            yield new
