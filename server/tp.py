"""Tensor parallelism for the target model: a transform applied to a finished model (gpt-fast's tp.py style).

Purpose: split one target over W processes (one GPU each; gloo on CPU for tests) so each rank reads 1/W of the
block weights and of the KV cache per forward, which is what bounds verify latency at small batch.

Contract:
- `apply_tp(model, rank, world_size)` shards a weights-loaded Transformer in place, Megatron style:
  q_proj rows by query head and k_proj/v_proj rows by KV head (rank r owns KV heads [r*Hkv/W, (r+1)*Hkv/W)
  and exactly the query heads of their GQA groups), o_proj columns, then one all-reduce (sum) of its output;
  gate/up rows, down columns, one all-reduce. MoDA's ffn_kv_proj is sharded by the same KV heads, so depth
  K/V are sharded like the KV cache. A row-parallel bias is added once, after the sum. Embeddings, norms and
  the LM head stay replicated, so logits and hidden states come out whole on every rank.
  Afterwards `model.cfg` (and each block's cfg) is the rank's local config (n_heads/W, n_kv_heads/W, ffn_dim/W):
  `model.new_cache()` holds this rank's KV heads and ForwardOutput.k/v are [L, B, T, Hkv/W, D].
  `model.global_cfg` keeps the full config; `model.tp == (rank, world_size)`.
- Every rank must make the same calls in the same order (collectives); inference only (no autograd through
  the all-reduces).
- A drafter's server part (MoA's LSA) needs every KV head: wrap it as `GatherKV(drafter)`, which hands
  `server_delta` states whose K/V went through `gather_heads`. Build or load the drafter against the
  unsharded model (before apply_tp): its shapes come from the global config.
- Only this module reads RANK / WORLD_SIZE / LOCAL_RANK. NVLink multicast (NVLS, symmetric memory) is switched
  off before any NCCL init: on a shared host it can take the GPUs out of service.

How to run: under torchrun, each process calls `init_distributed()` then `apply_tp(model, rank, world)`;
or from one process, `spawn(fn, world_size, *args)` runs `fn(rank, world_size, *args)` on N local processes
and returns their results. See bench/tp.py and tests/server/test_tp.py.

    rank, world = init_distributed()
    model = apply_tp(Transformer.from_pretrained(path, device="cuda"), rank, world)
    out = model.verify(ids, model.new_cache())   # same ids on every rank; same logits on every rank
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor, nn
from torch.multiprocessing.spawn import ProcessException

from tether.shared.contracts import ServerDrafter
from tether.shared.drafter import DraftDelta, DrafterConfig, TargetStates
from tether.shared.model import Transformer

__all__ = ["apply_tp", "init_distributed", "spawn", "all_reduce", "gather_heads", "gather_states", "GatherKV"]

# NVLink SHARP / multicast objects can wedge a shared host's GPUs; keep every layer that could use them off.
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def disable_multicast() -> None:
    os.environ.update(NO_MULTICAST)


def under_torchrun() -> bool:
    """True when a launcher (torchrun) set WORLD_SIZE for this process."""
    return "WORLD_SIZE" in os.environ


def init_distributed(backend: str | None = None) -> tuple[int, int]:
    """Join the process group the torchrun way (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT) and return
    (rank, world_size). Backend: NCCL when CUDA is present, else gloo; with NCCL this process's device becomes
    cuda:LOCAL_RANK. A world of one creates no group (nothing to communicate)."""
    disable_multicast()
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", str(rank)))
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(local)
    if world > 1 and not dist.is_initialized():
        device_id = torch.device("cuda", local) if backend == "nccl" else None
        dist.init_process_group(backend, rank=rank, world_size=world, device_id=device_id)
    return rank, world


# ---- collectives -------------------------------------------------------------------------------------------


def all_reduce(t: Tensor, group=None) -> Tensor:
    """Sum of `t` over the group. In place: callers pass a fresh activation nobody else holds, and the eager
    c10d op (unlike _functional_collectives' wrapper tensors) behaves the same under inference_mode,
    no_grad, gloo and NCCL."""
    dist.all_reduce(t, group=group)
    return t


def gather_heads(t: Tensor, dim: int = -2, group=None) -> Tensor:
    """Concatenate every rank's heads along `dim` in rank order: sharded [.., Hkv/W, D] -> whole [.., Hkv, D].
    Returns `t` itself when no process group is running."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return t
    t = t.contiguous()
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t, group=group)
    return torch.cat(parts, dim)


def gather_states(states: TargetStates, group=None) -> TargetStates:
    """A TP target's states with every KV head: k/v [L, n, Hkv/W, D] -> [L, n, Hkv, D]; hidden is whole already."""
    return TargetStates(gather_heads(states.k, -2, group), gather_heads(states.v, -2, group), states.hidden)


class GatherKV:
    """A drafter whose server part sees every KV head of a TP target's states; everything else passes through.

    The verifier calls `drafter.server_delta(target_states(out), ...)` with this rank's K/V heads only, while
    MoA's LSA (and the TLI K/V it ships) are defined over all of them. Every rank must call server_delta
    (the gather is a collective), which the verifier does when every rank runs the same rounds."""

    def __init__(self, drafter: ServerDrafter, group=None):
        self.drafter = drafter
        self.group = group

    @property
    def dcfg(self) -> DrafterConfig:
        return self.drafter.dcfg

    def server_delta(self, states: TargetStates, start: int, tokens: list[int]) -> DraftDelta:
        return self.drafter.server_delta(gather_states(states, self.group), start, tokens)

    def __getattr__(self, name: str):
        return getattr(self.drafter, name)


# ---- sharding ----------------------------------------------------------------------------------------------


def _split(t: Tensor, dim: int, rank: int, world: int, groups: int = 1) -> Tensor:
    """Rank's contiguous 1/world slice of each of `groups` equal blocks along `dim` (a copy, so the full
    tensor's storage can be freed)."""
    t = t.unflatten(dim, (groups, t.shape[dim] // groups))
    n = t.shape[dim + 1] // world
    return t.narrow(dim + 1, rank * n, n).flatten(dim, dim + 1).clone()


def _param(t: Tensor, like: nn.Parameter) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=like.requires_grad)


def _column_parallel(lin: nn.Linear, rank: int, world: int, groups: int = 1) -> None:
    """Split output features: each rank computes its own heads / hidden units, no communication."""
    lin.weight = _param(_split(lin.weight.data, 0, rank, world, groups), lin.weight)  # [out/W, in]
    if lin.bias is not None:
        lin.bias = _param(_split(lin.bias.data, 0, rank, world, groups), lin.bias)
    lin.out_features = lin.weight.shape[0]


def _row_parallel(lin: nn.Linear, rank: int, world: int, group) -> None:
    """Split input features: each rank's output is a partial sum, completed by one all-reduce."""
    lin.weight = _param(_split(lin.weight.data, 1, rank, world), lin.weight)  # [out, in/W]
    lin.in_features = lin.weight.shape[1]
    # Summing W biased partials would add the bias W times: take it out of the matmul, add it after the sum.
    bias = None if lin.bias is None else lin.bias.data
    lin.bias = None
    lin.register_buffer("tp_bias", bias)

    def reduce(module: nn.Module, args: Any, out: Tensor) -> Tensor:
        out = all_reduce(out, group)
        return out if module.tp_bias is None else out + module.tp_bias

    lin.register_forward_hook(reduce)


def apply_tp(model: Transformer, rank: int, world_size: int, group=None) -> Transformer:
    """Shard a finished model in place for `rank` of `world_size` (see the module docstring) and return it."""
    if model.tp[1] > 1:
        raise ValueError(f"model is already tensor-parallel: tp={model.tp}")
    if type(model) is not Transformer:
        # Fusing concatenates q/k/v and gate/up into buffers the shards here would not slice.
        raise ValueError(f"shard the model before transforming it further (it is a {type(model).__name__})")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    cfg = model.cfg
    for name in ("n_heads", "n_kv_heads", "ffn_dim"):
        if getattr(cfg, name) % world_size:
            raise ValueError(
                f"{name}={getattr(cfg, name)} is not divisible by world_size={world_size}; tensor parallelism "
                f"splits whole KV heads (and their query heads) and the FFN width evenly across ranks"
            )
    model.global_cfg = cfg
    model.tp = (rank, world_size)
    model.tp_group = group
    if world_size == 1:
        return model
    W = world_size
    local = dataclasses.replace(cfg, n_heads=cfg.n_heads // W, n_kv_heads=cfg.n_kv_heads // W, ffn_dim=cfg.ffn_dim // W)
    model.cfg = local
    for block in model.layers:
        block.cfg = block.attn.cfg = local
        # Heads are contiguous [H, D] rows and query head h belongs to KV head h // G, so contiguous blocks of
        # H/W query heads and Hkv/W KV heads keep every GQA group on one rank.
        for lin in (block.attn.q_proj, block.attn.k_proj, block.attn.v_proj):
            _column_parallel(lin, rank, world_size)
        _row_parallel(block.attn.o_proj, rank, world_size, group)
        _column_parallel(block.ffn.gate_proj, rank, world_size)
        _column_parallel(block.ffn.up_proj, rank, world_size)
        _row_parallel(block.ffn.down_proj, rank, world_size, group)
        if local.moda_ffn_kv:  # the block has an ffn_kv_proj exactly then (tether.shared.model.Block)
            # Output rows are [2 (K, V), Hkv, D]: take this rank's KV heads from each half.
            _column_parallel(block.ffn_kv_proj, rank, world_size, groups=2)
    return model


# ---- local launch ------------------------------------------------------------------------------------------


def free_port() -> int:
    """A free TCP port on 127.0.0.1 for the rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(local_rank: int, fn: Callable, world_size: int, port: int, backend: str | None, queue, args) -> None:
    os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world_size))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # N processes on one host share its cores; oversubscribed intra-op threads make gloo runs crawl.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    rank = local_rank
    try:
        rank, world = init_distributed(backend)
        # Plain pickle copies tensor data: torch's queue pickling shares storage that dies with this process.
        queue.put((rank, True, pickle.dumps(fn(rank, world, *args))))
    except BaseException:
        # Reported in order of failure: the first is the cause, later ones are usually peers losing it.
        queue.put((rank, False, traceback.format_exc()))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(fn: Callable[..., Any], world_size: int, *args, backend: str | None = None, timeout: float | None = None):
    """Run `fn(rank, world_size, *args)` on `world_size` fresh local processes (rendezvous on a free port of
    127.0.0.1) and return their results in rank order. `fn` must be importable (module level) and its results
    picklable. A rank that raises makes this raise RuntimeError with the first failing rank's traceback (the
    other ranks are stopped); running past `timeout` seconds raises TimeoutError."""
    disable_multicast()  # children inherit the environment
    queue = mp.get_context("spawn").SimpleQueue()
    procs = mp.start_processes(
        _worker, args=(fn, world_size, free_port(), backend, queue, args), nprocs=world_size, join=False
    )
    deadline = None if timeout is None else time.monotonic() + timeout
    results: dict[int, Any] = {}
    failures: list[tuple[int, str]] = []

    def drain() -> None:
        # A child blocks in put() until its (possibly large) result is read, so read while waiting.
        while not queue.empty():
            rank, ok, payload = queue.get()
            if ok:
                results[rank] = pickle.loads(payload)
            else:
                failures.append((rank, payload))

    try:
        while True:
            drain()
            try:
                if procs.join(timeout=0.1):
                    break
            except ProcessException as e:
                time.sleep(0.5)  # let the other ranks' reports arrive
                drain()
                if not failures:
                    raise
                rank, tb = failures[0]
                raise RuntimeError(f"rank {rank} of {world_size} failed first:\n{tb}") from e
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"spawn: {world_size} processes still running after {timeout} s")
    finally:
        for p in procs.processes:
            if p.is_alive():
                p.kill()
                p.join()
    drain()
    return [results[r] for r in range(world_size)]
