"""The client-side drafting loop every drafter shares: begin, draft, commit (tether.shared.contracts.Drafter).

Contract: a drafter subclass provides `_reset(capacity)` (fresh caches), `_adopt(delta)` (take verified states
of positions [delta.start, delta.start + n), drop any drafted rows, and make the next draft start after them),
`_step(token)` (feed one token at the next position, return logits [V] for the token after it) and
`_tree_step(tokens, positions, mask, parent_rows)` (feed several tree nodes at once as new cache rows, each
seeing the verified prefix and its ancestors' rows through `mask`; return logits [F, V]), and may override
`_feed(tokens)` (several known tokens in one causal forward, where its states allow; EAGLE's cannot). This class turns
those into chain drafts and EAGLE-2 dynamic draft trees. With temperature > 0 each chain draft token is sampled
from the drafter's distribution truncated to its top-`support` tokens, and that exact truncated distribution is
returned with it, so the verifier's rejection sampling stays lossless while the message that carries q stays
small. Tree children are deterministic top-k picks, which the verifier handles as point-mass proposals. With a
`processing` (the logit_bias and penalties of the position after the root, tether.shared.logits_processing) each
drafted position's logits are processed as the verifier will process the target's there: with the counts of the
context plus the drafted tokens on its path, so greedy drafts are what penalised greedy decoding would pick.
A tree grows after the rows the caches hold: the verified positions and any chain drafted after them (the edge
client drafts a round ahead that way, tether.client.rounds), counted here since subclasses keep them in their own
caches.

    drafter.begin(delta_for_prompt)
    tokens, q_ids, q_probs = drafter.draft(root_token, k=5, temperature=0.8)
    tree = drafter.draft_tree(root_token, depth=6, top_k=8, total_tokens=48)
    drafter.commit(delta_for_root_and_accepted)    # or, when the round's answer never came:
    drafter.discard_drafts()
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor, nn

from tether.shared.drafter import DraftDelta, DrafterConfig
from tether.shared.drafter_config import ArrayDelta
from tether.shared.logits_processing import LogitsProcessing, ProcessingRows
from tether.shared.model import Transformer
from tether.shared.sampling import probabilities_np, proposal
from tether.shared.speculative import DraftTree, GrowingTree, expand_dynamic_tree


def _as_tensors(delta: DraftDelta | ArrayDelta) -> DraftDelta:
    """A delta decoded torch-free (numpy arrays, tether.client.delta_gate) as the torch drafters take it."""
    if not any(isinstance(t, np.ndarray) for t in delta.tensors.values()):
        return delta
    tensors = {k: torch.from_numpy(t) if isinstance(t, np.ndarray) else t for k, t in delta.tensors.items()}
    return DraftDelta(delta.start, list(delta.tokens), tensors)


class DrafterBase(nn.Module):
    def __init__(self, target: Transformer, dcfg: DrafterConfig):
        super().__init__()
        # Not a submodule: the target's weights are the target's, never saved or trained with the drafter.
        object.__setattr__(self, "target", target)
        self.dcfg = dcfg
        self._drafted = 0  # chain rows drafted after the verified positions (draft_tree grows after them)

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
    def begin(self, delta: DraftDelta | ArrayDelta, capacity: int | None = None) -> None:
        """Start a sequence from the verified prompt (delta.start must be 0)."""
        if delta.start != 0:
            raise ValueError("begin() takes the prompt's delta, which starts at position 0")
        self._reset(capacity or self.target.cfg.max_seq_len)
        self._adopt(_as_tensors(delta))
        self._drafted = 0

    @torch.inference_mode()
    def commit(self, delta: DraftDelta | ArrayDelta, keep_drafts: bool = False) -> bool:
        """Adopt the verified states of the round's root and accepted drafts; drafts after them are dropped.
        `keep_drafts` (the caller would have rows drafted after them kept, tether.client.onnx_drafter) is not
        taken here: these caches drop them, the caller feeds them again. Returns False: nothing was kept."""
        self._adopt(_as_tensors(delta))
        self._drafted = 0
        return False

    @torch.inference_mode()
    def draft(
        self,
        root: int,
        k: int,
        *,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        support: int = 8,
        stop: Callable[[], bool] | None = None,
        generator: torch.Generator | None = None,
        min_p: float = 0.0,
        processing: LogitsProcessing | None = None,
        logits_seen: Callable[[np.ndarray], None] | None = None,
    ) -> tuple[list[int], Tensor | None, Tensor | None]:
        """A chain of k draft tokens after `root` (the token at the first unverified position).
        Returns the tokens and, when sampling, q_ids/q_probs [k, min(support, V)]: the distributions they came
        from (k = 0 gives [0, min(support, V)]). `stop`, asked after each token but the last: True ends the chain
        there, shorter; draft(tokens[-1], the rest, same generator) then goes on as if it had not stopped.
        `logits_seen` gets each position's logits [V] (numpy) as the rule reads them (processed), before its token
        is chosen."""
        tokens: list[int] = []
        q_ids, q_probs = [], []
        token = root
        for _ in range(k):
            logits = self._step(token)
            if processing is not None:  # this position's context: the root's, then the tokens drafted so far
                logits = processing.after(tokens).apply_np(logits.float().cpu().numpy())  # [V] float64
            if logits_seen is not None:
                logits_seen(logits if processing is not None else logits.float().cpu().numpy())
            if temperature == 0:
                token = int(logits.argmax())
            else:
                logits = logits if processing is not None else logits.float().cpu().numpy()
                p = probabilities_np(logits, temperature, top_p, top_k, min_p)
                ids, q = (torch.from_numpy(a) for a in proposal(p, support))
                token = int(ids[torch.multinomial(q, 1, generator=generator)])
                q_ids.append(ids)
                q_probs.append(q)
            tokens.append(token)
            self._drafted += 1
            if stop is not None and len(tokens) < k and stop():
                break
        if temperature == 0:
            return tokens, None, None
        if not tokens:  # torch.stack refuses an empty list; a round with one token left drafts none
            width = min(support, self.target.cfg.vocab_size)
            return tokens, torch.empty(0, width, dtype=torch.long), torch.empty(0, width, dtype=torch.float32)
        return tokens, torch.stack(q_ids), torch.stack(q_probs)

    @torch.inference_mode()
    def feed(self, tokens: list[int], processing: LogitsProcessing | None = None) -> int | None:
        """Step over `tokens`, already decided (a round sent, a prompt's tail), as drafted rows after those held;
        the argmax after the last of them (None for none), processed by `processing` (the position after them).
        Nothing is sampled."""
        if not tokens:
            return None
        logits = self._feed(tokens)
        self._drafted += len(tokens)
        if processing is not None:
            return int(processing.apply_np(logits.float().cpu().numpy()).argmax())
        return int(logits.argmax())

    def _feed(self, tokens: list[int]) -> Tensor:
        """Logits [V] after the last of `tokens`, fed at the next positions. One step per token unless a subclass
        can feed them in one causal forward."""
        for t in tokens:
            logits = self._step(t)
        return logits

    @torch.inference_mode()
    def discard_drafts(self) -> None:
        """Drop the cache rows of drafts never answered (a lost round): the next draft follows the verified
        positions again instead of the abandoned chain."""
        self._drop_drafted(self.verified_length())
        self._drafted = 0

    @torch.inference_mode()
    def draft_tree(self, root: int, *, depth: int, top_k: int, total_tokens: int,
                   processing: LogitsProcessing | None = None) -> DraftTree:  # fmt: skip
        """An EAGLE-2 dynamic draft tree after `root`, the token after the rows held (module docstring): each level
        feeds the frontier nodes as new cache rows (one drafter forward per level), then the most probable
        `total_tokens` nodes are kept. The rows it fed are dropped again. With `processing` (the position after
        the root's) each node's logits are processed after the tokens on its path before its children are picked."""
        base = self.verified_length() + self._drafted
        rows: dict[int, int] = {}  # GrowingTree id -> drafted row offset (position base + offset in the caches)

        def step(frontier: list[int], tree: GrowingTree) -> tuple[Tensor, Tensor]:
            n_rows = len(rows)
            F = len(frontier)
            # Built on the host and copied once: set entry by entry on a GPU, a 24-level tree's masks cost ~1,000
            # one-element device writes a round (top_k x depth^2 / 2 ancestor entries), each its own GPU operation.
            mask = np.zeros((F, base + n_rows + F), dtype=bool)
            mask[:, :base] = True  # every node sees the verified prefix
            for j, node in enumerate(frontier):
                mask[j, [base + rows[a] for a in tree.path_to(node)[:-1]]] = True  # its ancestors' rows
                mask[j, base + n_rows + j] = True  # and itself
            mask = torch.from_numpy(mask).to(self.device)  # [F, base + n_rows + F]
            tokens = torch.tensor([tree.tokens[i] for i in frontier], device=self.device)
            positions = torch.tensor([base + tree.depths[i] for i in frontier], device=self.device)
            parent_rows = [rows.get(tree.parents[i]) for i in frontier]
            logits = self._tree_step(tokens, positions, mask, parent_rows)  # [F, V]
            for j, node in enumerate(frontier):
                rows[node] = n_rows + j
            if processing is None:
                logits = logits.float()
            else:
                paths = [processing.after([tree.tokens[a] for a in tree.path_to(node)[1:]]) for node in frontier]
                logits = ProcessingRows.stack(paths, logits.shape[-1]).to(logits.device).apply(logits)  # [F, V]
            top = logits.log_softmax(-1).topk(top_k, dim=-1)
            return top.indices, top.values

        tree = expand_dynamic_tree(root, step, depth=depth, top_k=top_k, total_tokens=total_tokens)
        self._drop_drafted(base)
        return tree
