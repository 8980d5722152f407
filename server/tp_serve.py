"""Serving a tensor-parallel target: `tether-server serve --tp N`.

Contract: rank 0 is the gRPC server. It runs the ordinary TetherService over a `TPTarget`, a stand-in for the
model whose every forward and every KV-pool copy is first broadcast, as a small command, to ranks 1..N-1
(which run `follow` and nothing else), then executed by all ranks together: each rank computes its heads of
the attention and its slice of the MLP (tether.server.tp.apply_tp), the all-reduces make logits and hidden
states whole everywhere, and per-layer K/V are gathered to rank 0 when the drafter needs them.
Each rank keeps its own shard (its KV heads) of one paged KV pool; block tables, allocation and eviction live
on rank 0 only, and commands carry flat slot indices, so all shards stay the same shape and in step.
Commands travel over a gloo group (CPU, pickled) and tensors over the device group (NCCL on GPUs).
A lock on rank 0 keeps commands in one order: gRPC threads and the batcher never interleave collectives.
On the "triton" backend every rank's shard is fused after sharding (tether.server.fuse) and the batcher's steps
go through `TPStepRunner`: rank 0 broadcasts the step's host metadata (a StepBatch), then every rank runs its
own StepRunner on it (eagerly for now: see TPPool.make_runner); the K/V heads a drafter needs are gathered after
the step.

    tether-server serve --tp 2                  # one process per GPU, rank 0 listens
    tether-server serve --tp 2 --device cpu     # the same over gloo (tests)
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor

from tether.server.kv_pool import KVPool, PagedCache, PagedKernelView, SlotView
from tether.server.model_loading import ModelChoice, load_target
from tether.server.step import Bucket, StepBatch, StepConfig, StepOutput, StepRunner
from tether.server.tp import apply_tp, disable_multicast, free_port, gather_heads, init_distributed
from tether.shared.config import ModelConfig
from tether.shared.contracts import ForwardCache, ForwardOutput, SequenceCache
from tether.shared.model import Transformer

log = logging.getLogger("tether.server")


def _window_of(cache: ForwardCache, n_new: int) -> dict:
    """The pool window of a forward as tensors every rank can rebuild it from: write_slots, write_rows and either
    read_slots (a gathering SlotView) or the paged kernel's block_table, cache_lens and q_lens (PagedKernelView).
    `cache` is a PagedCache (one sequence), a batcher's PagedBatchView or its PagedKernelView. Told apart by type
    until each of them answers its own window (a `window(n_new)` method in server/kv_pool.py and server/rounds.py)."""
    if isinstance(cache, PagedCache):
        cache.reserve(n_new)
        L = cache.length
        return {
            "write_slots": cache.slots(L, L + n_new),
            "write_rows": torch.arange(n_new),
            "read_slots": cache.slots(0, L)[None],
        }
    if isinstance(cache, PagedKernelView):
        return {
            "write_slots": cache.write_slots,
            "write_rows": cache.write_rows,
            "block_table": cache.block_table,
            "cache_lens": cache.cache_lens,
            "q_lens": cache.q_lens,
        }
    if hasattr(cache, "slot_view"):
        v = cache.slot_view
        return {"write_slots": v.write_slots, "write_rows": v.write_rows, "read_slots": v.read_slots}
    raise TypeError(f"a tensor-parallel target needs its KV in the paged pool, not a {type(cache).__name__}")


def _execute(model: Transformer, pool: KVPool, cmd: dict) -> ForwardOutput:
    """Run one broadcast forward on this rank (every rank calls it with the same command)."""
    dev = pool.device
    w = cmd["window"]
    if "block_table" in w:
        view = PagedKernelView(pool, w["write_slots"], w["write_rows"], w["block_table"], w["cache_lens"], w["q_lens"])
    else:
        view = SlotView(pool, w["write_slots"], w["write_rows"], w["read_slots"])
    mask = cmd["tree_mask"]
    out = model.run(
        cmd["ids"].to(dev),
        cache=view,
        positions=cmd["positions"].to(dev),
        tree_mask=None if mask is None else mask.to(dev),
        hidden_layers=cmd["hidden_layers"],
        return_kv=cmd["return_kv"],
        last_only=cmd["last_only"],
    )
    if cmd["return_kv"]:
        out = dataclasses.replace(out, k=gather_heads(out.k, -2), v=gather_heads(out.v, -2))  # [L, B, T, Hkv, D]
    return out


def shard(model: Transformer, rank: int, world: int) -> Transformer:
    """This rank's part of the model: sharded, then fused when it runs the Triton kernels (every rank the same)."""
    apply_tp(model, rank, world)
    if model.backend == "triton":
        from tether.server.fuse import fuse  # imports the kernels: only where they run

        fuse(model)
    return model


def _step(runner: StepRunner, batch: StepBatch, states: bool) -> StepOutput:
    """One step on this rank (every rank calls it with the same batch): replay, then gather the K/V heads."""
    step = runner.forward(batch, states=states)
    if not states:
        return step
    out = step.out
    return StepOutput(dataclasses.replace(out, k=gather_heads(out.k, -2), v=gather_heads(out.v, -2)), step.greedy)


class TPStepRunner:
    """Rank 0's step runner (the part of StepRunner's interface tether.server.rounds uses): each step is first
    broadcast to the followers, which replay the same bucket on their shards."""

    def __init__(self, target: TPTarget, runner: StepRunner):
        self.target, self.runner = target, runner
        self.lock = runner.lock  # held by the caller from forward until it has copied out what it keeps

    def bucket(self, rows: int, tokens: int, width: int, states: bool) -> Bucket | None:
        return self.runner.bucket(rows, tokens, width, states)

    def forward(self, batch: StepBatch, *, states: bool) -> StepOutput:
        cmd = {"op": "step", "batch": batch, "states": states, "config": self.runner.config}
        return self.target.broadcast(cmd, lambda: _step(self.runner, batch, states))

    def server_part(self, drafter, out, rows: int) -> dict:
        """The drafter runs on rank 0 alone, over the states the step gathered."""
        return self.runner.server_part(drafter, out, rows)


class TPPool(KVPool):
    """Rank 0's pool shard: slot copies (accepted tree paths) are mirrored on every rank, and its step runner is a
    TPStepRunner."""

    def __init__(self, *args, broadcast, **kw):
        super().__init__(*args, **kw)
        self._broadcast = broadcast

    def make_runner(self, target: TPTarget) -> TPStepRunner:
        # Steps run eagerly on every rank for now: replayed from CUDA graphs (NCCL inside), serve gave wrong tokens
        # on two H200s (tests/server/test_tp_serve.py) although the same fused shards replayed by bench/tp.py, and
        # by StepRunners without TPTarget, matched the single-GPU model; eager steps pass. Issue #14 follows it up.
        config = dataclasses.replace(self.step_config or StepConfig(), graphs=False)
        return TPStepRunner(target, StepRunner(target.model, self, config))

    def copy_slots(self, src: Tensor, dst: Tensor) -> None:
        self._broadcast(
            {"op": "copy", "src": src.cpu(), "dst": dst.cpu()}, lambda: super(TPPool, self).copy_slots(src, dst)
        )


class TPTarget:
    """Rank 0's handle on the tensor-parallel model: a tether.shared.contracts.Target (run, prefill, verify, cfg,
    device, dtype, backend, tp, new_cache), with every forward broadcast to the other ranks first."""

    def __init__(self, model: Transformer, cmd_group):
        self.model, self.cmd_group = model, cmd_group
        self.lock = threading.Lock()
        self.pool: KVPool | None = None

    # ---- the Target members that are the shard's own ----------------------------------------------------------

    @property
    def cfg(self) -> ModelConfig:
        return self.model.cfg  # the shard's: heads and ffn_dim divided by the world size

    @property
    def backend(self) -> str:
        return self.model.backend

    @property
    def tp(self) -> tuple[int, int]:
        return self.model.tp

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    def new_cache(self, batch_size: int = 1, capacity: int | None = None) -> SequenceCache:
        return self.model.new_cache(batch_size, capacity)  # whose forwards then refuse it (_window_of)

    def __getattr__(self, name: str):
        # The rest of the shard (embed_tokens, layers, ...) for code written against a Transformer: the drafter and
        # the engine's pool sizing (server/engine_core.py reads embed_tokens; `dtype` is the Target member for it).
        return getattr(self.model, name)

    def broadcast(self, cmd: dict, local):
        """Send `cmd` to every follower and run `local` here, atomically with respect to other commands."""
        with self.lock:
            dist.broadcast_object_list([cmd], src=0, group=self.cmd_group)
            return local()

    def make_pool(self, budget_bytes: int, block_size: int) -> KVPool:
        """The pool shard of rank 0; followers build theirs from the same arguments (`follow`)."""
        self.pool = TPPool.for_budget(
            self.model.cfg,
            budget_bytes,
            block_size,
            device=self.model.device,
            dtype=self.model.embed_tokens.weight.dtype,
            broadcast=self.broadcast,
        )
        return self.pool

    @torch.inference_mode()
    def run(
        self,
        input_ids: Tensor,
        *,
        cache: ForwardCache | None = None,
        positions: Tensor | None = None,
        tree_mask: Tensor | None = None,
        hidden_layers: Sequence[int] = (),
        return_kv: bool = False,
        last_only: bool = False,
    ) -> ForwardOutput:
        B, T = input_ids.shape
        with self.lock:  # slot reservation and the forward must not interleave with another thread's
            window = {name: t.cpu() for name, t in _window_of(cache, T).items()}
            if positions is None:
                positions = torch.arange(cache.length, cache.length + T)
            cmd = {
                "op": "run",
                "ids": input_ids.cpu(),
                "positions": positions.cpu().view(-1, T),
                "tree_mask": None if tree_mask is None else tree_mask.cpu(),
                "window": window,
                "hidden_layers": tuple(hidden_layers),
                "return_kv": return_kv,
                "last_only": last_only,
            }
            dist.broadcast_object_list([cmd], src=0, group=self.cmd_group)
            return _execute(self.model, self.pool, cmd)

    def prefill(self, input_ids: Tensor, cache: SequenceCache, **kw) -> ForwardOutput:
        out = self.run(input_ids, cache=cache, **kw)
        cache.advance(input_ids.shape[1])
        return out

    def verify(self, input_ids: Tensor, cache: SequenceCache, **kw) -> ForwardOutput:
        return self.run(input_ids, cache=cache, **kw)

    def stop(self, timeout_s: float = 10.0) -> bool:
        """Tell the followers to exit. False when a forward still holds the lock after `timeout_s` (a call that
        never finished): then the caller ends them instead, since a command now could interleave a collective."""
        if not self.lock.acquire(timeout=timeout_s):
            log.warning("a forward is still running at shutdown; stopping the followers without a command")
            return False
        try:
            dist.broadcast_object_list([{"op": "stop"}], src=0, group=self.cmd_group)
            return True
        finally:
            self.lock.release()


def follow(model: Transformer, pool: KVPool, cmd_group) -> None:
    """Ranks 1..N-1: execute rank 0's commands until it says stop."""
    runner = None
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=cmd_group)
        cmd = box[0]
        if cmd["op"] == "stop":
            return
        with torch.inference_mode():
            if cmd["op"] == "copy":
                pool.copy_slots(cmd["src"].to(pool.device), cmd["dst"].to(pool.device))
            elif cmd["op"] == "step":
                runner = runner or StepRunner(model, pool, cmd["config"])
                _step(runner, cmd["batch"], cmd["states"])
            else:
                _execute(model, pool, cmd)


def _exit_with_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def _follower_main(rank: int, port: int, cfg: ModelChoice, device: str, budget: int, block: int) -> None:
    # Rank 0 decides when to stop (a terminal's Ctrl-C reaches the whole process group); if rank 0 dies without
    # saying so, a follower must not linger holding a GPU.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    parent = os.getppid()
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()
    world = cfg.tp
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    init_distributed("nccl" if device == "cuda" else "gloo")
    cmd_group = dist.new_group(backend="gloo")
    model, _ = load_target(cfg, f"cuda:{rank}" if device == "cuda" else "cpu")
    shard(model, rank, world)
    torch.set_grad_enabled(False)
    pool = KVPool.for_budget(model.cfg, budget, block, device=model.device, dtype=model.embed_tokens.weight.dtype)
    try:
        follow(model, pool, cmd_group)
    finally:
        dist.destroy_process_group()


def start_followers(cfg: ModelChoice, device: str, budget: int, block: int) -> tuple[list, int]:
    """Start ranks 1..cfg.tp-1 as fresh processes, each loading its target from the same config as rank 0
    (tether.server.model_loading.load_target) on `device` ("cuda": one GPU a rank, or "cpu"), with a KV pool of
    `budget` bytes in blocks of `block` tokens; returns them and the rendezvous port rank 0 must use."""
    disable_multicast()
    port = free_port()
    ctx = mp.get_context("spawn")
    args = (port, cfg, device, budget, block)
    procs = [ctx.Process(target=_follower_main, args=(r, *args), daemon=True) for r in range(1, cfg.tp)]
    for p in procs:
        p.start()
    return procs, port


def join_rank0(world: int, port: int, device: str) -> object:
    """Rank 0 joins the group; returns the command group."""
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE=str(world))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    init_distributed("nccl" if device == "cuda" else "gloo")
    return dist.new_group(backend="gloo")
