"""Verifying many sequences' rounds in one target forward: the only verify path of the server.

Contract:
- `verify_batch(target, items)` takes [(RoundSequence, DraftTree)] (SequenceVerifiers) of sequences with different
  cache lengths and tree sizes, runs them through the target in ONE forward, decides each row's verdict with that
  sequence's own sampling settings (tether.shared.speculative.verify), commits the accepted paths and returns, per
  row, (verdict, delta) or the row's exception: a row that cannot get room or whose draft is malformed fails alone.
  The verdicts of all rows are decided on the device in one pass (tether.shared.acceptance.verify_rows: greedy and
  lossless rejection sampling, exactly tether.shared.speculative.verify's verdict) and read back with one copy.
  `SequenceVerifier.verify` is `verify_batch` of one row; the gRPC batcher (tether.server.batcher) calls it with
  whatever rounds arrived together.
- `forward_rows(target, caches, trees, states)` is that forward on its own, a context manager yielding the
  ForwardOutput whose row i, token j is trees[i]'s node j (a resync's absorb uses it too).
- Deltas: the accepted rows of every sequence are gathered on the device and the drafter's server part runs once
  for the whole batch (its output is position-wise, as DraftDelta.split already assumes); with `host_deltas`
  the tensors are copied to the host once, into pinned memory, so encoding them never waits on the GPU, and the
  deltas come back as numpy bfloat16 bits, what the wire sends: a greedy step's sliced per row (slice_deltas),
  any other step's as rows of one StepDeltas (tether.server.step_deltas), converted once for the step.

How the forward runs, fastest first:
- the target on the "triton" backend with every sequence in one paged pool and the batch within a step bucket:
  the pool's StepRunner (KVPool.runner_for: made once, by the pool's owner), a fixed-shape step replayed from a
  CUDA graph on the GPU;
- the same StepBatch and step function at the batch's own size, eagerly, when no bucket holds it
  (StepRunner.eager: the paged verify kernel reads each row's cache in place through its block table);
- otherwise `PagedBatchView` gathers each row's prefix from the pool through a slot table (tensor-parallel ranks
  replay those slots), or `BatchCacheView` copies from per-sequence caches.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator, Sequence
from typing import Protocol

import numpy as np
import torch
from torch import Tensor

from tether.server.compute_meter import MODEL_COMPUTE
from tether.server.device_wait import copies, host_copy, sleep_until_done
from tether.server.kv_pool import PagedCache, PoolExhausted, SlotView
from tether.server.step import StepBatch, StepRunner
from tether.server.step_deltas import StepDeltas
from tether.shared.acceptance import unpack_verdicts, verify_rows
from tether.shared.codecs import bf16_bits
from tether.shared.contracts import ForwardOutput, SequenceCache, ServerDrafter, Target, gathering_attend
from tether.shared.drafter import POSITION_AXIS, DraftDelta, TargetStates
from tether.shared.drafter_config import ArrayDelta
from tether.shared.logits_processing import LogitsProcessing, SamplingControls
from tether.shared.speculative import DraftTree, Verdict
from tether.shared.wire import f32_to_bf16


class RoundSequence(Protocol):
    """What verify_batch needs of a row's sequence: tether.server.verifier.SequenceVerifier, which verifies through
    this module (so this one names it by what it uses)."""

    cache: SequenceCache  # the sequence's KV, its committed rows first
    drafter: ServerDrafter | None  # whose server part makes the row's delta (None: no delta)
    controls: SamplingControls  # the sequence's sampling rule
    generator: torch.Generator | None  # its own stream of uniforms for rejection sampling
    logprobs: int | None  # report this many most probable tokens per emitted token (None: nothing)

    def reserve(self, n: int) -> None: ...  # room for n more rows, or ValueError / PoolExhausted

    def processing_at(self, root: int) -> LogitsProcessing | None: ...  # the controls' state after its text + root

    def report(self, logits: Tensor, tree: DraftTree, verdict: Verdict) -> None: ...  # log-probabilities, pre-commit

    def record(self, start: int, tokens: list[int]) -> None: ...  # the tokens committed at `start`


class BatchCacheView:
    """Looks like a KVCache to the model for one ragged batch: `write` stores each row's new K/V as pending
    rows of its own cache and returns [padded prefix ; new rows] for all rows: [B, Lmax + Tq, Hkv, D].
    Works with any cache that has KVCache's `write` (contiguous or paged)."""

    def __init__(self, caches: list, new_lens: list[int]):
        self.caches, self.new_lens = caches, new_lens
        self.lens = [c.length for c in caches]
        self.lmax = max(self.lens)
        self.length = 0  # positions are always given explicitly for a batch

    def write(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        B, _, H, D = k.shape
        pk = k.new_zeros(B, self.lmax, H, D)
        pv = v.new_zeros(B, self.lmax, H, D)
        for i, (c, L, n) in enumerate(zip(self.caches, self.lens, self.new_lens, strict=True)):
            kk, vv = c.write(layer, k[i : i + 1, :n], v[i : i + 1, :n])  # [1, L + n, H, D]
            pk[i, :L] = kk[0, :L]
            pv[i, :L] = vv[0, :L]
        return torch.cat([pk, k], 1), torch.cat([pv, v], 1)

    attend = gathering_attend  # a gathering view (PagedBatchView too): the model writes the rows and attends


def _new_rows(caches: list[PagedCache], new_lens: list[int]) -> tuple[Tensor, Tensor]:
    """Reserve each row's new positions and map them: (flat pool slots [N], their indices in the flattened
    [B * Tq] new rows [N])."""
    dev = caches[0].pool.device
    lens = [c.length for c in caches]
    for c, n in zip(caches, new_lens, strict=True):
        c.reserve(n)
    slots = torch.cat([c.slots(L, L + n) for c, L, n in zip(caches, lens, new_lens, strict=True)])
    rows = torch.cat([torch.arange(n, device=dev) + i * max(new_lens) for i, n in enumerate(new_lens)])
    return slots, rows


class PagedBatchView(BatchCacheView):
    """The same for sequences of one KVPool, without a per-row loop: each layer is one scatter of the new rows
    into their slots and one gather of every row's prefix through a padded slot table."""

    def __init__(self, caches: list[PagedCache], new_lens: list[int]):
        super().__init__(caches, new_lens)
        self.pool = caches[0].pool
        dev = self.pool.device
        write_slots, write_rows = _new_rows(caches, new_lens)
        read_slots = torch.zeros(len(caches), self.lmax, dtype=torch.long, device=dev)  # padding reads slot 0
        for i, (c, L) in enumerate(zip(caches, self.lens, strict=True)):
            read_slots[i, :L] = c.slots(0, L)
        self.slot_view = SlotView(self.pool, write_slots, write_rows, read_slots)

    def write(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        return self.slot_view.write(layer, k, v)


def attends_in_place(target: Target, caches: list) -> bool:
    """Whether a batch of these caches runs through the paged verify kernel: a target on the "triton" backend
    (single process, or tensor-parallel: every rank then attends over its shard of the pool) with every sequence
    in one pool."""
    return (
        target.backend == "triton"
        and all(isinstance(c, PagedCache) for c in caches)
        and len({id(c.pool) for c in caches}) == 1
    )


def cache_view(caches: list, new_lens: list[int]) -> BatchCacheView:
    """The gathering batch view for these caches: the paged one when they all live in one pool, else the per-row
    one. (Caches the paged kernel reads in place run as a step instead: forward_rows.)"""
    if all(isinstance(c, PagedCache) for c in caches) and len({id(c.pool) for c in caches}) == 1:
        return PagedBatchView(caches, new_lens)
    return BatchCacheView(caches, new_lens)


def decode_runner(target: Target, cache) -> StepRunner | None:
    """The step runner that can decode this cache's sequence in chained one-token steps, if any (its pool's: a
    tensor-parallel target's steps are broadcast ones, which do not chain)."""
    if target.tp[1] == 1 and attends_in_place(target, [cache]):
        return cache.pool.runner_for(target)
    return None


_CHAIN_ROWS: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}


def _chain_rows(T: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """What every chain of T nodes shares: node indices [T], parents [T] and causal mask [T, T] (a chain's node i
    sees nodes 0..i), one read-only set per T."""
    rows = _CHAIN_ROWS.get(T)
    if rows is None:
        rows = (np.arange(T, dtype=np.int64), np.arange(-1, T - 1, dtype=np.int64), np.tri(T, dtype=np.bool_))
        for a in rows:
            a.flags.writeable = False
        rows = _CHAIN_ROWS.setdefault(T, rows)
    return rows


def _flat(lists: list[list[int]], total: int) -> np.ndarray:
    """The lists one after another as one int64 array (one pass in C, no intermediate list)."""
    return np.fromiter(itertools.chain.from_iterable(lists), np.int64, total)


def step_batch(caches: Sequence[PagedCache], trees: Sequence[DraftTree]) -> StepBatch:
    """The host metadata of one step: each tree's nodes after its cache's committed rows (reserving their blocks).
    Plain numpy: this runs once per round on the host's critical path (and holds the GIL), so every row is built as
    a chain by whole-batch operations, Python touching each row only to reserve it and collect its lists, and only
    trees that are not chains are then rewritten row by row."""
    tokens_of = [t._tokens for t in trees]
    sizes = list(map(len, tokens_of))
    B, T = len(trees), max(sizes)
    bs = caches[0].pool.block_size
    for c, n in zip(caches, sizes, strict=True):
        c.reserve(n)  # before reading the blocks: it may add some
    starts, tables = [c.length for c in caches], [c.blocks for c in caches]
    widths = list(map(len, tables))
    W = max(widths)
    col, prev, causal = _chain_rows(T)
    q_lens = np.array(sizes, np.int64)  # [B]
    start = np.array(starts, np.int64)  # [B]
    at = start[:, None] + col  # [B, T]: each node's row in its sequence (a chain node's position too)
    # Boolean-mask assignment fills in row-major order, the order the flat lists were joined in.
    table = _flat(tables, sum(widths))
    if min(widths) == W:
        table = table.reshape(B, W)
    else:
        blocks, table = table, np.full((B, W), -1, np.int64)  # [B, W]
        table[np.arange(W) < np.array(widths)[:, None]] = blocks
    idx = at // bs  # [B, T]: each node's block, as an index into the flattened table
    idx += np.arange(0, B * W, W)[:, None]
    if min(sizes) == T:  # no padding anywhere
        tokens = _flat(tokens_of, B * T).reshape(B, T)
        positions = at
        parents = np.repeat(prev[None], B, 0)  # [B, T]
        mask = np.repeat(causal[None], B, 0)  # [B, T, T]
        slots = table.take(idx)
        slots *= bs
        slots += at % bs
    else:
        real = col < q_lens[:, None]  # [B, T]: a row's own nodes, not padding
        tokens = np.zeros((B, T), np.int64)
        tokens[real] = _flat(tokens_of, sum(sizes))
        positions = at * real
        parents = prev * real
        mask = real[:, :, None] & causal  # row i's [:n, :n] corner is the triangle, the rest False
        idx *= real  # padding reads block 0 of its row, then is overwritten: its block may be past the table
        slots = table.take(idx)
        slots *= bs
        slots += at % bs
        slots[~real] = -1  # padding, sent to the scratch block
    for i, t in enumerate(trees):
        if not t.is_chain:
            n = sizes[i]
            positions[i, :n] = starts[i] + t.depths.numpy()
            parents[i, :n] = t._parents
            mask[i, :n, :n] = t.ancestor_mask().numpy()
    return StepBatch(tokens, positions, parents, mask, slots, table, start + q_lens, q_lens)


@contextlib.contextmanager
def forward_rows(
    target: Target, caches: list, trees: Sequence[DraftTree], *, states: bool
) -> Iterator[tuple[ForwardOutput, Tensor | None]]:
    """One forward of each tree after its cache's committed rows (their K/V written as pending rows). Yields the
    ForwardOutput (row i, token j: trees[i]'s node j; rows padded) and, from a fixed-shape step, every row's greedy
    verdict packed as tether.shared.acceptance.pack does (else None). Valid inside the `with` only."""
    if attends_in_place(target, caches):
        # One input path: the step's StepBatch, replayed in its bucket or, larger than every bucket, run eagerly.
        runner = caches[0].pool.runner_for(target)
        batch = step_batch(caches, trees)
        with runner.lock:
            with MODEL_COMPUTE.measure():
                step = runner.forward(batch, states=states)
            yield step
        return
    # The gathering views (another backend, or caches outside one pool): keys [B, Lmax + Tq], their own mask.
    sizes = [len(t) for t in trees]
    dev, B, tq = target.device, len(trees), max(sizes)
    view = cache_view(caches, sizes)
    tokens = torch.zeros(B, tq, dtype=torch.long)
    positions = torch.zeros(B, tq, dtype=torch.long)
    base = view.lmax
    mask = torch.zeros(B, tq, base + tq, dtype=torch.bool)
    for i, (tree, L, n) in enumerate(zip(trees, view.lens, sizes, strict=True)):
        tokens[i, :n] = tree.tokens
        positions[i, :n] = tree.positions(L)
        positions[i, n:] = L  # padding rows: any valid position; nobody sees them
        mask[i, :, :L] = True
        mask[i, :n, base : base + n] = tree.ancestor_mask()
        mask[i, torch.arange(n, tq), base + torch.arange(n, tq)] = True  # padding sees itself only
    with MODEL_COMPUTE.measure():
        out = target.run(
            tokens.to(dev),
            cache=view,
            positions=positions.to(dev),
            tree_mask=mask.to(dev),
            hidden_layers=(target.cfg.n_layers,) if states else (),
            return_kv=states,
        )
    yield out, None


def gather_deltas(
    out: ForwardOutput, drafter, rows: Sequence[tuple[int, int, list[int], list[int]]], *, host: bool = False
) -> list[DraftDelta] | list[ArrayDelta]:
    """Each row's delta from one forward: rows are (batch row, start position, node offsets, their tokens). The
    rows' states are gathered on the device and the drafter's server part runs once over all of them; `host`
    copies the result to pinned host memory in one go and returns the rows as views of one StepDeltas (bfloat16
    bits, the wire's form, converted once for the step: encoding then never waits on the GPU)."""
    T = out.logits.shape[1]
    idx = torch.tensor([b * T + j for b, _, path, _ in rows for j in path], device=out.logits.device)
    flat = TargetStates(
        k=out.k.flatten(1, 2)[:, idx], v=out.v.flatten(1, 2)[:, idx], hidden=out.hidden[0].flatten(0, 1)[idx]
    )
    with MODEL_COMPUTE.measure():
        tensors = drafter.server_delta(flat, 0, [t for *_, tokens in rows for t in tokens]).tensors
    if host:
        bits = {k: bf16_bits(t) for k, t in _to_host(tensors, sync=True).items()}
        spans, at = [], 0
        for _, start, path, tokens in rows:
            spans.append((start, list(tokens), range(at, at + len(path))))
            at += len(path)
        return StepDeltas(bits, spans).deltas
    deltas, at = [], 0
    for _, start, path, tokens in rows:
        n = len(path)
        deltas.append(
            DraftDelta(start, list(tokens), {k: t.narrow(POSITION_AXIS[k], at, n) for k, t in tensors.items()})
        )
        at += n
    return deltas


def _to_host(tensors: dict[str, Tensor], *, sync: bool) -> dict[str, Tensor]:
    """Copies in pinned host memory (CUDA), enqueued on the current stream; `sync` waits for them (asleep)."""
    staged = copies(tensors)
    if sync:
        sleep_until_done()
    return staged


def every_token_delta(out: ForwardOutput, drafter, rows: int, runner: StepRunner) -> dict[str, Tensor]:
    """The drafter's server part over every token of the forward's first `rows` rows, copied to pinned host
    memory without waiting: [rows * T] along each tensor's position axis (POSITION_AXIS), row b's node j at
    b * T + j. Enqueued before the step's verdicts are read, it runs on the GPU behind the step and arrives with
    the verdicts' copy: one wait per round instead of two, and no gather that waits on the verdicts. The server
    parts are per position, so a row's slice (`slice_deltas`) equals what gather_deltas computes for it. `runner`
    made `out` (its step graph has a graph of the server part beside it: StepRunner.server_part)."""
    with MODEL_COMPUTE.measure():
        part = runner.server_part(drafter, out, rows)
    return _to_host(part, sync=False)


def slice_deltas(
    tensors: dict[str, Tensor], T: int, rows: Sequence[tuple[int, int, list[int], list[int]]]
) -> list[ArrayDelta]:
    """Each row's delta out of every_token_delta's tensors (after the stream has reached them), as numpy arrays of
    bfloat16 bits, the form the wire sends (ArrayDelta, as a client decodes it). One gather per tensor for the whole
    step takes every row's accepted positions, in row order (fp32 tensors, on the CPU, are converted after it: only
    those positions); a row's part is then a numpy view of its consecutive run. Per row that is one basic slice per
    tensor, where a copy or a fancy index per row, and before that torch calls, cost microseconds each on the
    batcher's thread."""
    sizes = [len(path) for _, _, path, _ in rows]
    idx = np.fromiter((b * T + j for b, _, path, _ in rows for j in path), np.int64, sum(sizes))  # [N]
    bits = {}
    for k, t in tensors.items():
        if t.dtype == torch.bfloat16:
            bits[k] = np.take(t.view(torch.int16).numpy().view(np.uint16), idx, axis=POSITION_AXIS[k])
        else:
            bits[k] = f32_to_bf16(np.take(t.float().numpy(), idx, axis=POSITION_AXIS[k]))
    lead = {k: (slice(None),) * POSITION_AXIS[k] for k in bits}
    deltas, at = [], 0
    for (_, start, _, tokens), n in zip(rows, sizes, strict=True):
        span = slice(at, at + n)
        deltas.append(ArrayDelta(start, list(tokens), {k: a[lead[k] + (span,)] for k, a in bits.items()}))
        at += n
    return deltas


@torch.inference_mode()
def verify_batch(
    target: Target, items: list[tuple[RoundSequence, DraftTree]], *, host_deltas: bool = False
) -> list[tuple[Verdict, DraftDelta | None] | Exception]:
    """See the module docstring; `host_deltas` puts the deltas' tensors in host memory."""
    results: list = [None] * len(items)
    for i, (ver, tree) in enumerate(items):
        try:
            ver.reserve(len(tree))
        except (ValueError, PoolExhausted) as e:
            results[i] = e
    live = [i for i, r in enumerate(results) if r is None]
    if live:
        for i, r in zip(live, _verify_rows(target, [items[i] for i in live], host_deltas), strict=True):
            results[i] = r
    return results


def _verify_rows(target: Target, items: list[tuple[RoundSequence, DraftTree]], host: bool) -> list:
    trees = [tree for _, tree in items]
    caches = [ver.cache for ver, _ in items]
    lens = [c.length for c in caches]
    drafters = {id(ver.drafter): ver.drafter for ver, _ in items if ver.drafter is not None}
    with forward_rows(target, caches, trees, states=bool(drafters)) as (out, greedy):
        # Every verdict on the device in one pass and one copy back, decided before any is committed, so a row
        # that fails (a malformed q) fails alone. A step already decided the greedy ones inside its graph.
        verdicts: list[Verdict | Exception]
        early = None
        controls = [ver.controls for ver, _ in items]
        if greedy is not None and all(c.temperature == 0 and not c.processes_logits for c in controls):
            if host and len(drafters) == 1:
                runner = caches[0].pool.runner_for(target)
                early = every_token_delta(out, next(iter(drafters.values())), len(items), runner)
            verdicts = unpack_verdicts(trees, host_copy(greedy))  # the one wait: the deltas' copies came before it
        else:
            verdicts = verify_rows(
                trees,
                out.logits[: len(items)],
                [c.temperature for c in controls],
                [c.top_p for c in controls],
                [ver.generator for ver, _ in items],
                [c.top_k for c in controls],
                min_ps=[c.min_p for c in controls],
                processing=[ver.processing_at(tree._tokens[0]) for ver, tree in items],
            )
        # One pass over the rows: each verdict's emitted tokens once (the delta's and the record's), its drafter.
        ok: list[int] = []
        emitted: dict[int, list[int]] = {}
        by_drafter: dict[int, list[int]] = {}
        for i, ((ver, tree), v) in enumerate(zip(items, verdicts, strict=True)):
            if isinstance(v, Exception):
                continue
            if ver.logprobs is not None:
                ver.report(out.logits[i], tree, v)  # before the commit: the verifier's counts are the round's
            ok.append(i)
            path = v.path
            # A chain's accepted prefix (most rows) is a slice of its tokens.
            emitted[i] = tree._tokens[: len(path)] if path[-1] == len(path) - 1 else [tree._tokens[j] for j in path]
            if ver.drafter is not None:
                by_drafter.setdefault(id(ver.drafter), []).append(i)
        deltas: dict[int, DraftDelta | ArrayDelta] = {}
        for rows in by_drafter.values():
            spans = [(i, lens[i], verdicts[i].path, emitted[i]) for i in rows]
            if early is not None:
                found = slice_deltas(early, out.logits.shape[1], spans)
            else:
                found = gather_deltas(out, items[rows[0]][0].drafter, spans, host=host)
            deltas.update(zip(rows, found, strict=True))
    _commit([caches[i] for i in ok], [verdicts[i].path for i in ok])
    for i in ok:  # what the sequence's later penalties count
        items[i][0].record(lens[i], emitted[i])
    return [v if isinstance(v, Exception) else (v, deltas.get(i)) for i, v in enumerate(verdicts)]


def _commit(caches: list, paths: list[list[int]]) -> None:
    """Accept each row's path: paged caches of one pool in one copy, any other cache on its own."""
    paged = [i for i, c in enumerate(caches) if isinstance(c, PagedCache)]
    if len({id(caches[i].pool) for i in paged}) != 1:
        paged = []
    if paged:
        caches[paged[0]].pool.accept([caches[i] for i in paged], [paths[i] for i in paged])
    for i in sorted(set(range(len(caches))) - set(paged)):
        caches[i].accept(paths[i])
