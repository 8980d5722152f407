"""The server's paged KV pool: fixed-size blocks of K/V shared by every session, a block table per session.

Contract:
- `KVPool(cfg, num_blocks, block_size)` (or `KVPool.for_budget(cfg, budget_bytes, ...)`) owns
  `k` and `v`, each [n_layers, num_blocks + 1, block_size, Hkv, D] (the last block, `scratch`, is never handed out:
  padding rows of fixed-shape steps use it): vLLM's per-layer layout, the one the paged
  verify kernel (issue [5/7]) reads. Position p of a sequence with block table `bt` lives in block
  bt[p // block_size] at offset p % block_size, i.e. flat slot bt[p // bs] * bs + p % bs of `k[layer].view(-1, Hkv,
  D)`. `block_tables(seqs)` gives the kernel's inputs: an int32 [B, max_blocks] table and int32 [B] lengths.
- `alloc(n)` hands out n free blocks; when too few are free it calls `reclaim(missing)` (the service evicts its
  least recently used idle sessions there) and raises `PoolExhausted` only when nothing more can be freed.
  `free(blocks)` returns them. Both are thread-safe; `reclaim` runs outside the pool's lock.
- `pool.sequence(capacity)` makes a `PagedCache`: the same interface as tether.shared.kv_cache.KVCache for one
  sequence (`length`, `capacity`, `write`, `advance`, `accept`, `truncate`), so the model and the verifier use
  it unchanged. `capacity` is a logical limit (positions); memory is taken block by block as the sequence
  grows, and blocks past its committed length are given back after `accept` and `truncate`. `release()` gives
  back everything; a released cache refuses further use instead of reading blocks someone else now owns.
- `SlotView(pool, write_slots, write_rows, read_slots)`: one forward's window on the pool as flat slot indices
  (vLLM's slot mapping), the cache interface the model calls; the batcher and tensor-parallel ranks use it.
- `PagedKernelView(pool, write_slots, write_rows, block_table, cache_lens, q_lens)`: the same window for the
  paged verify kernel, which reads the rows in place (the model calls its `attend`); `pool.kernel_view(...)` makes
  one over the pool (what a step runner calls: tether.server.step.StepPool names what it needs of a pool).
- `pool.runner_for(target)` is the StepRunner of that target's fixed-shape steps over this pool (tether.server.step),
  made once and owned by the pool: its owner (the Engine) makes it at construction, anyone else on the first step.
  The runner knows the pool only by the StepPool Protocol, so this module imports tether.server.step, never back.
  `step_config` (a constructor argument) is how those steps run, graphs or eager; a tensor-parallel pool
  (tether.server.tp_serve.TPPool) makes its own kind of runner.

    pool = KVPool.for_budget(model.cfg, 256 << 20, block_size=16, device="cuda", dtype=torch.bfloat16)
    cache = pool.sequence(capacity=2048)
    model.prefill(ids, cache)          # takes ceil(T / 16) blocks
    cache.release()
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from tether.server.step import StepConfig, StepRunner
from tether.shared.config import ModelConfig
from tether.shared.contracts import gathering_attend

if TYPE_CHECKING:
    from tether.shared.contracts import Target

_PREFIXES = [list(range(n)) for n in range(257)]  # the chain prefixes PagedCache.in_place compares a path with


class PoolExhausted(RuntimeError):
    """The pool has too few free blocks and nothing more can be reclaimed."""


class KVPool:
    def __init__(
        self,
        cfg: ModelConfig,
        num_blocks: int,
        block_size: int = 16,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        step_config: StepConfig | None = None,
    ):
        """`step_config`: how this pool's step runner runs its steps (None: StepConfig(), graphs on CUDA)."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"a KV pool needs at least one block of at least one row ({num_blocks=}, {block_size=})")
        self.block_size, self.num_blocks = block_size, num_blocks
        # One block more than the sessions get: `scratch`, where a fixed-shape step's padding rows read and write
        # (tether.server.step), so padding never touches a block someone owns.
        shape = (cfg.n_layers, num_blocks + 1, block_size, cfg.n_kv_heads, cfg.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)  # [L, num_blocks + 1, block_size, Hkv, D]
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.scratch = num_blocks  # never handed out
        # Flat views share the storage: slot s = block * block_size + offset.
        self.k_flat = self.k.view(cfg.n_layers, (num_blocks + 1) * block_size, cfg.n_kv_heads, cfg.head_dim)
        self.v_flat = self.v.view(cfg.n_layers, (num_blocks + 1) * block_size, cfg.n_kv_heads, cfg.head_dim)
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: recently freed blocks are reused first
        self._lock = threading.Lock()
        self.reclaim: Callable[[int], bool] | None = None  # frees blocks on demand; False when it cannot
        self.step_config = step_config
        self._runner: StepRunner | None = None  # runner_for's: the one step runner of this pool

    @staticmethod
    def block_bytes(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        """Bytes one block takes: K and V rows of every layer."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * cfg.n_layers * block_size * cfg.n_kv_heads * cfg.head_dim * itemsize

    @classmethod
    def for_budget(cls, cfg: ModelConfig, budget_bytes: int, block_size: int = 16, **kw) -> KVPool:
        """As many blocks as fit in `budget_bytes`."""
        per = cls.block_bytes(cfg, block_size, kw.get("dtype", torch.float32))
        if budget_bytes < per:
            raise ValueError(f"a KV budget of {budget_bytes} bytes holds no block of {per} bytes")
        return cls(cfg, budget_bytes // per, block_size, **kw)

    @property
    def device(self) -> torch.device:
        return self.k.device

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def alloc(self, n: int) -> list[int]:
        if n > self.num_blocks:
            raise PoolExhausted(f"{n} KV blocks needed, the whole pool holds {self.num_blocks}")
        while True:
            with self._lock:
                if len(self._free) >= n:
                    taken = self._free[len(self._free) - n :]
                    del self._free[len(self._free) - n :]
                    return taken[::-1]
                missing = n - len(self._free)
            # Outside the lock: reclaiming frees other sessions' blocks through free().
            if self.reclaim is None or not self.reclaim(missing):
                raise PoolExhausted(
                    f"KV pool full: {n} blocks of {self.block_size} positions needed, {self.free_blocks} of "
                    f"{self.num_blocks} free and no idle session to evict"
                )

    def free(self, blocks: Sequence[int]) -> None:
        with self._lock:
            self._free.extend(reversed(blocks))

    def accept(self, caches: Sequence[PagedCache], paths: Sequence[Sequence[int]]) -> None:
        """`cache.accept(path)` for many sequences of this pool with one copy for all of them (a batch's commit)."""
        src: list[int] = []
        dst: list[int] = []
        for c, path in zip(caches, paths, strict=True):
            if c.in_place(path):
                continue
            for s, d in zip(*c.accept_slots(path), strict=True):
                if s != d:  # an accepted chain prefix is already in place
                    src.append(s)
                    dst.append(d)
        if src:
            dev = self.device
            self.copy_slots(torch.tensor(src, device=dev), torch.tensor(dst, device=dev))
        for c, path in zip(caches, paths, strict=True):
            c.commit(len(path))

    def copy_slots(self, src: Tensor, dst: Tensor) -> None:
        """Copy rows at flat slots `src` to `dst` in every layer (how an accepted tree path is compacted)."""
        # Gather before scattering: source and destination slots may overlap.
        self.k_flat[:, dst] = self.k_flat[:, src].clone()
        self.v_flat[:, dst] = self.v_flat[:, src].clone()

    def runner_for(self, target: Target) -> StepRunner:
        """The step runner of `target`'s steps over this pool: made on the first call, then the same one (its graphs
        live as long as the pool). Asked for another target, a new one replaces it (a test's second model)."""
        runner = self._runner
        if runner is None or runner.target is not target:
            runner = self._runner = self.make_runner(target)
        return runner

    def make_runner(self, target: Target) -> StepRunner:
        """A new step runner for `target` over this pool, with the pool's step_config."""
        return StepRunner(target, self, self.step_config)

    def sequence(self, capacity: int) -> PagedCache:
        return PagedCache(self, capacity)

    def kernel_view(
        self, write_slots: Tensor, write_rows: Tensor | None, block_table: Tensor, cache_lens: Tensor, q_lens: Tensor
    ) -> PagedKernelView:
        """The paged verify kernel's window on this pool for one forward (PagedKernelView; a step's, StepPool)."""
        return PagedKernelView(self, write_slots, write_rows, block_table, cache_lens, q_lens)

    def block_tables(self, seqs: Sequence[PagedCache]) -> tuple[Tensor, Tensor]:
        """The paged kernel's view of `seqs`: block table int32 [B, max_blocks] (-1 past each row's blocks) and
        committed lengths int32 [B]."""
        width = max((len(s.blocks) for s in seqs), default=0)
        table = torch.full((len(seqs), width), -1, dtype=torch.int32)
        for i, s in enumerate(seqs):
            table[i, : len(s.blocks)] = torch.tensor(s.blocks, dtype=torch.int32)
        lens = torch.tensor([s.length for s in seqs], dtype=torch.int32)
        return table.to(self.device), lens.to(self.device)


class PagedCache:
    """One sequence's view of the pool, with KVCache's interface (batch size 1)."""

    batch_size = 1

    def __init__(self, pool: KVPool, capacity: int):
        self.pool, self.capacity = pool, capacity
        self.blocks: list[int] = []  # the block table
        self.length = 0  # committed positions
        self.released = False
        self._slot_table: Tensor | None = None  # flat slot of every position held, built when first needed

    # ---- block bookkeeping --------------------------------------------------------------------------

    def _check(self) -> None:
        if self.released:
            raise RuntimeError("this KV cache was released (its session was evicted or closed)")

    def _set_blocks(self, blocks: list[int]) -> None:
        # The device slot table is built lazily: the step path stages block tables from `blocks` on the host, and
        # rounds grow and trim blocks often; building it here cost a host-to-device copy and three kernels each.
        self.blocks = blocks
        self._slot_table = None

    @property
    def _slots(self) -> Tensor:
        """Flat pool slot of every position the blocks hold: [len(blocks) * block_size] long, on the device."""
        if self._slot_table is None:
            bs, dev = self.pool.block_size, self.pool.device
            base = torch.tensor(self.blocks, dtype=torch.long, device=dev)[:, None] * bs
            self._slot_table = (base + torch.arange(bs, device=dev)).flatten()
        return self._slot_table

    def reserve(self, n: int) -> None:
        """Make room for n rows past the committed length (taking blocks from the pool as needed)."""
        self._check()
        end = self.length + n
        if end > self.capacity:
            raise ValueError(f"KV cache full: {end} positions needed, capacity {self.capacity}")
        need = -(-end // self.pool.block_size) - len(self.blocks)
        if need > 0:
            self._set_blocks(self.blocks + self.pool.alloc(need))

    def _trim(self) -> None:
        """Give back the blocks past the committed length."""
        keep = -(-self.length // self.pool.block_size)
        if keep < len(self.blocks):
            self.pool.free(self.blocks[keep:])
            self._set_blocks(self.blocks[:keep])

    def release(self) -> None:
        if not self.released:
            self.pool.free(self.blocks)
            self._set_blocks([])
            self.length, self.released = 0, True

    def slots(self, start: int, end: int) -> Tensor:
        """Flat pool slots of positions [start, end): [end - start] long."""
        return self._slots[start:end]

    # ---- the KVCache interface ----------------------------------------------------------------------

    def write(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store new rows [1, T, Hkv, D] as pending and return every visible row: [1, length + T, Hkv, D]."""
        if k.shape[0] != 1:
            raise ValueError("a paged cache holds one sequence; batch through tether.server.batcher")
        end = self.length + k.shape[1]
        self.reserve(k.shape[1])
        new, seen = self._slots[self.length : end], self._slots[:end]
        kf, vf = self.pool.k_flat[layer], self.pool.v_flat[layer]
        kf[new] = k[0].to(kf.dtype)
        vf[new] = v[0].to(vf.dtype)
        return kf[seen][None], vf[seen][None]

    attend = gathering_attend  # no in-place path for one sequence: the model writes the rows and gathers them

    def advance(self, n: int) -> None:
        """Commit the first n pending rows."""
        self._check()
        if self.length + n > self.written:
            raise ValueError(f"cannot advance {n} rows past the {self.written - self.length} written")
        self.length += n

    def accept(self, path: Tensor | list[int]) -> None:
        """Commit the pending rows at offsets `path` (increasing), moving them to consecutive positions."""
        self.pool.accept([self], [list(map(int, path))])

    def in_place(self, path: Sequence[int]) -> bool:
        """Whether `path` is a chain prefix 0, 1, ..., n - 1 of rows written: accepting it moves nothing (the
        checks accept_slots makes, at the cost of one list comparison: most rows of a step are such prefixes)."""
        n = len(path)
        if n >= len(_PREFIXES) or path != _PREFIXES[n]:
            return False
        self._check()
        if n and self.length + n - 1 >= self.written:
            raise ValueError("accepted path reaches past the rows written")
        return True

    def accept_slots(self, path: Sequence[int]) -> tuple[list[int], list[int]]:
        """Where `accept(path)` moves rows: (source slots, destination slots), both host lists."""
        self._check()
        if any(b <= a for a, b in zip(path, path[1:], strict=False)):
            raise ValueError("accepted path offsets must be strictly increasing")
        if path and (path[0] < 0 or self.length + path[-1] >= self.written):
            raise ValueError("accepted path reaches past the rows written")
        bs, L = self.pool.block_size, self.length
        slot = lambda p: self.blocks[p // bs] * bs + p % bs  # noqa: E731
        return [slot(L + j) for j in path], [slot(L + i) for i in range(len(path))]

    @property
    def written(self) -> int:
        """Positions the cache's blocks can hold (committed and pending rows)."""
        return min(self.capacity, len(self.blocks) * self.pool.block_size)

    def commit(self, n: int) -> None:
        """The accepted rows are in place: commit n positions and give back the blocks past them."""
        self.length += n
        self._trim()

    def truncate(self, n: int) -> None:
        """Forget everything from position n on."""
        self._check()
        if not 0 <= n <= self.length:
            raise ValueError(f"truncate({n}) outside [0, {self.length}]")
        self.length = n
        self._trim()

    def rows(self, layer: int) -> tuple[Tensor, Tensor]:
        """The committed K and V of one layer: [length, Hkv, D] each (gathered copies)."""
        seen = self._slots[: self.length]
        return self.pool.k_flat[layer][seen], self.pool.v_flat[layer][seen]


def _store_new_rows(pool: KVPool, layer: int, slots: Tensor, rows: Tensor | None, k: Tensor, v: Tensor):
    """Scatter a forward's new K/V rows (k, v [B, Tq, Hkv, D]; `rows` index the flattened [B * Tq], None: all of
    them, in order) into their flat pool `slots`; returns the layer's flat K and V buffers [num_slots, Hkv, D]."""
    kf, vf = pool.k_flat[layer], pool.v_flat[layer]
    k, v = k.flatten(0, 1), v.flatten(0, 1)
    kf[slots] = (k if rows is None else k[rows]).to(kf.dtype)
    vf[slots] = (v if rows is None else v[rows]).to(vf.dtype)
    return kf, vf


class SlotView:
    """One forward's window on a pool shard: new rows go to flat `write_slots`; every row's keys are its
    `read_slots` rows followed by the new ones. The cache interface the model calls (`write`, `length`)."""

    length = 0  # positions are always given explicitly

    def __init__(self, pool: KVPool, write_slots: Tensor, write_rows: Tensor, read_slots: Tensor):
        dev = pool.device
        self.pool = pool
        self.write_slots = write_slots.to(dev)  # [N] flat slots of the new rows
        self.write_rows = write_rows.to(dev)  # [N] their indices in the flattened [B * Tq] new rows
        self.read_slots = read_slots.to(dev)  # [B, Lmax] flat slots of each row's prefix (padding: slot 0)

    def write(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        kf, vf = _store_new_rows(self.pool, layer, self.write_slots, self.write_rows, k, v)
        return torch.cat([kf[self.read_slots].to(k.dtype), k], 1), torch.cat([vf[self.read_slots].to(v.dtype), v], 1)

    attend = gathering_attend  # a gathering view: the model writes the rows and gathers the keys


class PagedKernelView:
    """One verify forward's window on a pool shard, read IN PLACE by the paged MoDA verify kernel
    (tether.kernels.moda_verify): each layer scatters the new rows into `write_slots` and attends through the rows'
    block tables; no prefix is gathered and no [B, Tq, Lmax + Tq] mask is built. The model calls `attend` instead
    of `write` + its backend; the tree_mask it passes is the new tokens' own [B, Tq, Tq] visibility (padded
    queries are not computed: their output rows are zeros). The batcher builds it (`paged_kernel_view`), and
    tensor-parallel ranks rebuild it from rank 0's tensors."""

    length = 0  # positions are always given explicitly

    def __init__(
        self,
        pool: KVPool,
        write_slots: Tensor,
        write_rows: Tensor | None,
        block_table: Tensor,
        cache_lens: Tensor,
        q_lens: Tensor,
    ):
        from tether.kernels.moda import moda_verify  # only the server imports the kernels, and only here

        dev = pool.device
        self.verify_op = moda_verify
        self.pool = pool
        self.write_slots = write_slots.to(dev)  # [N] flat slots of the new rows
        # [N] the new rows' indices in the flattened [B * Tq]; None: all of them, in order
        self.write_rows = None if write_rows is None else write_rows.to(dev)
        self.block_table = block_table.to(dev, torch.int32)  # [B, max_blocks]
        self.cache_lens = cache_lens.to(dev, torch.int32)  # [B] committed + new rows
        self.q_lens = q_lens.to(dev, torch.int32)  # [B] new rows

    def write(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Refused: the kernel reads the pool in place, so there are no gathered keys to hand back (`attend` never
        answers None, so the model never asks)."""
        raise TypeError("PagedKernelView attends in place: the model calls its attend, not write")

    def attend(
        self,
        layer: int,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        depth_k: Tensor | None,
        depth_v: Tensor | None,
        *,
        scale: float,
        tree_mask: Tensor | None,
    ) -> Tensor:
        """q [B, Tq, Hq, D], k/v [B, Tq, Hkv, D] (new rows), depth [B, Tq, L, Hkv, D] -> [B, Tq, Hq, D]."""
        _store_new_rows(self.pool, layer, self.write_slots, self.write_rows, k, v)
        out = torch.zeros_like(q)
        return self.verify_op(
            q,
            self.pool.k[layer],
            self.pool.v[layer],
            self.block_table,
            self.cache_lens,
            self.q_lens,
            depth_k,
            depth_v,
            tree_mask=tree_mask,
            scale=scale,
            out=out,
        )
