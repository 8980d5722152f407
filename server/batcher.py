"""Batched verification: rounds from many sessions that arrive within a short window run as one target forward.

Contract:
- `verify_batch(target, items)` takes [(SequenceVerifier, DraftTree)] of sequences with different cache
  lengths and tree sizes, runs them through the target in ONE forward (ragged: queries padded to the largest
  tree, each row's cache gathered into a padded prefix, one [B, Tq, Tk] visibility mask), then decides each
  row's verdict with that sequence's own sampling settings and commits its accepted path. The results equal
  running each SequenceVerifier.verify on its own; a row whose verdict fails comes back as its exception.
- `RoundBatcher(target, window_s, max_batch)` is the scheduler: `submit(verifier, tree)` returns a Future;
  a worker thread takes the first waiting round, gathers whatever else arrives within `window_s` (up to
  `max_batch`), and runs them as one batch.

Views: on the "triton" backend with the sessions in the paged pool, `PagedKernelView` lets the paged MoDA verify
kernel read every row's cache in place through block tables (the GPU server's path); otherwise `PagedBatchView`
gathers each row's prefix from the pool through a slot table (and tensor-parallel ranks replay those slots), and
`BatchCacheView` copies from per-sequence caches.
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future

import torch
from torch import Tensor

from tether.server.kv_pool import PagedCache, PagedKernelView, PoolExhausted, SlotView
from tether.server.verifier import SequenceVerifier, target_states
from tether.shared.drafter import DraftDelta
from tether.shared.model import Transformer
from tether.shared.speculative import DraftTree, Verdict, verify


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
    into their slots and one gather of every row's prefix through a padded slot table (what a paged kernel
    reads in place)."""

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


def paged_kernel_view(caches: list[PagedCache], new_lens: list[int]) -> PagedKernelView:
    """The in-place kernel view of one ragged batch of pool sequences: reserves each row's new slots, then
    hands the kernel the rows' block tables (with `lens` / `lmax`, the committed lengths, for the caller)."""
    lens = [c.length for c in caches]
    pool = caches[0].pool
    write_slots, write_rows = _new_rows(caches, new_lens)
    table, committed = pool.block_tables(caches)  # [B, max_blocks] int32, [B] int32
    q_lens = torch.tensor(new_lens, dtype=torch.int32, device=pool.device)
    # The kernel counts the round's rows as cached: attend writes them into their slots first.
    view = PagedKernelView(pool, write_slots, write_rows, table, committed + q_lens, q_lens)
    view.lens, view.lmax = lens, max(lens)
    return view


def attends_in_place(target: Transformer, caches: list) -> bool:
    """Whether a batch of these caches runs through the paged verify kernel: a target on the "triton" backend
    (single process, or tensor-parallel: every rank then attends over its shard of the pool) with every sequence
    in one pool."""
    return (
        getattr(target, "backend", None) == "triton"
        and all(isinstance(c, PagedCache) for c in caches)
        and len({id(c.pool) for c in caches}) == 1
    )


def cache_view(caches: list, new_lens: list[int], *, in_place: bool = False) -> BatchCacheView | PagedKernelView:
    """The batch view for these caches: the in-place kernel view when asked, else the gathering paged one when
    they all live in one pool, else the per-row one."""
    if in_place:
        return paged_kernel_view(caches, new_lens)
    if all(isinstance(c, PagedCache) for c in caches) and len({id(c.pool) for c in caches}) == 1:
        return PagedBatchView(caches, new_lens)
    return BatchCacheView(caches, new_lens)


@torch.inference_mode()
def verify_batch(
    target: Transformer, items: list[tuple[SequenceVerifier, DraftTree]]
) -> list[tuple[Verdict, DraftDelta | None] | Exception]:
    # A row that cannot get room (its cache is full, or the pool is) fails alone; the rest still run.
    results: list = [None] * len(items)
    for i, (ver, tree) in enumerate(items):
        try:
            ver.reserve(len(tree))
        except (ValueError, PoolExhausted) as e:
            results[i] = e
    live = [i for i, r in enumerate(results) if r is None]
    if live:
        for i, r in zip(live, _verify_rows(target, [items[i] for i in live]), strict=True):
            results[i] = r
    return results


def _verify_rows(target: Transformer, items: list[tuple[SequenceVerifier, DraftTree]]) -> list:
    dev = target.device
    B = len(items)
    sizes = [len(tree) for _, tree in items]
    tq = max(sizes)
    caches = [ver.cache for ver, _ in items]
    in_place = attends_in_place(target, caches)
    view = cache_view(caches, sizes, in_place=in_place)
    tokens = torch.zeros(B, tq, dtype=torch.long)
    positions = torch.zeros(B, tq, dtype=torch.long)
    # In place: the new tokens' own visibility [B, Tq, Tq]; gathered: the whole [B, Tq, Lmax + Tq].
    base = 0 if in_place else view.lmax
    mask = torch.zeros(B, tq, base + tq, dtype=torch.bool)
    for i, ((_, tree), L, n) in enumerate(zip(items, view.lens, sizes, strict=True)):
        tokens[i, :n] = tree.tokens
        positions[i, :n] = tree.positions(L)
        positions[i, n:] = L  # padding rows: any valid position; nobody sees them
        if not in_place:
            mask[i, :, :L] = True
        mask[i, :n, base : base + n] = tree.ancestor_mask()
        mask[i, torch.arange(n, tq), base + torch.arange(n, tq)] = True  # padding sees itself only
    want = any(ver.drafter is not None for ver, _ in items)
    out = target.run(tokens.to(dev), cache=view, positions=positions.to(dev), tree_mask=mask.to(dev),
                     hidden_layers=(target.cfg.n_layers,), return_kv=want)  # fmt: skip
    # Decide every verdict before committing any, so a row that fails (a malformed q) fails alone.
    verdicts: list[Verdict | Exception] = []
    for i, ((ver, tree), n) in enumerate(zip(items, sizes, strict=True)):
        try:
            verdicts.append(verify(tree, out.logits[i, :n], temperature=ver.temperature, top_p=ver.top_p,
                                   generator=ver.generator))  # fmt: skip
        except ValueError as e:
            verdicts.append(e)
    results: list[tuple[Verdict, DraftDelta | None] | Exception] = []
    for i, ((ver, tree), L, verdict) in enumerate(zip(items, view.lens, verdicts, strict=True)):
        if isinstance(verdict, Exception):
            results.append(verdict)
            continue
        ver.cache.accept(verdict.path)
        delta = None
        if ver.drafter is not None:
            row = type(out)(logits=out.logits[i : i + 1], k=out.k[:, i : i + 1], v=out.v[:, i : i + 1],
                            hidden=(out.hidden[0][i : i + 1],))  # fmt: skip
            states = target_states(row).select(verdict.path)
            delta = ver.drafter.server_delta(states, L, tree.tokens[verdict.path].tolist())
        results.append((verdict, delta))
    return results


@torch.inference_mode()
def warm_up(target: Transformer, pool, sizes: tuple[int, ...] = (1, 4, 8, 16, 32), absorb_max: int = 64) -> None:
    """Run every kernel variant a server will need once, so Triton compiles (and autotunes) them before the first
    client instead of inside its open or round deadline (a compile there costs seconds: an outage on a healthy
    link). Covered, for short and split-K contexts: prefills with and without a cached prefix; batched verify
    rounds of every tile class in `sizes` (chains and a branching tree), each sequence alone and all together
    (one split or several); the same trees verified one sequence at a time (the batcher's fallback); and a
    resync's absorb, a causal chain of up to `absorb_max` offline tokens. tests/kernels/test_kernel_variants.py
    checks that a session launches nothing else."""
    vocab, room = target.cfg.vocab_size, target.cfg.max_seq_len
    grow = 2 * max(*sizes, absorb_max) + 2
    lens = [n for n in (24, 600) if n + grow <= room]  # 600: past moda_backend's VERIFY_MIN_PREFIX
    vers = [SequenceVerifier(target, None, capacity=n + grow, pool=pool) for n in lens]
    try:
        for v, n in zip(vers, lens, strict=True):
            v.open([(7 * i + 1) % vocab for i in range(n)])
        for n in sizes if vers else ():
            tree = DraftTree(
                tokens=torch.arange(n) % vocab, parents=torch.arange(n) // 2 - (torch.arange(n) == 0).long()
            )
            chain = DraftTree.chain(1 % vocab, [i % vocab for i in range(n - 1)])
            for t in (chain, tree):
                for batch in [[(v, t)] for v in vers] + [[(v, t) for v in vers]]:
                    verify_batch(target, batch)
                    for v, n0 in zip(vers, lens, strict=True):
                        v.cache.truncate(n0)
                for v, n0 in zip(vers, lens, strict=True):
                    v.verify(t)
                    v.cache.truncate(n0)
        for n in sorted({*sizes, absorb_max}) if vers else ():
            ids = torch.tensor([[i % vocab for i in range(n)]], device=target.device)
            for v, n0 in zip(vers, lens, strict=True):
                v.reserve(n)
                target.verify(ids, v.cache, hidden_layers=(target.cfg.n_layers,), return_kv=True)
                v.cache.truncate(n0)
    finally:
        for v in vers:
            v.release()


class RoundBatcher:
    def __init__(self, target: Transformer, *, window_s: float = 0.002, max_batch: int = 32, on_batch=None):
        self.target, self.window_s, self.max_batch = target, window_s, max_batch
        self.on_batch = on_batch  # called with each batch's size (metrics)
        self.inbox: queue.Queue = queue.Queue()
        self.worker = threading.Thread(target=self._run, name="tether-batcher", daemon=True)
        self.worker.start()

    def submit(self, verifier: SequenceVerifier, tree: DraftTree) -> Future:
        fut: Future = Future()
        self.inbox.put((verifier, tree, fut))
        return fut

    def close(self) -> None:
        self.inbox.put(None)

    def _run(self) -> None:
        while (first := self.inbox.get()) is not None:
            batch = [first]
            deadline = time.monotonic() + self.window_s
            while len(batch) < self.max_batch:
                try:
                    item = self.inbox.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                if item is None:
                    self.inbox.put(None)  # stop after this batch
                    break
                batch.append(item)
            if self.on_batch:
                self.on_batch(len(batch))
            try:
                results = verify_batch(self.target, [(v, t) for v, t, _ in batch])
            except Exception:
                # Nothing was committed: verify each on its own so one bad round fails alone.
                for v, t, fut in batch:
                    try:
                        fut.set_result(v.verify(t))
                    except Exception as e:
                        fut.set_exception(e)
                continue
            for (_, _, fut), result in zip(batch, results, strict=True):
                if isinstance(result, Exception):
                    fut.set_exception(result)
                else:
                    fut.set_result(result)
