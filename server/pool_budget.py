"""How many bytes the paged KV pool gets: `--kv-pool-mb` (0 = auto, a share of the device's free memory) and
`--kv-pool-share`, decided once per engine (and per tensor-parallel rank) after the models are loaded.

Why: a fixed default (256 MB) is a few hundred sessions on any GPU, so on a 139 GB H200 sessions evicted each other
while the memory sat unused (issue #44); vLLM sizes its KV cache from the memory left once the weights are in, and so
does auto here, but from the FREE memory after loading (what this process can still take), not from the total.

Contract: `resolve_kv_pool(kv_pool_mb, share, device, engines=, tp=, mem_info=)` is a pure function of its inputs
(the caller reads torch.cuda.mem_get_info and passes the numbers), so it is tested without a GPU. It returns a
`PoolBudget`: the bytes of this engine's pool (this rank's, with --tp) and one line for the start log. It raises
ValueError, in words a user can act on, for a flag out of range, an explicit size over the free memory, or free memory
too small for an auto pool worth serving from.
- kv_pool_mb > 0: that many MB, as before. It is the value a ServeConfig holds in each engine: under `--engines E`
  tether.server.engines.engine_share has already divided it by E, so it is not divided again here.
- kv_pool_mb == 0 on CUDA: `share` of the free memory (with --tp the least of the ranks', since every rank's pool
  mirrors rank 0's blocks), divided by E under --engines E, in whole MB.
- kv_pool_mb == 0 elsewhere (CPU): CPU_DEFAULT_MB (256, the old default) divided by E: host memory is not the bound.

Under --engines E each engine process reads its free memory after its own models load, while the others may still be
loading: one that reads before another's weights or pool exist sees more than is left. The pools then add up to at
most `share` of what the first reader saw, and what remains, (1 - share) of it less the other engines' weights, is
what the step graphs and activations get; at the default share that stays positive for any E copies whose weights
take less than half the free memory.

    budget = resolve_kv_pool(cfg.kv_pool_mb, cfg.kv_pool_share, "cuda:0", engines=cfg.engines,
                             mem_info=torch.cuda.mem_get_info(0))
    log.info(budget.note)   # KV pool 61,440 MB: 50% of 122,880 MB free on cuda:0 (auto; --kv-pool-mb sets it)

Tests: tests/server/test_pool_budget.py (`python -m pytest -q tests/server/test_pool_budget.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

MB = 1 << 20
CPU_DEFAULT_MB = 256  # auto off CUDA: the old default; host memory is not what bounds sessions there
# Auto on CUDA takes half of the memory free once the models are loaded. vLLM's gpu_memory_utilization (0.9 of the
# total) is applied after a profiling run that measured the activations' peak; nothing here measures it, and the rest
# must still hold what is allocated after the pool: every step graph serve captures for each batch bucket and
# block-table width (and the drafter's graphs beside them), prefill activations of --prefill-chunk positions, the
# allocator's fragmentation, NCCL's buffers under --tp, and the other engines' weights when --engines read free memory
# before those loaded (see the module docstring). Half is still plenty: 61 GB on an H200 holds 30 M positions of the
# default model (2 KiB each) or 470 K of an 8B target (128 KiB): 1,024 sessions of 450 tokens.
DEFAULT_SHARE = 0.5
MIN_AUTO_MB = 64  # an auto pool smaller than this means the GPU is all but full (another process?): refuse to start

MemInfo = tuple[int, int]  # (free, total) bytes, as torch.cuda.mem_get_info returns them


@dataclass(frozen=True)
class PoolBudget:
    bytes: int  # this engine's KV pool (with --tp, each rank's), a whole number of MB
    note: str  # one line for the start log: the size and where it came from
    auto: bool  # decided by auto (--kv-pool-mb 0), not given


def resolve_kv_pool(
    kv_pool_mb: int,
    share: float = DEFAULT_SHARE,
    device: str = "cpu",
    *,
    engines: int = 1,
    tp: int = 1,
    mem_info: MemInfo | Sequence[MemInfo] | None = None,
) -> PoolBudget:
    """The KV pool's bytes and start-log line (see the module docstring). `mem_info`: this device's (free, total)
    read after the models loaded, or one pair per tensor-parallel rank; needed for auto on CUDA, checked against an
    explicit size when given."""
    if kv_pool_mb < 0:
        raise ValueError(
            f"--kv-pool-mb is 0 (auto: a share of the free device memory) or a size in MB, got {kv_pool_mb}"
        )
    if not 0 < share < 1:
        raise ValueError(
            f"--kv-pool-share is the part of the free device memory an auto KV pool takes, above 0 and "
            f"below 1 (default {DEFAULT_SHARE}), got {share}"
        )
    if engines < 1 or tp < 1:
        raise ValueError(f"engines and tp are at least 1, got {engines} and {tp}")
    ranks = _ranks(mem_info, tp)
    free = min(f for f, _ in ranks) if ranks else None
    where = f"{device}" if tp == 1 else f"{device} (the least of {tp} ranks)"
    per_rank = " per rank" if tp > 1 else ""
    if kv_pool_mb > 0:
        if free is not None and kv_pool_mb * MB > free:
            raise ValueError(
                f"--kv-pool-mb {kv_pool_mb} asks for more than the {free // MB:,} MB free on {where} "
                f"after loading the models: give a smaller size, or 0 for auto ({share:.0%} of the "
                "free memory)"
            )
        split = f": this engine's share of --kv-pool-mb over {engines} engines" if engines > 1 else " (--kv-pool-mb)"
        return PoolBudget(kv_pool_mb * MB, f"KV pool {kv_pool_mb:,} MB{per_rank}{split}", auto=False)
    how = "(auto; --kv-pool-mb sets it)"
    over = f" over {engines} engines" if engines > 1 else ""
    if not device.startswith("cuda"):
        mb = max(1, CPU_DEFAULT_MB // engines)
        return PoolBudget(
            mb * MB, f"KV pool {mb:,} MB{per_rank}: the {CPU_DEFAULT_MB} MB default on {device}{over} {how}", auto=True
        )
    if free is None:
        raise ValueError(
            f"an auto KV pool on {device} needs its free memory (torch.cuda.mem_get_info, read after the "
            "models load): pass mem_info"
        )
    mb = int(share * free) // engines // MB
    if mb < MIN_AUTO_MB:
        total = min(t for _, t in ranks)
        raise ValueError(
            f"{device} has {free // MB:,} MB free of {total // MB:,} MB after loading the models: an "
            f"auto KV pool ({share:.0%}{over}) would be {mb} MB, below the {MIN_AUTO_MB} MB it needs. "
            "Free the GPU (another process holds memory? see nvidia-smi), run fewer --engines, or set "
            "--kv-pool-mb to an explicit size"
        )
    note = f"KV pool {mb:,} MB{per_rank}: {share:.0%} of {free // MB:,} MB free on {where}{over} {how}"
    return PoolBudget(mb * MB, note, auto=True)


def _ranks(mem_info: MemInfo | Sequence[MemInfo] | None, tp: int) -> list[MemInfo]:
    """mem_info as one (free, total) pair per rank given: a single pair stands for every rank."""
    if mem_info is None:
        return []
    pairs = [tuple(mem_info)] if isinstance(mem_info[0], int) else [tuple(p) for p in mem_info]
    if len(pairs) not in (1, tp) or any(len(p) != 2 for p in pairs):
        raise ValueError(f"mem_info is one (free, total) pair, or one per rank ({tp}), got {mem_info!r}")
    return pairs
