"""The client-side drafting loop, written once in numpy over a backend (tether.shared.contracts.DraftBackend).

Purpose: every drafter drafts by the same rules; only the caches and the forward differ. The torch drafters
(tether.shared.drafter_runtime.TorchDraftBackend, on any device) and the ONNX graphs (tether.client.onnx_backends)
are backends: they feed tokens into their caches and return logits as numpy arrays. This loop turns those into what
tether.shared.contracts.Drafter promises, torch-free, so the edge client runs it without torch:

- `begin(delta)` starts from the prompt's delta (start 0), `commit(delta, keep_drafts)` adopts the verified states
  of a round's root and accepted drafts. The drafted rows after them are dropped, unless `keep_drafts` and the caches
  hold rows past the delta: then they stay as drafted and the next draft goes on after them, with no re-feed (the
  caller vouches that the rows at the delta's positions are of its tokens: a round drafted ahead and borne out,
  tether.client.rounds). It returns whether it kept any. `discard_drafts()` drops a lost round's rows.
- `draft(root, k)` drafts a chain of k tokens after `root` (the token at the first unheld position): greedy the
  argmax; with temperature > 0 each token is drawn from the drafter's distribution (tether.shared.sampling's rule)
  truncated to its top-`support` tokens, and that exact truncated distribution is returned with it (q_ids int64 /
  q_probs fp32, [k, min(support, V)], k = 0 included), so the verifier's rejection sampling stays lossless while the
  message that carries q stays small. The draw comes from the backend's `sampler(generator)`: a torch.Generator
  for torch drafters, a numpy Generator or int seed for ONNX (the same distributions, not the same stream). `stop`,
  asked after each token but the last, ends the chain early; draft(tokens[-1], the rest, the same generator) then
  goes on as if it had not stopped.
- `feed(tokens)` steps over tokens already decided (a round sent, a prompt's tail) as drafted rows, nothing sampled;
  it returns the argmax after the last of them (None for none).
- `draft_tree(root, depth, top_k, total_tokens)` grows an EAGLE-2 dynamic tree (tether.shared.draft_trees): each
  level feeds the frontier as new rows (one backend call per level), each node seeing the held rows and its
  ancestors' rows; its children are the top_k of its log-softmax (deterministic picks, which the verifier treats as
  point-mass proposals). The tree grows after the rows held (a chain drafted ahead included) and its rows are
  dropped again. It returns a TreeDraft of plain lists.
- With a `processing` (the logit_bias and penalties of the position after the root, tether.shared.logits_processing)
  each drafted position's logits are processed as the verifier will process the target's there: with the counts of
  the context plus the drafted tokens on its path, so greedy drafts are what penalised greedy decoding would pick.
  `logits_seen` gets each chain position's logits [V] as the rule reads them (processed), before its token is
  chosen (offline logprobs: tether.client.logprobs).

    loop = DraftLoop(backend)
    loop.begin(delta_for_prompt)
    tokens, q_ids, q_probs = loop.draft(root_token, k=5, temperature=0.8, generator=rng)
    tree = loop.draft_tree(root_token, depth=6, top_k=8, total_tokens=48)
    loop.commit(delta_for_root_and_accepted)    # or, when the round's answer never came:
    loop.discard_drafts()

Tests: tests/shared/test_draft_loop.py (the rules over a scripted backend), tests/client/test_onnx_backend.py and
tests/client/test_round_shape.py (both backends over real deltas).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from tether.shared.contracts import DeltaLike, DraftBackend
from tether.shared.draft_trees import GrowingTree, TreeDraft, expand_tree
from tether.shared.logits_processing import LogitsProcessing
from tether.shared.sampling import probabilities_np, proposal, top_k_ids


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Along the last axis, in fp32, or fp64 for processed logits (which are float64)."""
    x = logits.astype(np.float64 if logits.dtype == np.float64 else np.float32)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


class DraftLoop:
    """The drafting rules over one backend (module docstring); a tether.shared.contracts.Drafter."""

    def __init__(self, backend: DraftBackend):
        self.backend = backend

    def begin(self, delta: DeltaLike, capacity: int | None = None) -> None:
        """Start a sequence from the verified prompt (delta.start must be 0), caches sized `capacity` positions."""
        if delta.start != 0:
            raise ValueError("begin() takes the prompt's delta, which starts at position 0")
        self.backend.begin(capacity)
        self.backend.commit(delta, False)

    def commit(self, delta: DeltaLike, keep_drafts: bool = False) -> bool:
        """Adopt the verified states of the round's root and accepted drafts; whether the rows drafted after them
        were kept (module docstring)."""
        keep = keep_drafts and self.backend.rows() > delta.start + len(delta.tokens)
        self.backend.commit(delta, keep)
        return keep

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
        generator: Any = None,
        min_p: float = 0.0,
        processing: LogitsProcessing | None = None,
        logits_seen: Callable[[np.ndarray], None] | None = None,
    ) -> tuple[list[int], np.ndarray | None, np.ndarray | None]:
        """A chain of up to k draft tokens after `root`: (tokens, q_ids, q_probs), the q's None when greedy."""
        draw = self.backend.sampler(generator) if temperature > 0 else None
        tokens: list[int] = []
        q_ids, q_probs = [], []
        token = root
        for _ in range(k):
            logits = self.backend.step(token)  # [V]
            if processing is not None:  # this position's context: the root's, then the tokens drafted so far
                logits = processing.after(tokens).apply_np(logits)  # [V] float64
            if logits_seen is not None:
                logits_seen(logits)
            if draw is None:
                token = int(logits.argmax())
            else:
                ids, q = proposal(probabilities_np(logits, temperature, top_p, top_k, min_p), support)
                token = int(ids[draw(q)])
                q_ids.append(ids)
                q_probs.append(q)
            tokens.append(token)
            if stop is not None and len(tokens) < k and stop():
                break
        if draw is None:
            return tokens, None, None
        n, width = len(tokens), min(support, self.backend.vocab_size)
        return tokens, np.asarray(q_ids, np.int64).reshape(n, width), np.asarray(q_probs, np.float32).reshape(n, width)

    def feed(self, tokens: list[int], processing: LogitsProcessing | None = None) -> int | None:
        """Step over `tokens`, already decided, as drafted rows after those held; the argmax after the last of them
        (None for none), processed by `processing` (the position after them). Nothing is sampled."""
        if not tokens:
            return None
        logits = self.backend.feed(tokens)  # [V]
        return int((logits if processing is None else processing.apply_np(logits)).argmax())

    def discard_drafts(self) -> None:
        """Drop the rows of drafts never answered (a lost round): the next draft follows the verified positions
        again instead of the abandoned chain."""
        self.backend.drop(self.backend.verified_length())

    def verified_length(self) -> int:
        return self.backend.verified_length()

    def draft_tree(
        self, root: int, *, depth: int, top_k: int, total_tokens: int, processing: LogitsProcessing | None = None
    ) -> TreeDraft:
        """An EAGLE-2 dynamic draft tree after `root`, the token after the rows held, of at most `total_tokens`
        nodes (module docstring). With `processing` (the position after the root's) each node's logits are
        processed after the tokens on its path before its children are picked."""
        base = self.backend.rows()
        rows: dict[int, int] = {}  # GrowingTree id -> drafted row offset (position base + offset in the caches)

        def step(frontier: list[int], grown: GrowingTree) -> tuple[np.ndarray, np.ndarray]:
            n_rows, F = len(rows), len(frontier)
            # Built on the host and handed over once: a device backend copies it in one transfer, not entry by entry.
            mask = np.zeros((F, base + n_rows + F), dtype=bool)
            mask[:, :base] = True  # every node sees the rows held
            for j, node in enumerate(frontier):
                mask[j, [base + rows[a] for a in grown.path_to(node)[:-1]]] = True  # its ancestors' rows
                mask[j, base + n_rows + j] = True  # and itself
            tokens = [grown.tokens[i] for i in frontier]
            positions = [base + grown.depths[i] for i in frontier]
            parent_rows = [rows.get(grown.parents[i]) for i in frontier]
            logits = self.backend.tree_step(tokens, positions, mask, parent_rows)  # [F, V]
            for j, node in enumerate(frontier):
                rows[node] = n_rows + j
            if processing is not None:
                paths = [processing.after([grown.tokens[a] for a in grown.path_to(node)[1:]]) for node in frontier]
                logits = np.stack([p.apply_np(row) for p, row in zip(paths, logits, strict=True)])  # [F, V] float64
            logp = log_softmax(logits)
            ids = top_k_ids(logp, top_k)  # [F, top_k]
            return ids, np.take_along_axis(logp, ids, -1)

        tree = expand_tree(root, step, depth=depth, top_k=top_k, total_tokens=total_tokens)
        self.backend.drop(base)
        return tree
