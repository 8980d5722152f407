"""Static-shape target steps over the paged KV pool, replayed from CUDA graphs.

A verify round, a Generate token and a resync absorb are all the same step: B rows, each a few new tokens
(a chain or a tree) after its own cached prefix in the pool, read in place by the paged MoDA verify kernel. At the
default model's size such a step is a few hundred small kernels and the host takes longer to launch them than the
GPU takes to run them, so `StepRunner` runs each step at a fixed shape and, on CUDA, captures it once as a CUDA
graph and replays it (as vLLM and gpt-fast do).

Contract:
- `StepRunner(target, pool, StepConfig)` serves one target over one pool. Padding rows and padded tokens read and
  write only the pool's `scratch` block, which no sequence is ever given.
- A `StepBatch` is the host's description of one step: per row its new tokens, their positions and visibility, the
  flat pool slots their K/V go to, its block table and lengths (tether.server.batcher builds them).
- `runner.forward(batch, states=...)` pads the batch up to its bucket (rows, tokens per row, block-table width:
  the smallest configured sizes that hold it), copies the metadata into that bucket's static buffers, and replays
  its graph (captured on first use), or runs the same function eagerly (graphs off, or the CPU); a batch larger
  than every bucket runs that function eagerly at its own shape (`runner.eager`: no padding, greedy None). It returns a
  StepOutput: the target's ForwardOutput for the padded batch (logits [Bb, Tb, V] and, with `states`, k/v
  [n_layers, Bb, Tb, Hkv, D] and the last hidden state [Bb, Tb, dim]) and every row's greedy verdict, decided inside
  the step (tether.shared.acceptance.greedy_packed). These are views of the graph's own memory: they hold until the
  next step, so callers hold `runner.lock` from `forward` until they have copied out what they keep.
- Nothing in a step reads the device back (no host syncs), so a step can be captured; the caller syncs once, when
  it reads the verdicts.

    runner = StepRunner(target, pool)
    with runner.lock:
        step = runner.forward(batch, states=True)
        verdicts = unpack_verdicts(trees, host_copy(step.greedy))  # greedy rows; sampled ones: verify_rows
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import numpy as np
import torch
from torch import Tensor

from tether.server.device_wait import host_copy
from tether.shared.acceptance import greedy_packed
from tether.shared.contracts import ForwardCache, ForwardOutput
from tether.shared.drafter import POSITION_AXIS, TargetStates
from tether.shared.model import Transformer

log = logging.getLogger("tether.server")
_CAPTURE_LOCK = threading.Lock()  # one CUDA graph capture at a time in this process (StepRunner._capture)


class StepPool(Protocol):
    """What a StepRunner needs of the pool it steps over (tether.server.kv_pool.KVPool, which makes its runner, and
    a tensor-parallel rank's shard of one): its device and block size, the `scratch` block padding reads and writes,
    and the window the paged verify kernel reads in place (`kernel_view`: KVPool's PagedKernelView over it)."""

    block_size: int
    scratch: int  # the block never handed to a sequence

    @property
    def device(self) -> torch.device: ...

    def kernel_view(
        self, write_slots: Tensor, write_rows: Tensor | None, block_table: Tensor, cache_lens: Tensor, q_lens: Tensor
    ) -> ForwardCache: ...


@dataclass(frozen=True)
class StepConfig:
    graphs: bool = True  # capture and replay CUDA graphs (CUDA only; elsewhere, and with False, steps run eagerly)
    batch_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128)  # rows per step a graph is captured for
    token_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)  # new tokens per row a graph is captured for
    min_width: int = 8  # smallest block-table width (blocks per row) of a bucket; widths double from here
    max_bucket_tokens: int = 2048  # rows x tokens above which a step runs eagerly (bounds each graph's memory)
    decode_steps: tuple[int, ...] = (1, 2, 4, 8, 16)  # greedy one-token steps chained in one graph (plain decoding)


class Bucket(NamedTuple):
    rows: int  # padded rows
    tokens: int  # padded new tokens per row
    width: int  # padded block-table width (blocks per row)
    states: bool  # whether the step returns per-layer K/V and the last hidden state


@dataclass
class StepBatch:
    """One step's inputs, on the host as numpy arrays (built by tether.server.rounds.step_batch)."""

    tokens: np.ndarray  # [B, T] int64: new tokens (padding: anything in the vocabulary)
    positions: np.ndarray  # [B, T] int64: their RoPE positions (< the target's max_seq_len)
    parents: np.ndarray  # [B, T] int64: each new token's parent among them (the root's: -1; padding: 0)
    tree_mask: np.ndarray  # [B, T, T] bool: new token i sees new token j (padding rows may see only themselves)
    slots: np.ndarray  # [B, T] int64: flat pool slot each new row's K/V goes to (-1: padding, the scratch block)
    block_table: np.ndarray  # [B, W] int64: each row's blocks, the new rows' included (-1 past them)
    cache_lens: np.ndarray  # [B] int64: committed prefix + new tokens
    q_lens: np.ndarray  # [B] int64: real new tokens per row (1 <= q_lens <= T)

    @property
    def rows(self) -> int:
        return self.tokens.shape[0]


class StepOutput(NamedTuple):
    out: ForwardOutput  # the padded batch's forward (views of the step's memory)
    greedy: Tensor | None  # [Bb, Tb + 3] long: every row's greedy verdict, pack's layout (None: an eager step)


def _round_up(n: int, sizes: tuple[int, ...]) -> int | None:
    return next((s for s in sorted(sizes) if s >= n), None)


class _Graph:
    """One bucket's static buffers (host staging in pinned memory on CUDA, device copies) and its captured graph."""

    def __init__(self, runner: StepRunner, bucket: Bucket):
        B, T, W, _ = bucket
        dev = runner.pool.device
        self.bucket = bucket
        # All integer metadata travels in one copy: tokens, positions, parents, slots [B*T each], lens, q_lens [B],
        # table [B*W].
        self.sizes = (B * T, B * T, B * T, B * T, B, B, B * W)
        total = sum(self.sizes)
        pin = dev.type == "cuda"
        self.host_meta = torch.empty(total, dtype=torch.long, pin_memory=pin)
        self.host_mask = torch.empty(B, T, T, dtype=torch.bool, pin_memory=pin)
        self.meta = torch.empty(total, dtype=torch.long, device=dev)
        self.mask = torch.empty(B, T, T, dtype=torch.bool, device=dev)
        self.copied: torch.cuda.Event | None = None  # the last upload: staging is rewritten only after it
        self.graph: torch.cuda.CUDAGraph | None = None
        self.result: StepOutput | None = None

    def stage(self, runner: StepRunner, batch: StepBatch | None) -> None:
        """Write the batch, padded to the bucket, into the staging buffers (numpy views: a few microseconds) and
        upload them."""
        B, T, W, _ = self.bucket
        if self.copied is not None:
            self.copied.synchronize()
        tokens, positions, parents, slots, lens, q_lens, table = np.split(
            self.host_meta.numpy(), np.cumsum(self.sizes)[:-1]
        )
        mask = self.host_mask.numpy()
        tokens[:] = 0
        positions[:] = 0
        parents[:] = 0
        slots[:] = runner.scratch_slot
        lens[:] = 1  # a padding row: one new token at position 0 of the scratch block, seeing only itself
        q_lens[:] = 1
        table[:] = runner.scratch
        mask[:] = False
        mask[:, 0, 0] = True
        if batch is not None:
            b, t = batch.tokens.shape
            w = batch.block_table.shape[1]
            tokens.reshape(B, T)[:b, :t] = batch.tokens
            positions.reshape(B, T)[:b, :t] = batch.positions
            parents.reshape(B, T)[:b, :t] = np.maximum(batch.parents, 0)
            own = slots.reshape(B, T)[:b, :t]
            own[:] = np.where(batch.slots < 0, runner.scratch_slot, batch.slots)
            lens[:b] = batch.cache_lens
            q_lens[:b] = batch.q_lens
            table.reshape(B, W)[:b, :w] = batch.block_table
            mask[:b, :t, :t] = batch.tree_mask
        self.meta.copy_(self.host_meta, non_blocking=True)
        self.mask.copy_(self.host_mask, non_blocking=True)
        if self.meta.is_cuda:
            self.copied = torch.cuda.Event(blocking=True)  # its synchronize sleeps (tether.server.device_wait)
            self.copied.record()

    def run(self, runner: StepRunner) -> StepOutput:
        """The step itself, from the device buffers: what a graph captures."""
        B, T, _, states = self.bucket
        tokens, positions, parents, slots, lens, q_lens, table = self.meta.split(self.sizes)
        out = _forward(runner, self.bucket, tokens, positions, slots, lens, q_lens, table, self.mask)
        if states and runner.use_graphs:
            out = runner.shared_states(B, T, out)
        return StepOutput(out, greedy_packed(out.logits, tokens.view(B, T), parents.view(B, T), q_lens))


def _forward(
    runner: StepRunner,
    shape: Bucket,
    tokens: Tensor,
    positions: Tensor,
    slots: Tensor,
    lens: Tensor,
    q_lens: Tensor,
    table: Tensor,
    mask: Tensor,
) -> ForwardOutput:
    """The target's forward of a step of `shape` from its device tensors (flat tokens, positions and slots [B * T],
    lens and q_lens [B], table [B * W]; mask [B, T, T]): a bucket's graph and an eager step both run it."""
    B, T, W, states = shape
    # Every new row is scattered, in order (write_rows None): padding into the scratch block.
    view = runner.pool.kernel_view(
        slots, None, table.view(B, W).to(torch.int32), lens.to(torch.int32), q_lens.to(torch.int32)
    )
    target = runner.target
    return target.run(
        tokens.view(B, T),
        cache=view,
        positions=positions.view(B, T),
        tree_mask=mask,
        hidden_layers=(target.cfg.n_layers,) if states else (),
        return_kv=states,
    )


def _server_part(drafter, out: ForwardOutput, rows: int) -> dict[str, Tensor]:
    """The drafter's server part over every token of a forward's first `rows` rows: [rows * T] along each
    POSITION_AXIS."""
    flat = TargetStates(
        k=out.k[:, :rows].flatten(1, 2), v=out.v[:, :rows].flatten(1, 2), hidden=out.hidden[0][:rows].flatten(0, 1)
    )
    return drafter.server_delta(flat, 0, []).tensors


class _PartGraph:
    """A drafter's server part (MoA's LSA: a small transformer block over each token's layers) captured over the
    states of every step of `rows` x `tokens` (StepRunner.shared_states: each such step graph, whatever its
    block-table width, copies its states there). Eager, it is ~50 kernel launches a round: on the H200 the
    batcher's host spent 60% of its time launching them at 128 clients."""

    def __init__(self, drafter, states: ForwardOutput, rows: int):
        self.drafter, self.states, self.rows = drafter, states, rows
        self.graph: torch.cuda.CUDAGraph | None = None
        self.result: dict[str, Tensor] | None = None

    def run(self, runner: StepRunner) -> dict[str, Tensor]:
        return _server_part(self.drafter, self.states, self.rows)


class DecodeBucket(NamedTuple):
    steps: int  # one-token steps chained in the graph
    width: int  # padded block-table width (blocks)


class _DecodeGraph:
    """Plain greedy decoding of one sequence, `steps` tokens per replay: each step's argmax is the next step's input
    on the device, and its position, slot and length are computed there, so the host uploads one token, one position
    and the block table, and reads back `steps` tokens. Each step is the verify step of a one-node tree."""

    def __init__(self, runner: StepRunner, bucket: DecodeBucket):
        dev = runner.pool.device
        self.bucket = bucket
        pin = dev.type == "cuda"
        self.host_meta = torch.empty(2 + bucket.width, dtype=torch.long, pin_memory=pin)  # token, position, table
        self.meta = torch.empty(2 + bucket.width, dtype=torch.long, device=dev)
        self.copied: torch.cuda.Event | None = None
        self.graph: torch.cuda.CUDAGraph | None = None
        self.result: Tensor | None = None  # [steps] long

    def stage(self, token: int, position: int, blocks: list[int]) -> None:
        if self.copied is not None:
            self.copied.synchronize()
        meta = self.host_meta.numpy()
        meta[0], meta[1] = token, position
        meta[2:] = -1
        meta[2 : 2 + len(blocks)] = blocks
        self.meta.copy_(self.host_meta, non_blocking=True)
        if self.meta.is_cuda:
            self.copied = torch.cuda.Event(blocking=True)  # its synchronize sleeps (tether.server.device_wait)
            self.copied.record()

    def run(self, runner: StepRunner) -> Tensor:
        K, W = self.bucket
        bs = runner.pool.block_size
        dev = self.meta.device
        table = self.meta[2:]  # [W]
        table32 = table.view(1, W).to(torch.int32)
        q_len = torch.ones(1, dtype=torch.int32, device=dev)
        sees_itself = torch.ones(1, 1, 1, dtype=torch.bool, device=dev)
        token = self.meta[0:1].view(1, 1)
        out = []
        for i in range(K):
            pos = self.meta[1:2] + i  # [1]
            slot = table[pos // bs] * bs + pos % bs  # [1]
            view = runner.pool.kernel_view(slot, None, table32, (pos + 1).to(torch.int32), q_len)
            logits = runner.target.run(token, cache=view, positions=pos.view(1, 1), tree_mask=sees_itself).logits
            token = logits.argmax(-1)  # [1, 1]: first maximum on ties, as the verdicts take it
            out.append(token.view(1))
        return torch.cat(out)  # [K]


class StepRunner:
    def __init__(self, target: Transformer, pool: StepPool, config: StepConfig | None = None):
        self.target, self.pool = target, pool
        self.config = config or StepConfig()
        self.use_graphs = self.config.graphs and pool.device.type == "cuda"
        self.scratch = pool.scratch  # padding reads and writes only this block: never any sequence's
        self.scratch_slot = self.scratch * pool.block_size
        self.lock = threading.RLock()  # held from forward until the caller has copied its outputs out
        self._graphs: dict[Bucket, _Graph] = {}
        self._decode: dict[DecodeBucket, _DecodeGraph] = {}
        self._mempool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        # The server-part graphs get a pool of their own: one is replayed after step graphs captured after it, whose
        # outputs (read after that replay) could otherwise lie in memory its temporaries use (seen on the H200: the
        # verdicts of a later-captured step were overwritten).
        self._parts_mempool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        self._last: _Graph | None = None  # the bucket `forward` ran last: its outputs are what the caller holds
        self._states: dict[tuple[int, int], ForwardOutput] = {}  # (rows, tokens) -> the states its steps leave
        self._parts: dict[tuple[object, int, int], _PartGraph] = {}  # (drafter, rows, tokens) -> its server part
        self.max_width = -(-target.cfg.max_seq_len // pool.block_size)

    def close(self) -> None:
        """Drop the graphs (and the memory they hold)."""
        with self.lock:
            self._graphs.clear()
            self._decode.clear()
            self._parts.clear()
            self._states.clear()

    def _width(self, width: int) -> int:
        """A block-table width padded to the next bucket: doubling from min_width, capped at what max_seq_len needs."""
        W = self.config.min_width
        while W < width:
            W *= 2
        return min(W, max(self.max_width, width))

    def bucket(self, rows: int, tokens: int, width: int, states: bool) -> Bucket | None:
        """The bucket a step of this shape pads up to; None when it exceeds every bucket."""
        c = self.config
        B, T = _round_up(rows, c.batch_buckets), _round_up(tokens, c.token_buckets)
        if B is None or T is None or B * T > c.max_bucket_tokens:
            return None
        return Bucket(B, T, self._width(width), states)

    def _replay(self, g: _Graph | _DecodeGraph | _PartGraph):
        """Run a staged step: eagerly without graphs, else its graph (captured on first use)."""
        if not self.use_graphs:
            return g.run(self)
        if g.graph is None:
            self._capture(g)
        g.graph.replay()
        return g.result

    @torch.inference_mode()
    def forward(self, batch: StepBatch, *, states: bool) -> StepOutput:
        """One step (see the module docstring); hold `self.lock` until the outputs have been copied out. A batch no
        bucket holds runs eagerly at its own shape (`eager`)."""
        with self.lock:
            b, t = batch.tokens.shape
            bucket = self.bucket(b, t, batch.block_table.shape[1], states)
            if bucket is None:
                return self.eager(batch, states=states)
            g = self._graphs.get(bucket) or self._graphs.setdefault(bucket, _Graph(self, bucket))
            g.stage(self, batch)
            self._last = g
            return self._replay(g)

    @torch.inference_mode()
    def eager(self, batch: StepBatch, *, states: bool) -> StepOutput:
        """The step's forward at the batch's own shape: the same StepBatch and function as a bucket's, uploaded in
        one copy, without padding, static buffers or a graph (a step larger than every bucket: one of a kind, so
        nothing is kept for it). Its outputs are its own tensors; `greedy` is None (the caller decides the verdicts
        from the logits)."""
        b, t = batch.tokens.shape
        w = batch.block_table.shape[1]
        slots = np.where(batch.slots < 0, self.scratch_slot, batch.slots)  # padding: the scratch block
        flat = np.concatenate(
            [
                batch.tokens.ravel(),
                batch.positions.ravel(),
                slots.ravel(),
                batch.cache_lens,
                batch.q_lens,
                batch.block_table.ravel(),
            ]
        )
        dev = self.pool.device
        sizes = (b * t, b * t, b * t, b, b, b * w)
        tokens, positions, slots_d, lens, q_lens, table = torch.from_numpy(flat).to(dev).split(sizes)
        mask = torch.from_numpy(batch.tree_mask).to(dev)
        out = _forward(self, Bucket(b, t, w, states), tokens, positions, slots_d, lens, q_lens, table, mask)
        return StepOutput(out, None)

    def shared_states(self, rows: int, tokens: int, out: ForwardOutput) -> ForwardOutput:
        """`out` with its K/V and last hidden state copied into the buffers every step of `rows` x `tokens` shares
        (allocated by the first, eager, run: before any capture), so one server-part graph serves every block-table
        width of that shape. Inside a step graph the copies are three more kernels of it."""
        buf = self._states.get((rows, tokens))
        if buf is None:
            buf = self._states[(rows, tokens)] = ForwardOutput(
                None, torch.empty_like(out.k), torch.empty_like(out.v), (torch.empty_like(out.hidden[0]),)
            )
        buf.k.copy_(out.k)
        buf.v.copy_(out.v)
        buf.hidden[0].copy_(out.hidden[0])
        return dataclasses.replace(out, k=buf.k, v=buf.v, hidden=buf.hidden)

    def _part(self, drafter, rows: int, tokens: int) -> _PartGraph:
        key = (drafter, rows, tokens)
        part = self._parts.get(key)
        if part is None:
            part = self._parts[key] = _PartGraph(drafter, self._states[(rows, tokens)], rows)
        return part

    @torch.inference_mode()
    def server_part(self, drafter, out: ForwardOutput, rows: int) -> dict[str, Tensor]:
        """The drafter's server part (DraftDelta tensors) over every token of `out`'s first `rows` rows, [rows * T]
        along each tensor's POSITION_AXIS (row b's token j at b * T + j); `out` needs states. For the step `forward`
        just returned, under the same hold of `lock`, it is a graph of its own over all the bucket's rows (captured
        on first use per drafter and rows x tokens, whatever the width; views of its memory, valid until the next
        step); otherwise it runs eagerly."""
        with self.lock:
            g = self._last
            if not self.use_graphs or g is None or g.result is None or g.result.out is not out:
                return _server_part(drafter, out, rows)
            part = self._part(drafter, g.bucket.rows, g.bucket.tokens)
            n = rows * out.logits.shape[1]
            return {k: t.narrow(POSITION_AXIS[k], 0, n) for k, t in self._replay(part).items()}

    @torch.inference_mode()
    def decode(self, cache, token: int, wanted: int) -> list[int]:
        """Greedy tokens after `token` (whose K/V the cache does not hold yet): as many as the largest decode bucket
        within `wanted` and the cache's room, one replay. Commits `token` and every generated token but the last
        (the next call's `token`), as that many one-token verify rounds would. A PagedCache of this runner's pool."""
        with self.lock:
            room = cache.capacity - cache.length
            steps = max((k for k in self.config.decode_steps if k <= min(room, wanted)), default=0)
            if steps == 0:
                raise ValueError(f"no decode step fits {room} positions of room for {wanted} tokens")
            cache.reserve(steps)
            bucket = DecodeBucket(steps, self._width(len(cache.blocks)))
            g = self._decode.get(bucket) or self._decode.setdefault(bucket, _DecodeGraph(self, bucket))
            g.stage(token, cache.length, cache.blocks)
            tokens = host_copy(self._replay(g)).tolist()
        cache.commit(steps)
        return tokens

    def shapes(self) -> list[list[int]]:
        """The captured graphs' shapes, for a warm start to capture again (tether.server.warm_cache): a verify
        step as [rows, tokens, width, states], a decode chain as [steps, width]."""
        with self.lock:
            verify = [[b.rows, b.tokens, b.width, int(b.states)] for b, g in self._graphs.items() if g.graph]
            return verify + [[b.steps, b.width] for b, g in self._decode.items() if g.graph]

    def round_shapes(self, tokens: int) -> list[list[int]]:
        """Every verify step with states that rounds of `tokens` new tokens per row pad up to, for capture_shapes:
        each row bucket (within max_bucket_tokens) at each block-table width. A server that captures them before
        its first client, as vLLM captures its batch sizes up front, pays no capture in the rounds of a load ramp
        or of contexts growing into a wider bucket (each one a stall of the whole step)."""
        c = self.config
        T = _round_up(tokens, c.token_buckets)
        if T is None:
            return []
        doublings = range(self.max_width.bit_length())
        widths = sorted({self._width(min(c.min_width << i, self.max_width)) for i in doublings})
        return [[B, T, W, 1] for B in c.batch_buckets if B * T <= c.max_bucket_tokens for W in widths]

    @torch.inference_mode()
    def capture_shapes(self, shapes: list[list[int]], drafter=None) -> int:
        """Capture the graphs `shapes()` listed (unknown or out-of-range entries are skipped), and with a `drafter`
        its server part beside each verify step that returns states; returns how many steps."""
        if not self.use_graphs:
            return 0
        done = 0
        with self.lock:
            for s in shapes:
                if len(s) == 4 and Bucket(s[0], s[1], s[2], bool(s[3])) == self.bucket(s[0], s[1], s[2], bool(s[3])):
                    b = Bucket(s[0], s[1], s[2], bool(s[3]))
                    g = self._graphs.get(b) or self._graphs.setdefault(b, _Graph(self, b))
                    g.stage(self, None)  # padding only: the scratch block
                elif len(s) == 2 and s[0] in self.config.decode_steps and 0 < s[1] <= self.max_width:
                    b = DecodeBucket(s[0], s[1])
                    g = self._decode.get(b) or self._decode.setdefault(b, _DecodeGraph(self, b))
                    g.stage(0, 0, [self.scratch] * b.width)  # every position of the chain in the scratch block
                else:
                    continue
                if g.graph is None:
                    self._capture(g)
                if drafter is not None and isinstance(g, _Graph) and g.bucket.states:
                    part = self._part(drafter, g.bucket.rows, g.bucket.tokens)
                    if part.graph is None:
                        self._capture(part)
                done += 1
        return done

    def _capture(self, g: _Graph | _DecodeGraph | _PartGraph) -> None:
        # Thread-local capture mode: other threads (prefills, deltas, Generate) keep using CUDA while this one
        # captures; in the default global mode their first cudaMalloc or synchronize failed (seen on the H200 with
        # two Generate streams), and the broken capture left the allocator recording into the pool. One capture at
        # a time in the process, runners of other pools included: captures are rare (once per bucket), so
        # serialising them costs nothing and keeps the allocator's capture bookkeeping to one at a time.
        with _CAPTURE_LOCK:
            # Eager runs first, on a side stream as torch's graph capture wants: Triton compiles its kernels there
            # and the caching allocator settles, so the capture records only the step.
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    g.run(self)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            pool = self._parts_mempool if isinstance(g, _PartGraph) else self._mempool
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                g.result = g.run(self)
            g.graph = graph
        log.debug("captured a step graph: %s", type(g).__name__)
