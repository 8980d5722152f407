"""EAGLE-2 dynamic draft trees, grown on plain lists: the one implementation both ends use, torch-free.

A drafter grows a tree of candidate continuations level by level and keeps its most probable nodes; the drafting
loop every drafter runs (tether.shared.draft_loop) calls `expand_tree`, and
tether.shared.speculative.expand_dynamic_tree wraps it for a step of tensors (tensors in, a DraftTree out). The rules:

- `step(frontier, tree)` gets the GrowingTree ids to expand (their tokens, parents and paths are in `tree`) and
  returns the drafter's top_k next tokens and their log-probabilities for each, two [len(frontier), top_k]
  array-likes (numpy arrays, or anything `numpy.asarray` takes).
- A node's score is its path's cumulative log-probability (root 0). Each of the `depth` levels expands the
  frontier into top_k children per node, all of which become candidates; the next frontier is the top_k
  highest-scoring new children of the level, across parents.
- Finally the best total_tokens - 1 candidates (ties to the earlier-created) are kept with the root, re-indexed
  parents first with siblings by descending score, so the verifier tries the drafter's favourite child first.
  Children are deterministic picks (no q). The result has min(total_tokens, 1 + candidates) nodes.

    tree = expand_tree(root, step, depth=4, top_k=3, total_tokens=16)
    tree.tokens, tree.parents, tree.source_ids   # node 0 is the root; source_ids: each node's GrowingTree id

Tests: tests/shared/test_speculative.py (through expand_dynamic_tree), tests/shared/test_draft_loop.py and
tests/client/test_onnx_backend.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np


class GrowingTree:
    """The candidate tree `expand_tree` grows, handed to the drafter's step callback.

    Ids are creation order: 0 is the root, then each level's children parent by parent, k by k, so a drafter
    can index per-candidate state (hidden states, its own KV rows) by id. Every field is a plain list.
    """

    def __init__(self, root_token: int):
        self.tokens: list[int] = [root_token]
        self.parents: list[int] = [-1]
        self.scores: list[float] = [0.0]  # cumulative drafter log-prob of the path from the root
        self.depths: list[int] = [0]

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, parent: int, token: int, logprob: float) -> int:
        self.tokens.append(token)
        self.parents.append(parent)
        self.scores.append(self.scores[parent] + logprob)
        self.depths.append(self.depths[parent] + 1)
        return len(self.tokens) - 1

    def path_to(self, i: int) -> list[int]:
        """Ids from the root to node i, both included."""
        path = []
        while i >= 0:
            path.append(i)
            i = self.parents[i]
        return path[::-1]


@dataclass(frozen=True)
class TreeDraft:
    """A kept draft tree as plain lists, in the verifier's order: node 0 is the root, parents come first."""

    tokens: list[int]
    parents: list[int]  # parents[0] == -1
    source_ids: list[int]  # the GrowingTree id each node had while the tree grew

    def __len__(self) -> int:
        return len(self.tokens)


StepFn = Callable[[list[int], GrowingTree], tuple[Any, Any]]


def expand_tree(root_token: int, step: StepFn, *, depth: int, top_k: int, total_tokens: int) -> TreeDraft:
    """Grow and prune an EAGLE-2 dynamic tree after `root_token` (the rules are in the module docstring)."""
    if depth < 1 or top_k < 1 or total_tokens < 1:
        raise ValueError(f"need depth, top_k, total_tokens >= 1, got {depth}, {top_k}, {total_tokens}")
    grown = GrowingTree(root_token)
    frontier = [0]
    for level in range(depth):
        ids, logps = step(frontier, grown)
        ids, logps = np.asarray(ids), np.asarray(logps, dtype=np.float64)
        if ids.shape != (len(frontier), top_k) or logps.shape != ids.shape:
            raise ValueError(f"step must return two [{len(frontier)}, {top_k}] arrays, got {ids.shape}, {logps.shape}")
        if np.isnan(logps).any():
            raise ValueError("step returned NaN log-probabilities")
        # A log-prob rounded above 0 would let a child outscore its parent and break ancestor closure.
        logps = np.minimum(logps, 0.0)
        new = [
            grown.add(parent, token, lp)
            for parent, row_ids, row_lp in zip(frontier, ids.tolist(), logps.tolist(), strict=True)
            for token, lp in zip(row_ids, row_lp, strict=True)
        ]
        if level + 1 < depth:
            frontier = sorted(new, key=lambda i: (-grown.scores[i], i))[:top_k]

    ranked = sorted(range(1, len(grown)), key=lambda i: (-grown.scores[i], i))
    kept = {0, *ranked[: total_tokens - 1]}
    # Scores never rise along a path and ties go to the older node, so every kept node's parent ranks above it.
    if not all(grown.parents[i] in kept for i in kept if i):
        raise AssertionError("kept candidates are not closed under ancestors")
    kids: dict[int, list[int]] = {i: [] for i in kept}
    for i in sorted(kept)[1:]:
        kids[grown.parents[i]].append(i)
    order, head = [0], 0  # breadth-first: parents precede children, siblings by descending score
    while head < len(order):
        order.extend(sorted(kids[order[head]], key=lambda c: (-grown.scores[c], c)))
        head += 1
    index = {src: out for out, src in enumerate(order)}
    parents = [-1] + [index[grown.parents[i]] for i in order[1:]]
    return TreeDraft([grown.tokens[i] for i in order], parents, order)
