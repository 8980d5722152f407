"""Batched acceptance: the speculative verdict for a whole batch of draft trees, on the device, in one pass.

Purpose. `speculative.verify` is the readable scalar reference: one tree, a Python walk, float64 numpy on the CPU.
A server verifying B sequences per forward would pay B of those walks and B device syncs. `accept` decides all B
verdicts with tensor operations on the logits' own device (CPU in CI, CUDA on the server): no Python loop over
rows and no host sync, so it can be queued behind the forward that produced the logits. `verify_rows` is the host
wrapper that pads `DraftTree`s into tensors, calls `accept`, and copies the small answer back once.

Contract: exactly `verify`'s verdict, row by row, from the same logits and the same seeded generator.

- Rows are padded to T nodes; nodes >= sizes[b] are padding and are never tested or accepted, whatever their
  tokens and parents (which need only be valid indices in [0, T)).
- Greedy rows (temperature 0) and sampled rows mix freely in one batch, and so do rows with and without min-p,
  penalties or a logit_bias: each row's logits are processed per node with the counts of the node's own path
  (`ProcessingRows`, `_path_counts`), a loop over node indices that runs only when some row processes logits.
- Sampled rows use the uniform layout of `speculative.draw_uniforms`: uniforms[b, 0, j] tests node j,
  uniforms[b, 1, i] draws the bonus when the walk stops at node i. `verify_rows` draws them on the CPU from each
  row's generator, so a seeded generator gives the same verdict on any device and the same as `verify`.
- Probabilities are float64 (`speculative.target_probs`), so the device's rounding (last bits) only matters
  when a uniform lands within ~1e-16 of a threshold.
- A tested draft token outside its own proposal's support is reported in `Acceptance.bad` (raising inside
  `accept` would need a sync); `verify_rows` turns that row alone into a ValueError, as `verify` would raise.

    out = target.run(tokens, ...)  # logits [B, T, V]
    verdicts = verify_rows(trees, out.logits, temperatures, top_ps, generators, top_ks)
    for v in verdicts:  # a Verdict, or the ValueError `verify` would have raised for that row
        ...
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from tether.shared.logits_processing import LogitsProcessing, ProcessingRows
from tether.shared.sampling import check_rule
from tether.shared.speculative import _RESIDUAL_EPS, DraftTree, Verdict, draw_uniforms, target_probs


@dataclass(frozen=True, eq=False)  # tensors have no single truth value, so results compare by identity
class Acceptance:
    """The verdicts of a batch, as device tensors (copy them to the host once, together)."""

    on_path: Tensor  # [B, T] bool: the accepted path, the root (node 0) included
    leaf: Tensor  # [B] long: the last accepted node (the deepest on the path)
    bonus: Tensor  # [B] long: the target's token after the leaf
    bad: Tensor  # [B] bool: a tested draft token had q(x) == 0; the row's verdict is meaningless


def accept(
    logits: Tensor,  # [B, T, V]; row [b, i] predicts the token after node i of tree b
    tokens: Tensor,  # [B, T] long
    parents: Tensor,  # [B, T] long; parents[b, i] < i for real nodes, anything in [0, T) (or -1 at 0) otherwise
    sizes: Tensor,  # [B] long; nodes >= sizes[b] are padding
    temperature: Tensor,  # [B] float; 0 = greedy
    top_p: Tensor | None = None,  # [B] float in (0, 1]; None = 1 for every row (and no sort at all)
    q_ids: Tensor | None = None,  # [B, T, K] long: the support each node's token was drawn from
    q_probs: Tensor | None = None,  # [B, T, K] float: its probabilities; None with q_ids = point masses
    uniforms: Tensor | None = None,  # [B, 2, T] float64, the `draw_uniforms` layout; None = drawn on the device
    *,
    top_k: Tensor | None = None,  # [B] long; 0 = off; None = off for every row (keyword only: added last)
    min_p: Tensor | None = None,  # [B] float in [0, 1]; 0 = off; None = off for every row
    processing: ProcessingRows | None = None,  # each row's logit_bias and penalties at its root; None = none
    sampled: bool = True,
) -> Acceptance:
    """The verdicts of B padded draft trees; see the module docstring.

    `processing` holds each row's logits stage at its root's position (tether.shared.logits_processing); node j
    of a row is processed with it after the drafted tokens on j's path (`_path_counts`), greedy rows included.
    sampled=False is the caller's promise (a host-side fact, so no sync) that every row is greedy: it skips the
    sampled walk, whose cost does not depend on how many rows need it. Inputs may live on the CPU; they are moved
    to logits.device.
    """
    B, T, V = logits.shape
    dev = logits.device
    # non_blocking: a host-to-device copy that blocks would wait for the queue (the forward) to drain.
    tokens = tokens.to(dev, non_blocking=True)
    sizes = sizes.to(dev, non_blocking=True)
    temperature = temperature.to(dev, torch.float64, non_blocking=True)
    # Padding parents are anything valid; clamping keeps every gather in range, and node 0's -1 becomes 0.
    parents = parents.to(dev, non_blocking=True).clamp(0, T - 1)  # [B, T]
    node = torch.arange(T, device=dev)  # [T]
    real = node < sizes[:, None]  # [B, T] the tree's own nodes
    greedy = temperature == 0  # [B]
    logits_at = None  # node j's logits [B, V], processed with each row's context through j, when rows process them
    if processing is not None:
        processing = processing.to(dev, non_blocking=True)
        on_path_of = _path_counts(parents, node)  # [B, T, T]

        def logits_at(j: int) -> Tensor:
            extra = torch.zeros(B, V, dtype=torch.float64, device=dev).scatter_add_(1, tokens, on_path_of[:, j])
            return processing.after(extra).apply(logits[:, j])

    best = None if logits_at is None else torch.stack([logits_at(j).argmax(-1) for j in range(T)], 1)  # [B, T]
    on_path, leaf, bonus = _greedy(logits, tokens, parents, real, node, best)
    bad = torch.zeros(B, dtype=torch.bool, device=dev)
    if sampled:
        if uniforms is None:
            uniforms = torch.rand(B, 2, T, dtype=torch.float64, device=dev)
        s_on_path, s_leaf, s_bonus, s_bad = _sampled(
            logits,
            tokens,
            parents,
            real,
            torch.where(greedy, 1.0, temperature),
            top_p,
            top_k,
            q_ids,
            q_probs,
            uniforms,
            min_p,
            logits_at,
        )
        on_path = torch.where(greedy[:, None], on_path, s_on_path)
        leaf = torch.where(greedy, leaf, s_leaf)
        bonus = torch.where(greedy, bonus, s_bonus)
        bad = ~greedy & s_bad
    return Acceptance(on_path, leaf, bonus, bad)


def _path_counts(parents: Tensor, node: Tensor) -> Tensor:
    """[B, T, T] float64: entry [b, j, a] is 1 where node a is j or one of its ancestors, the root excluded (its
    token is in the context already): the drafted tokens node j's position is conditioned on. Padding rows are
    whatever their parents give; nobody reads them."""
    B, T = parents.shape
    on_path = (node[:, None] == node[None, :]).expand(B, T, T).clone()  # [B, T, T] each node is on its own path
    rows = torch.arange(B, device=parents.device)
    for j in range(1, T):  # parents come first, so a parent's row is complete before its children's
        on_path[:, j] |= on_path[rows, parents[:, j]]
    on_path[:, :, 0] = False
    return on_path.double()


def _greedy(
    logits: Tensor, tokens: Tensor, parents: Tensor, real: Tensor, node: Tensor, best: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """Greedy verdicts without a walk: a node is on the path iff it and all its ancestors are each their parent's
    first child (in index order) that matches the target's argmax, which is exactly where the walk goes. `best`
    [B, T]: the argmax of each node's processed logits, when rows process them."""
    B, T, _ = logits.shape
    if best is None:
        best = logits.argmax(-1)  # [B, T] the target's token after each node (first maximum on ties, as verify)
    match = (tokens == best.gather(1, parents)) & real & (node > 0)  # [B, T]
    # An earlier sibling that also matches wins (duplicate sibling tokens: the first one is taken).
    earlier_sibling = (parents[:, None, :] == parents[:, :, None]) & (node[None, :] < node[:, None])  # [B, j, i]
    chosen = match & ~(earlier_sibling & match[:, None, :]).any(-1)  # [B, T]
    # Pointer doubling: after r rounds ok[j] is the AND of `chosen` over j's 2^r nearest ancestors-or-self and
    # jump[j] is its 2^r-th ancestor (the root is a fixed point that counts as chosen). Depth < T, so
    # ceil(log2 T) rounds cover every path; a real node's ancestors are real, so padding never leaks in.
    ok = chosen | (node == 0)  # [B, T]
    jump = torch.where(node == 0, 0, parents)  # [B, T]
    for _ in range((T - 1).bit_length()):
        ok = ok & ok.gather(1, jump)
        jump = jump.gather(1, jump)
    on_path = ok & real  # [B, T]
    leaf = torch.where(on_path, node, 0).amax(-1)  # [B] on-path nodes form one chain, so the deepest is the max
    bonus = best.gather(1, leaf[:, None])[:, 0]  # [B]
    return on_path, leaf, bonus


def _sampled(
    logits: Tensor,
    tokens: Tensor,
    parents: Tensor,
    real: Tensor,
    temperature: Tensor,
    top_p: Tensor | None,
    top_k: Tensor | None,
    q_ids: Tensor | None,
    q_probs: Tensor | None,
    uniforms: Tensor,
    min_p: Tensor | None = None,
    logits_at: Callable[[int], Tensor] | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Recursive rejection sampling, vectorised over the batch: one pass over node indices 1..T-1.

    Why one pass suffices: the scalar walk tests the current node's children in index order and, on accepting
    child j, moves to j's children, which all come after j. So at index j the only possible test is "is j a child
    of the row's current node?"; children of an abandoned node are skipped because their parent is no longer
    current. Each node's probabilities are computed at its own index ([B, V] at a time rather than [B, T, V]:
    float64 over a 128k vocabulary would otherwise take gigabytes).
    """
    B, T, V = logits.shape
    dev = logits.device
    if top_p is not None:
        top_p = top_p.to(dev, torch.float64, non_blocking=True)  # [B]
    if top_k is not None:
        top_k = top_k.to(dev, torch.long, non_blocking=True)  # [B]
    if min_p is not None:
        min_p = min_p.to(dev, torch.float64, non_blocking=True)  # [B]
    if q_ids is None:  # every node a deterministic pick: q = delta(token)
        q_ids, q_probs = tokens[..., None], torch.ones(B, T, 1, dtype=torch.float64, device=dev)
    q_ids = q_ids.to(dev, torch.long, non_blocking=True)  # [B, T, K]
    q_probs = q_probs.to(dev, torch.float64, non_blocking=True)  # [B, T, K]
    # Renormalised in float64, as DraftTree._proposals does; an all-zero (padding) row stays zero, not NaN.
    q_mass = q_probs.sum(-1, keepdim=True)  # [B, T, 1]
    q_probs = q_probs / torch.where(q_mass > 0, q_mass, 1.0)
    uniforms = uniforms.to(dev, torch.float64, non_blocking=True)  # [B, 2, T]
    rows = torch.arange(B, device=dev)

    def probs_at(j: int) -> Tensor:  # [B, V] node j's target distribution, every row's own settings
        return target_probs(
            logits[:, j] if logits_at is None else logits_at(j),
            temperature,
            1.0 if top_p is None else top_p,
            0 if top_k is None else top_k,
            0.0 if min_p is None else min_p,
        )

    p = probs_at(0)  # [B, V] the current distribution, residual-adjusted after rejections
    cur = torch.zeros(B, dtype=torch.long, device=dev)  # [B] the current node
    on_path = torch.zeros(B, T, dtype=torch.bool, device=dev)
    on_path[:, 0] = True
    bad = torch.zeros(B, dtype=torch.bool, device=dev)
    for j in range(1, T):
        tested = real[:, j] & (parents[:, j] == cur)  # [B]
        x = tokens[:, j]  # [B]
        # q as a dense [B, V]: duplicate ids summed (in index order on the CPU, like the reference's dict).
        q = torch.zeros(B, V, dtype=torch.float64, device=dev).scatter_add_(1, q_ids[:, j], q_probs[:, j])
        qx = q[rows, x]  # [B]
        px = p[rows, x]  # [B]
        bad = bad | (tested & (qx <= 0))
        accepted = tested & (qx > 0) & (uniforms[:, 0, j] < px / torch.where(qx > 0, qx, 1.0))  # min(1, p/q)
        rejected = tested & ~accepted
        residual = (p - q).clamp(min=0)  # max(0, p - q)
        mass = residual.sum(-1, keepdim=True)  # [B, 1]
        # Below _RESIDUAL_EPS the rejection was a rounding artefact (p == q): keep p, as the reference does.
        p = torch.where((rejected[:, None] & (mass > _RESIDUAL_EPS)), residual / mass, p)
        p = torch.where(accepted[:, None], probs_at(j), p)
        cur = torch.where(accepted, j, cur)
        on_path[:, j] = accepted
    # The bonus by inverse CDF at the stop node's uniform, the same rule as speculative._draw.
    cdf = p.cumsum(-1)  # [B, V]
    u = uniforms[:, 1].gather(1, cur[:, None])  # [B, 1]
    bonus = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)[:, 0]  # [B] first index whose cdf exceeds u*total
    # u * total can round up to the total (index V): the last token with mass is then the answer.
    last = torch.where(p > 0, torch.arange(V, device=dev), 0).amax(-1)  # [B]
    bonus = torch.where(bonus < V, bonus, last)
    return on_path, cur, bonus, bad


def verify_rows(
    trees: Sequence[DraftTree],
    logits: Tensor,  # [B, T, V] with T >= every tree's size; row b is meaningful for nodes < len(trees[b])
    temperatures: Sequence[float],
    top_ps: Sequence[float],
    generators: Sequence[torch.Generator | None],
    top_ks: Sequence[int] | None = None,
    *,
    min_ps: Sequence[float] | None = None,
    processing: Sequence[LogitsProcessing | None] | None = None,
) -> list[Verdict | ValueError]:
    """`verify` for every row at once: the same verdict, from the same logits rows and the same generators
    (top_ks / min_ps None: top-k / min-p off for every row; processing[b]: row b's logit_bias and penalties at
    its root, as `verify` takes them, None for none).

    Each sampled row draws `draw_uniforms(len(tree), generator)` on the CPU, in row order (rows may share one
    generator; it then advances exactly as B calls of `verify` in row order would). A row `verify` would raise
    for (a token outside its q's support, a bad temperature, top_p or top_k) gets its ValueError in its slot; the
    other rows are unaffected. One host sync: the packed result's single copy to the host.
    """
    B = len(trees)
    if logits.dim() != 3 or logits.shape[0] != B or (B and logits.shape[1] < max(len(t) for t in trees)):
        raise ValueError(f"logits must be [{B}, T >= the largest tree, V], got {tuple(logits.shape)}")
    if B == 0:
        return []
    T = logits.shape[1]
    rows = _pad_rows(trees, T, temperatures, top_ps, generators, top_ks, min_ps, processing, logits.shape[2])
    dev = logits.device
    moved = {k: None if v is None else v.to(dev, non_blocking=True) for k, v in rows.tensors().items()}
    result = accept(logits, **moved, sampled=rows.sampled)
    return unpack_verdicts(trees, pack(result).cpu(), rows.errors)


def pack(result: Acceptance) -> Tensor:
    """The verdicts as one [B, T + 3] long tensor (on_path, leaf, bonus, bad), so they reach the host in one copy."""
    return torch.cat(
        [result.on_path.long(), result.leaf[:, None], result.bonus[:, None], result.bad.long()[:, None]], 1
    )


def greedy_packed(logits: Tensor, tokens: Tensor, parents: Tensor, sizes: Tensor) -> Tensor:
    """Every row's greedy verdict, packed as `pack` does: the part of `accept` a fixed-shape step can run inside its
    CUDA graph (it draws nothing and needs no host-side fact). Shapes as `accept`'s; all on logits' device."""
    B, T, _ = logits.shape
    node = torch.arange(T, device=logits.device)  # [T]
    real = node < sizes[:, None]  # [B, T]
    on_path, leaf, bonus = _greedy(logits, tokens, parents.clamp(0, T - 1), real, node)
    return pack(Acceptance(on_path, leaf, bonus, torch.zeros(B, dtype=torch.bool, device=logits.device)))


def unpack_verdicts(
    trees: Sequence[DraftTree], packed: Tensor, errors: Sequence[ValueError | None] = ()
) -> list[Verdict | ValueError]:
    """Verdicts from `pack`'s rows on the host (rows past len(trees) are ignored; errors[b], if any, wins)."""
    T = packed.shape[1] - 3
    out: list[Verdict | ValueError] = []
    for b, row in enumerate(packed[: len(trees)].tolist()):
        if b < len(errors) and errors[b] is not None:
            out.append(errors[b])
        elif row[T + 2]:
            out.append(ValueError(f"row {b}: a tested draft node's token is outside the support of its proposal q"))
        else:
            path = [i for i in range(len(trees[b])) if row[i]]
            assert path[-1] == row[T], "the accepted nodes do not end at the leaf"
            out.append(Verdict(path, row[T + 1]))
    return out


@dataclass
class _Rows:
    """`accept`'s inputs for a list of trees, as CPU tensors, plus what only the host knows."""

    tokens: Tensor  # [B, T] long
    parents: Tensor  # [B, T] long
    sizes: Tensor  # [B] long
    temperature: Tensor  # [B] float64; 0 for greedy rows and for rows already failed
    top_p: Tensor | None  # [B] float64; None when no sampled row truncates
    top_k: Tensor | None  # [B] long, 0 = off; None when no sampled row keeps only its top k
    min_p: Tensor | None  # [B] float64, 0 = off; None when no sampled row uses min-p
    processing: ProcessingRows | None  # None when no row has a logit_bias or penalties
    q_ids: Tensor | None  # [B, T, K] long; None when no row is sampled
    q_probs: Tensor | None  # [B, T, K] float64
    uniforms: Tensor | None  # [B, 2, T] float64
    sampled: bool  # some row is sampled
    errors: list[ValueError | None]  # per row, what `verify` raises before it draws anything

    def tensors(self) -> dict[str, Tensor | ProcessingRows | None]:
        names = (
            "tokens",
            "parents",
            "sizes",
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "processing",
            "q_ids",
            "q_probs",
            "uniforms",
        )
        return {k: getattr(self, k) for k in names}


def _pad_rows(
    trees: Sequence[DraftTree],
    T: int,
    temperatures: Sequence[float],
    top_ps: Sequence[float],
    generators: Sequence[torch.Generator | None],
    top_ks: Sequence[int] | None = None,
    min_ps: Sequence[float] | None = None,
    processing: Sequence[LogitsProcessing | None] | None = None,
    vocab_size: int = 0,
) -> _Rows:
    """Pad trees to T nodes and draw each sampled row's uniforms, in row order, on the CPU."""
    B = len(trees)
    top_ks = [0] * B if top_ks is None else top_ks
    min_ps = [0.0] * B if min_ps is None else min_ps
    processing = [None] * B if processing is None else processing
    if not (len(temperatures) == len(top_ps) == len(generators) == len(top_ks) == len(min_ps) == len(processing) == B):
        raise ValueError(f"need one temperature, top_p, top_k, min_p, processing and generator per tree ({B})")
    errors: list[ValueError | None] = [None] * B
    temps = [0.0] * B
    for b, (t, tp, tk, mp) in enumerate(zip(temperatures, top_ps, top_ks, min_ps, strict=True)):
        if t == 0:
            continue
        try:
            check_rule(t, tp, tk, mp)
        except ValueError as e:
            errors[b] = e
        else:
            temps[b] = float(t)
    sampled = [b for b in range(B) if temps[b] > 0]
    rows_processing = None
    if any(r is not None for r in processing):
        rows_processing = ProcessingRows.stack([None if errors[b] else r for b, r in enumerate(processing)], vocab_size)

    sizes = torch.tensor([len(tree) for tree in trees], dtype=torch.long)  # [B]
    tokens = torch.zeros(B, T, dtype=torch.long)  # [B, T]
    parents = torch.zeros(B, T, dtype=torch.long)  # [B, T]; padding parents point at the root
    for b, tree in enumerate(trees):
        tokens[b, : len(tree)] = tree.tokens
        parents[b, : len(tree)] = tree.parents
    q_ids = q_probs = uniforms = top_p = top_k = min_p = None
    if sampled:
        K = max((trees[b].q_ids.shape[1] for b in sampled if trees[b].q_ids is not None), default=1)
        # Point masses by default (rows without q, padding nodes); zero-probability padding adds nothing.
        q_ids = torch.zeros(B, T, K, dtype=torch.long)
        q_ids[:, :, 0] = tokens
        q_probs = torch.zeros(B, T, K, dtype=torch.float64)
        q_probs[:, :, 0] = 1.0
        uniforms = torch.zeros(B, 2, T, dtype=torch.float64)
        for b in sampled:
            tree, n = trees[b], len(trees[b])
            if tree.q_ids is not None:
                k = tree.q_ids.shape[1]
                q_ids[b, :n, :k] = tree.q_ids
                q_probs[b, :n, :k] = tree.q_probs.double()
            uniforms[b, :, :n] = draw_uniforms(n, generators[b])
        if any(top_ps[b] < 1 for b in sampled):
            top_p = torch.tensor([float(top_ps[b]) if temps[b] > 0 else 1.0 for b in range(B)], dtype=torch.float64)
        if any(top_ks[b] > 0 for b in sampled):
            top_k = torch.tensor([int(top_ks[b]) if temps[b] > 0 else 0 for b in range(B)], dtype=torch.long)
        if any(min_ps[b] > 0 for b in sampled):
            min_p = torch.tensor([float(min_ps[b]) if temps[b] > 0 else 0.0 for b in range(B)], dtype=torch.float64)
    temperature = torch.tensor(temps, dtype=torch.float64)
    return _Rows(
        tokens,
        parents,
        sizes,
        temperature,
        top_p,
        top_k,
        min_p,
        rows_processing,
        q_ids,
        q_probs,
        uniforms,
        bool(sampled),
        errors,
    )
