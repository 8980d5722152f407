"""Speculative decoding core: draft trees, the target's verdict on them, and EAGLE-2 dynamic tree expansion.

Terms (used with these meanings everywhere in tether):

- draft tokens: the tokens a drafter proposes for the positions after the last decided token. They form a
  `DraftTree` (a chain is the special case of one child per node).
- accepted tokens: the longest draft prefix (a root-to-node path of the tree) the target agrees with.
- the bonus token: the target's own token after the accepted prefix. Every round emits one, even when no draft
  token is accepted, because the target scored the position after the last accepted token anyway.
- acceptance length tau = accepted + 1: the tokens gained per verification round (the accepted ones plus the bonus).

Contract. Node 0 of a `DraftTree` is the root: the last token already decided (the previous round's bonus token,
or the last prompt token) whose K/V the target has not computed yet. It goes through the same verify forward as
the draft tokens, and the target's logits at node i predict the token after node i, so one forward scores every
node's children. `verify` turns those logits into a `Verdict`: the accepted path (node offsets including the
root, exactly what `KVCache.accept` takes) and the bonus token. The verifier does not care who drafted: it only
sees tokens, parents and, for sampled drafts, the distribution each token was drawn from.

Greedy (temperature 0): a child is accepted when it is the target's argmax. Sampling: lossless recursive rejection
sampling, so the emitted tokens are distributed exactly as if the target had sampled them one by one:

- a child with a sampled proposal carries q = the sparse distribution (top-K support) its token was drawn from,
  given everything drafted before it, including its earlier siblings. i.i.d. siblings share one q; siblings drawn
  without replacement carry q renormalised over what their earlier siblings left.
- a child without q is a deterministic pick, i.e. the point-mass proposal q = delta(token).

Penalties and logit_bias (tether.shared.logits_processing) make a position's distribution depend on its context:
node i's logits are processed with the counts of the sequence through the root plus the drafted tokens on the
root-to-i path, so each position gets exactly the distribution plain decoding would have used there.

Randomness. A sampled verdict on an n-node tree draws exactly `draw_uniforms(n, generator)`, a [2, n] float64
tensor, once and up front: row 0 entry j is the acceptance uniform of node j (entry 0 unused; a node is tested
at most once, when its parent is on the path), row 1 entry i draws the bonus token when the walk stops at node i.
The count does not depend on the path, so the batched verifier (`tether.shared.acceptance`) consumes a generator
exactly as this scalar one does and the two give the same verdict from the same seed. The target's
probabilities are float64 throughout (`target_probs`), so rounding differences between devices sit far below
what a float64 uniform resolves. Greedy draws nothing.

    tree = DraftTree.chain(root_token, draft_tokens, q_ids, q_probs)  # or expand_dynamic_tree(...)
    mask, pos = tree.ancestor_mask(), tree.positions(cache.length)
    out = target.verify(tree.tokens[None], cache, tree_mask=mask, positions=pos)
    verdict = verify(tree, out.logits[0], temperature=0.8, top_p=0.95, top_k=40, generator=gen)
    cache.accept(verdict.path)  # commits the root and the accepted tokens
    emitted = verdict.emitted_tokens(tree)  # accepted tokens + bonus; the bonus is the next round's root
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch
from torch import Tensor

from tether.shared.draft_trees import GrowingTree as GrowingTree  # re-exported: torch drafters' step callbacks take it
from tether.shared.draft_trees import TreeDraft, expand_tree
from tether.shared.logits_processing import LogitsProcessing
from tether.shared.sampling import check_rule

# Below this much residual mass, rejection was a rounding artefact (p <= q everywhere means p == q), so the
# residual is noise; the bonus is drawn from the distribution being matched instead.
_RESIDUAL_EPS = 1e-6
_CHAIN_PARENTS: dict[int, Tensor] = {}


def _chain_parents(n: int) -> Tensor:
    """[-1, 0, 1, ..., n - 2]: a chain's parents, one shared tensor per length (read-only by contract, as every
    DraftTree's tensors are)."""
    p = _CHAIN_PARENTS.get(n)
    if p is None:
        p = _CHAIN_PARENTS.setdefault(n, torch.arange(-1, n - 1, dtype=torch.long))
    return p


@dataclass(frozen=True, eq=False)  # tensors have no single truth value, so trees compare by identity
class DraftTree:
    """A draft as a tree of n nodes in topological order; node 0 is the root (the last decided token).

    q_ids / q_probs: for node i, the top-K support and probabilities its token was sampled from (row 0 unused).
    None means every child is a deterministic pick. source_ids: for trees built by `expand_dynamic_tree`, the
    `GrowingTree` id each node came from, so a drafter can gather its per-candidate state as `state[source_ids]`.
    The structure tensors (depths, ancestor_mask, positions) are built on the CPU; move them to the model.
    """

    tokens: Tensor  # [n] long
    parents: Tensor  # [n] long; parents[0] = -1, parents[i] < i
    q_ids: Tensor | None = None  # [n, K] long
    q_probs: Tensor | None = None  # [n, K] float, rows 1.. sum to 1
    source_ids: Tensor | None = None  # [n] long

    def __post_init__(self) -> None:
        n = self.tokens.numel()
        self.__dict__["_n"] = n  # len() as a plain int: the batcher asks it of every round it packs
        if self.tokens.dim() != 1 or self.parents.shape != self.tokens.shape or n == 0:
            raise ValueError(
                f"tokens and parents must be equal-length 1-D, got {self.tokens.shape}, {self.parents.shape}"
            )
        if self.parents is not _chain_parents(n):  # chain() shares one checked parents tensor per length
            parents = self.parents.tolist()
            if parents[0] != -1 or any(not 0 <= p < i for i, p in enumerate(parents) if i):
                raise ValueError(f"need parents[0] == -1 and 0 <= parents[i] < i, got {parents}")
        if (self.q_ids is None) != (self.q_probs is None):
            raise ValueError("q_ids and q_probs come together")
        if self.q_ids is not None:
            if self.q_ids.dim() != 2 or self.q_ids.shape[0] != n or self.q_probs.shape != self.q_ids.shape:
                raise ValueError(f"q_ids and q_probs must be [{n}, K], got {self.q_ids.shape}, {self.q_probs.shape}")
            rows = self.q_probs[1:].double()
            if bool((rows < 0).any()) or bool(((rows.sum(-1) - 1).abs() > 1e-3).any()):
                raise ValueError("each draft node's q_probs must be a distribution (non-negative, summing to 1)")
        if self.source_ids is not None and self.source_ids.shape != self.tokens.shape:
            raise ValueError(f"source_ids must be [{n}], got {self.source_ids.shape}")

    def __len__(self) -> int:
        return self._n

    def __getattr__(self, name: str):
        """Only for an attribute not found the usual way: a chain built from ids (`chain`) makes its `tokens` tensor
        on first use."""
        ids = self.__dict__.get("_tokens")
        if name != "tokens" or ids is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        # Through numpy: torch.tensor parses a list element by element, ~5x slower for a round's few ids.
        tokens = self.__dict__["tokens"] = torch.from_numpy(np.array(ids, dtype=np.int64))
        return tokens

    @classmethod
    def chain(
        cls,
        root_token: int,
        draft_tokens: Sequence[int] | Tensor,
        q_ids: Tensor | None = None,
        q_probs: Tensor | None = None,
    ) -> DraftTree:
        """A chain root -> d_0 -> d_1 -> ...; q_ids / q_probs [k, K] give one row per draft token (no root row)."""
        if q_ids is None and q_probs is None and not isinstance(draft_tokens, Tensor):
            # A server builds one of these a round on its event loop: a chain of ids has nothing __post_init__ could
            # refuse, so the tree is assembled directly, with what the step reads of it (plain lists) beside.
            ids = [int(root_token), *map(int, draft_tokens)]
            n = len(ids)
            tree = object.__new__(cls)
            # `tokens` is left out: __getattr__ makes it on first use, which a greedy round on the GPU never has.
            tree.__dict__.update(
                parents=_chain_parents(n),
                q_ids=None,
                q_probs=None,
                source_ids=None,
                _n=n,
                is_chain=True,
                _tokens=ids,
            )
            return tree
        ids = None
        if isinstance(draft_tokens, Tensor):
            tokens = torch.cat([torch.tensor([root_token], dtype=torch.long), draft_tokens.reshape(-1).long().cpu()])
        else:
            ids = [root_token, *draft_tokens]
            tokens = torch.from_numpy(np.array(ids, dtype=np.int64))  # [k + 1]
        n = tokens.numel()
        parents = _chain_parents(n)  # [k + 1]
        if q_ids is not None and q_probs is not None:
            # The root was not sampled from anything; a point mass on itself keeps row 0 a valid distribution.
            K = q_ids.shape[-1]
            root_ids = torch.full((1, K), root_token, dtype=torch.long, device=q_ids.device)
            root_probs = torch.zeros(1, K, dtype=q_probs.dtype, device=q_probs.device)
            root_probs[0, 0] = 1
            q_ids = torch.cat([root_ids, q_ids.reshape(-1, K).long()])  # [k + 1, K]
            q_probs = torch.cat([root_probs, q_probs.reshape(-1, K)])  # [k + 1, K]
        tree = cls(tokens, parents, q_ids, q_probs)
        # What the server's step reads of every round, known here without reading the tensors back.
        tree.__dict__.update(is_chain=True, _parents=list(range(-1, n - 1)))
        if ids is not None:
            tree.__dict__["_tokens"] = [int(t) for t in ids]
        return tree

    @classmethod
    def from_lists(cls, tree: TreeDraft) -> DraftTree:
        """A tree grown on plain lists (tether.shared.draft_trees), as the onnxruntime drafter returns them."""
        as_long = lambda xs: torch.tensor(xs, dtype=torch.long)
        return cls(as_long(tree.tokens), as_long(tree.parents), source_ids=as_long(tree.source_ids))

    @cached_property
    def _tokens(self) -> list[int]:
        return self.tokens.tolist()

    @cached_property
    def _parents(self) -> list[int]:
        return self.parents.tolist()

    @cached_property
    def _children(self) -> list[list[int]]:
        kids: list[list[int]] = [[] for _ in range(len(self))]
        for i, p in enumerate(self._parents[1:], start=1):
            kids[p].append(i)
        return kids

    @cached_property
    def _proposals(self) -> list[dict[int, float]] | None:
        """Per node, its q as {token: probability}, renormalised in float64 (what verify reads)."""
        if self.q_ids is None or self.q_probs is None:
            return None
        probs = self.q_probs.cpu().double()
        probs = (probs / probs.sum(-1, keepdim=True)).tolist()  # [n][K]
        out = []
        for row_ids, row_probs in zip(self.q_ids.tolist(), probs, strict=True):
            q: dict[int, float] = {}
            for t, pr in zip(row_ids, row_probs, strict=True):
                q[t] = q.get(t, 0.0) + pr  # summed: zero-probability padding adds nothing wherever it points
            out.append(q)
        return out

    @cached_property
    def is_chain(self) -> bool:
        """Each node's parent is the node before it (root -> d_0 -> d_1 ...)."""
        return all(p == i - 1 for i, p in enumerate(self._parents))

    @cached_property
    def depths(self) -> Tensor:
        """[n] long: the root is depth 0."""
        d = [0] * len(self)
        for i, p in enumerate(self._parents[1:], start=1):
            d[i] = d[p] + 1
        return torch.tensor(d, dtype=torch.long)

    def ancestor_mask(self) -> Tensor:
        """[n, n] bool, True where j is i or an ancestor of i: the target's tree_mask (row i sees columns j)."""
        n = len(self)
        mask = torch.eye(n, dtype=torch.bool)
        for i, p in enumerate(self._parents[1:], start=1):
            mask[i] |= mask[p]  # parents come first, so row p is already complete
        return mask

    def positions(self, start: int) -> Tensor:
        """[n] long RoPE positions when the root sits at position `start` (usually cache.length)."""
        return start + self.depths

    def children(self, i: int) -> list[int]:
        """Node i's children in index order (the order the verifier tries them)."""
        return list(self._children[i])

    def path_to(self, i: int) -> list[int]:
        """Node indices from the root to node i, both included."""
        path = []
        while i >= 0:
            path.append(i)
            i = self._parents[i]
        return path[::-1]


@dataclass(frozen=True)
class Verdict:
    """The target's decision on a draft tree."""

    path: list[int]  # accepted node indices, root (0) first; the offsets to pass to KVCache.accept
    bonus: int  # the target's token after the accepted path

    @property
    def accepted(self) -> int:
        return len(self.path) - 1

    @property
    def tau(self) -> int:
        return self.accepted + 1

    def accepted_tokens(self, tree: DraftTree) -> list[int]:
        return [tree._tokens[i] for i in self.path[1:]]

    def emitted_tokens(self, tree: DraftTree) -> list[int]:
        """The tau tokens this round adds to the output: the accepted tokens, then the bonus token."""
        return self.accepted_tokens(tree) + [self.bonus]


def through_stop(tokens: list[int], stops: Collection[int]) -> list[int]:
    """The tokens up to and including the first of `stops` (end-of-text ids, stop tokens), or all of them: where a
    generation that emitted them ends."""
    return next((tokens[: i + 1] for i, t in enumerate(tokens) if t in stops), tokens)


def draw_uniforms(n: int, generator: torch.Generator | None = None) -> Tensor:
    """The uniforms of one sampled verdict on an n-node tree: [2, n] float64 on the CPU.

    Row 0 entry j: node j's acceptance test (entry 0, the root, unused). Row 1 entry i: the bonus draw when the
    walk stops at node i. A fixed count, whatever the path, so every verifier advances the generator alike.
    """
    return torch.rand(2, n, dtype=torch.float64, generator=generator)


def target_probs(
    logits: Tensor,
    temperature: float | Tensor,
    top_p: float | Tensor = 1.0,
    top_k: int | Tensor = 0,
    min_p: float | Tensor = 0.0,
) -> Tensor:
    """logits [..., V] -> float64 probabilities [..., V] under temperature (> 0), top-k, top-p and min-p, row by row.

    The rule is `sampling.probabilities`' (keep the top_k most probable tokens, 0 keeping all, and renormalise;
    then keep the smallest prefix of the sorted probabilities whose mass reaches top_p, the first always survives,
    and renormalise; then drop the tokens below min_p times the largest and renormalise; top_p 1, top_k 0 and
    min_p 0 keep everything untouched), in float64 instead of float32: the verifier compares these against float64
    uniforms, and float32 rounding (which differs between a CPU and a GPU) would flip a comparison about once in
    10^7. temperature, top_p, top_k and min_p are numbers, or tensors of shape logits.shape[:-1] for a batch of
    rows with their own settings. Ties sort stably (lower token id first), so every device truncates the same
    tokens. The logits are the processed ones where a sequence has penalties or a logit_bias
    (tether.shared.logits_processing).
    """
    probs = _truncated(logits.double(), temperature, top_p, top_k)
    if isinstance(min_p, Tensor):
        m = min_p.to(probs.device, torch.float64)[..., None]  # [..., 1]
        kept = probs.masked_fill(probs < m * probs.amax(-1, keepdim=True), 0.0)
        # A row with min_p 0 keeps its probabilities bit for bit, as the number path returns them.
        return torch.where(m > 0, kept / kept.sum(-1, keepdim=True), probs)
    if min_p > 0:
        kept = probs.masked_fill(probs < min_p * probs.amax(-1, keepdim=True), 0.0)
        return kept / kept.sum(-1, keepdim=True)
    return probs


def _truncated(logits: Tensor, temperature: float | Tensor, top_p: float | Tensor, top_k: int | Tensor) -> Tensor:
    """target_probs before min-p: temperature, top-k, top-p (float64 logits [..., V] -> probabilities [..., V])."""
    V, dev = logits.shape[-1], logits.device
    temperature = torch.as_tensor(temperature, dtype=torch.float64, device=dev)
    probs = (logits / temperature[..., None]).softmax(-1)  # [..., V]
    per_row = isinstance(top_p, Tensor) or isinstance(top_k, Tensor)
    if not per_row and top_p >= 1 and not 0 < top_k < V:
        return probs  # no truncation at all: skip the sort
    # Numbers stay numbers and tensors stay on the device: building a tensor from a number here would copy it to
    # the device, which the batched verifier (shared/acceptance.py) must never wait for.
    cut = top_p.to(dev, torch.float64)[..., None] if isinstance(top_p, Tensor) else top_p  # [..., 1] or a number
    if isinstance(top_k, Tensor):
        k = top_k.to(dev, torch.long)[..., None]
        k = torch.where((k > 0) & (k < V), k, V)  # [..., 1]: the tokens top-k keeps, V where it is off
    else:
        k = top_k if 0 < top_k < V else V
    sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)  # [..., V] each
    if isinstance(k, Tensor) or k < V:
        cut_k = sorted_p.masked_fill(torch.arange(V, device=dev) >= k, 0.0)
        cut_k = cut_k / cut_k.sum(-1, keepdim=True)
        # Rows whose top-k is off keep their sorted probabilities bit for bit (top-p alone computes as before).
        sorted_p = torch.where(k < V, cut_k, sorted_p) if isinstance(k, Tensor) else cut_k
    # Only where top_p < 1: a cumsum that rounds up to 1 before the tail would otherwise drop its smallest tokens.
    if isinstance(cut, Tensor):
        drop = ((sorted_p.cumsum(-1) - sorted_p) >= cut) & (cut < 1)
    else:
        drop = (sorted_p.cumsum(-1) - sorted_p) >= cut if cut < 1 else torch.zeros_like(sorted_p, dtype=torch.bool)
    kept = torch.zeros_like(probs).scatter(-1, order, sorted_p.masked_fill(drop, 0.0))
    kept = kept / kept.sum(-1, keepdim=True)
    if not per_row:
        return kept
    # A row that truncates nothing keeps its untruncated probabilities bit for bit, as the number path returns them.
    truncates = (cut < 1) if isinstance(cut, Tensor) else torch.full_like(kept[..., :1], cut < 1, dtype=torch.bool)
    return torch.where(truncates | (k < V), kept, probs)


def verify(
    tree: DraftTree,
    target_logits: Tensor,  # [n, V]; row i predicts the token after node i
    *,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    processing: LogitsProcessing | None = None,
    generator: torch.Generator | None = None,
) -> Verdict:
    """Walk the tree from the root, accepting children the target agrees with; see the module docstring.

    This is the readable scalar reference; `tether.shared.acceptance` does the same for a batch of trees on the
    device. `processing`: the logit_bias and penalties of the root's position (its context: the sequence through
    the root), or None; node i's logits are processed with it after the drafted tokens on its path, so every
    position sees its own context. Greedy ignores any q and draws nothing. Sampling draws
    `draw_uniforms(len(tree), generator)` (a CPU generator; the vocab-sized arithmetic runs on the CPU in float64),
    so a seeded generator reproduces the verdict on any device.
    """
    if target_logits.dim() != 2 or target_logits.shape[0] != len(tree):
        raise ValueError(f"target_logits must be [{len(tree)}, V], got {tuple(target_logits.shape)}")
    tokens = tree._tokens

    def logits_at(i: int) -> Tensor:  # [V] node i's logits, processed with its own context
        if processing is None:
            return target_logits[i].cpu()
        after = processing.after([tokens[a] for a in tree.path_to(i)[1:]])
        return torch.from_numpy(after.apply_np(target_logits[i].float().cpu().numpy()))

    path = [0]
    if temperature == 0:
        # One device sync for the whole tree; with processing, each node on the walk is processed on its own.
        best = target_logits.argmax(-1).tolist() if processing is None else None
        while True:
            cur = path[-1]
            top = best[cur] if best is not None else int(logits_at(cur).argmax())
            nxt = next((c for c in tree.children(cur) if tokens[c] == top), None)
            if nxt is None:
                return Verdict(path, top)
            path.append(nxt)

    check_rule(temperature, top_p, top_k, min_p)
    proposals = tree._proposals
    u_accept, u_bonus = draw_uniforms(len(tree), generator).tolist()  # [n] each
    while True:
        cur = path[-1]
        # Only rows on the walk are needed, so they are moved and truncated one at a time; numpy because these
        # vocab-sized steps are tiny and torch's per-op overhead would dominate them.
        p = target_probs(logits_at(cur), temperature, top_p, top_k, min_p).numpy()  # [V]
        for child in tree.children(cur):
            x = tokens[child]
            q = {x: 1.0} if proposals is None else proposals[child]
            qx = q.get(x, 0.0)
            if qx <= 0:
                raise ValueError(f"draft node {child} has token {x} outside the support of its proposal q")
            if u_accept[child] < p[x] / qx:  # accept with probability min(1, p(x) / q(x))
                path.append(child)
                break
            residual = p.copy()
            for t, pr in q.items():
                residual[t] = max(0.0, residual[t] - pr)  # max(0, p - q), touching only q's support
            mass = residual.sum()
            if mass > _RESIDUAL_EPS:
                p = residual / mass
        else:
            return Verdict(path, _draw(p, u_bonus[cur]))


def _draw(p: np.ndarray, u: float) -> int:
    """The token at uniform u of the distribution p [V], by inverse CDF."""
    cdf = p.cumsum()  # [V]
    # side="right" returns the first index whose CDF exceeds the target, which skips zero-probability tokens.
    i = int(cdf.searchsorted(u * cdf[-1], side="right"))
    # u * total can round up to the total; the last token with mass is then the right answer.
    return i if i < len(p) else int(np.flatnonzero(p)[-1])


StepFn = Callable[[list[int], GrowingTree], tuple[Tensor, Tensor]]


def expand_dynamic_tree(root_token: int, step: StepFn, *, depth: int, top_k: int, total_tokens: int) -> DraftTree:
    """EAGLE-2 dynamic draft tree for a torch drafter: tether.shared.draft_trees.expand_tree (the rules are there)
    with `step` returning two [len(frontier), top_k] tensors (ids, log-probs), and the kept tree as a DraftTree
    whose `source_ids` map each node back to its GrowingTree id."""

    def as_arrays(frontier: list[int], tree: GrowingTree) -> tuple[np.ndarray, np.ndarray]:
        ids, logps = step(frontier, tree)
        return ids.cpu().numpy(), logps.double().cpu().numpy()

    return DraftTree.from_lists(expand_tree(root_token, as_arrays, depth=depth, top_k=top_k, total_tokens=total_tokens))


def accept_length_stats(verdicts: Sequence[Verdict]) -> dict[str, float]:
    """Summary over verification rounds: rounds, mean tau (nan without rounds), tokens gained (the sum of tau)."""
    tokens = sum(v.tau for v in verdicts)
    rounds = len(verdicts)
    return {"rounds": rounds, "mean_tau": tokens / rounds if rounds else math.nan, "tokens": tokens}
