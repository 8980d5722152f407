"""Verify latency of the target under tensor parallelism, next to the HBM roofline.

For each TP degree in `--tp`, that many processes (spawned here, one GPU each, NCCL; or the ones torchrun
started) build the `--preset` model with random weights (bf16 on CUDA, fp32 on CPU), shard it with
tether.server.tp.apply_tp and time `model.verify` of k new tokens (a causal chain) against a KV cache already
holding `ctx` committed tokens, for every batch B: median of `--iters` after `--warmup`, CUDA events on rank 0.
Roofline: the bytes one rank must read per forward (its weights, less an untied embedding of which a lookup
reads a few rows, plus its KV heads' committed K/V) over the device copy bandwidth measured in the same run
(a large device-to-device copy; bytes read + written over time). fraction = roofline / measured.
Two modes (`--mode`, both by default):
- `step`: what the server runs. Each rank's shard fused after sharding (tether.server.fuse: rank 0 adds the
  residual inside its GEMMs, one all-reduce per sublayer), B sessions of `ctx` tokens in a paged pool, one step =
  StepRunner.forward of B chains of k tokens on the triton attention backend, replayed from a CUDA graph that
  holds the NCCL all-reduces (eager on the CPU), device time between CUDA events.
- `eager`: `model.verify` of the unfused shard over a contiguous cache (`--attn`), launched op by op. It is
  host-bound on an H200 (an 8B verify launches ~1.7k kernels), so its low fraction measures launch overhead.
Prints a table, then one JSON line.

    python bench/tp.py --tp 1 2                                 # llama3-8b, bf16, one GPU per rank
    torchrun --nproc-per-node 2 bench/tp.py                     # the launcher's TP degree only
    TRITON_INTERPRET=1 python bench/tp.py --preset tiny --device cpu --tp 1 2   # smoke test on CPU (gloo)
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
import time

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table

from tether.server.fuse import fuse
from tether.server.kv_pool import KVPool
from tether.server.model_loading import attention_backend
from tether.server.rounds import step_batch
from tether.server.tp import apply_tp, init_distributed, spawn, under_torchrun
from tether.server.verifier import SequenceVerifier
from tether.shared.config import preset
from tether.shared.model import Transformer
from tether.shared.speculative import DraftTree


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def timed_ms(fn, warmup: int, iters: int, cuda: bool) -> list[float]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()  # one forward at a time: latency, not pipelined throughput
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes per second a device-to-device copy moves, counting the read and the write."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = statistics.median(timed_ms(lambda: dst.copy_(src), 2, 10, device.type == "cuda"))
    return 2 * nbytes / (ms / 1e3)


def weight_bytes(model: Transformer) -> int:
    """Bytes of this rank's weights one forward reads (an untied embedding table is only looked up)."""
    lookup_only = model.embed_tokens.weight if model.lm_head is not None else None
    return sum(p.numel() * p.element_size() for p in model.parameters() if p is not lookup_only)


@torch.inference_mode()
def measure(rank: int, world: int, args: argparse.Namespace) -> dict:
    """One rank's part: build, shard, time every (batch, ctx, k). Every rank makes the same calls."""
    cuda = args.device == "cuda"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    cfg = preset(args.preset)
    cfg = dataclasses.replace(cfg, max_seq_len=max(cfg.max_seq_len, max(args.ctx) + max(args.k)))
    torch.manual_seed(0)
    with torch.device(device), default_dtype(dtype):  # build in place: a fp32 8B on CPU per rank is 32 GB
        model = Transformer(cfg, backend=args.attn).eval()
    apply_tp(model, rank, world)
    if cuda:
        torch.cuda.empty_cache()
    bw = copy_bandwidth(device, args.copy_mib << 20)
    wbytes = weight_bytes(model)
    rows = []

    def row(mode: str, batch: int, ctx: int, k: int, times: list[float], kv_bytes: int) -> None:
        ms = statistics.median(times)
        roof = (wbytes + kv_bytes) / bw * 1e3
        rows.append(dict(tp=world, mode=mode, batch=batch, ctx=ctx, k=k, ms=ms, min_ms=min(times), roofline_ms=roof,
                         fraction=roof / ms, weights_gb=wbytes / 1e9, kv_gb=kv_bytes / 1e9,
                         tokens_per_s=batch * k / ms * 1e3))  # fmt: skip

    if "eager" in args.mode:
        eager_rows(model, args, device, row)
    if "step" in args.mode:
        model.backend = attention_backend(str(device), "triton")
        step_rows(fuse(model), args, device, row)
    return {"copy_gb_s": bw / 1e9, "rows": rows}


def eager_rows(model: Transformer, args: argparse.Namespace, device: torch.device, row) -> None:
    cuda, c = device.type == "cuda", model.cfg
    for batch in args.batch:
        for ctx in args.ctx:
            cache = model.new_cache(batch, ctx + max(args.k))
            cache.k.normal_()
            cache.v.normal_()
            cache.advance(ctx)
            kv_bytes = 2 * c.n_layers * batch * ctx * c.n_kv_heads * c.head_dim * cache.k.element_size()
            for k in args.k:
                ids = torch.randint(0, c.vocab_size, (batch, k), device=device)
                # verify writes its rows as pending and never commits, so every call sees the same cache
                times = timed_ms(lambda ids=ids, cache=cache: model.verify(ids, cache), args.warmup, args.iters, cuda)
                row("eager", batch, ctx, k, times, kv_bytes)
            del cache
            if cuda:
                torch.cuda.empty_cache()


def step_rows(model: Transformer, args: argparse.Namespace, device: torch.device, row) -> None:
    """Time the server's step (see the module docstring) on this rank; every rank replays the same graphs."""
    cuda, c = device.type == "cuda", model.cfg
    dtype = model.embed_tokens.weight.dtype
    g = torch.Generator().manual_seed(1)
    for batch in args.batch:
        for ctx in args.ctx:
            for k in args.k:
                room = ctx + k + 16
                pool = KVPool(c, batch * (-(-room // 16) + 1), 16, device=device, dtype=dtype)
                pool.k.normal_()
                pool.v.normal_()
                vers = [SequenceVerifier(model, None, capacity=room, pool=pool) for _ in range(batch)]
                for v in vers:
                    v.cache.reserve(ctx)
                    v.cache.advance(ctx)
                trees = [DraftTree.chain(int(torch.randint(c.vocab_size, (1,), generator=g)),
                                         torch.randint(c.vocab_size, (k - 1,), generator=g).tolist())
                         for _ in vers]  # fmt: skip
                step = step_batch([v.cache for v in vers], trees)
                runner = pool.runner_for(model)
                with runner.lock:  # the rows' pending K/V are rewritten each time and never committed
                    times = timed_ms(lambda r=runner, s=step: r.forward(s, states=False), args.warmup, args.iters, cuda)
                row(
                    "step",
                    batch,
                    ctx,
                    k,
                    times,
                    2 * c.n_layers * batch * ctx * c.n_kv_heads * c.head_dim * dtype.itemsize,
                )
                runner.close()
                for v in vers:
                    v.release()
                del pool, vers, runner
                if cuda:
                    torch.cuda.empty_cache()


def report(args: argparse.Namespace, results: dict[int, dict]) -> dict:
    base = {(r["mode"], r["batch"], r["ctx"], r["k"]): r["ms"] for r in results.get(1, {"rows": []})["rows"]}
    table = Table(title=f"verify latency under TP: {args.preset}, {args.device}, attention {args.attn}")
    for col in ("TP", "mode", "B", "ctx", "k", "ms", "min ms", "roofline ms", "fraction", "speedup", "weights GB/rank",
                "KV GB/rank", "tok/s"):  # fmt: skip
        table.add_column(col, justify="right")
    rows = []
    for world, res in results.items():
        for r in res["rows"]:
            one = base.get((r["mode"], r["batch"], r["ctx"], r["k"]))
            r["speedup_vs_tp1"] = one / r["ms"] if one else None
            rows.append(r)
            table.add_row(str(world), r["mode"], str(r["batch"]), str(r["ctx"]), str(r["k"]), f"{r['ms']:.3f}",
                          f"{r['min_ms']:.3f}", f"{r['roofline_ms']:.3f}", f"{r['fraction']:.2f}",
                          f"{r['speedup_vs_tp1']:.2f}" if one else "-", f"{r['weights_gb']:.3f}",
                          f"{r['kv_gb']:.3f}", f"{r['tokens_per_s']:.0f}")  # fmt: skip
    Console(width=160).print(table)
    for world, res in results.items():
        print(f"TP={world}: measured copy bandwidth {res['copy_gb_s']:.0f} GB/s (read + write)")
    result = {
        "bench": "tp",
        "preset": args.preset,
        "device": args.device,
        "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
        "torch": torch.__version__,
        "attention": args.attn,
        "copy_gb_s": {str(w): res["copy_gb_s"] for w, res in results.items()},
        "rows": rows,
    }
    print(json.dumps(result))
    return result


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="llama3-8b")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2], help="TP degrees to run (ignored under torchrun)")
    ap.add_argument("--k", type=int, nargs="+", default=[1, 8, 32], help="new tokens per verify")
    ap.add_argument("--ctx", type=int, nargs="+", help="committed KV cache tokens (default 1024 8192; CPU 128 512)")
    ap.add_argument("--batch", type=int, nargs="+", help="sequences per verify (default 1 8; CPU 1 4)")
    ap.add_argument("--mode", nargs="+", choices=["step", "eager"], default=["step", "eager"],
                    help="the server's fused step (graphs on CUDA) and/or the eager unfused verify")  # fmt: skip
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--attn", help="attention backend (default sdpa on CUDA, reference on CPU)")
    ap.add_argument("--copy-mib", type=int, help="bytes for the bandwidth copy (default 4096 MiB; CPU 256)")
    ap.add_argument("--timeout", type=float, default=540, help="seconds per TP degree before giving up")
    args = ap.parse_args(argv)
    cuda = args.device == "cuda"
    args.ctx = args.ctx or ([1024, 8192] if cuda else [128, 512])
    args.batch = args.batch or ([1, 8] if cuda else [1, 4])
    args.attn = args.attn or ("sdpa" if cuda else "reference")
    args.copy_mib = args.copy_mib or (4096 if cuda else 256)
    backend = "nccl" if cuda else "gloo"

    if under_torchrun():
        rank, world = init_distributed(backend)
        res = measure(rank, world, args)
        if dist.is_initialized():
            dist.destroy_process_group()
        return report(args, {world: res}) if rank == 0 else {}
    results = {}
    for world in args.tp:
        if cuda and world > torch.cuda.device_count():
            print(f"TP={world}: skipped, {torch.cuda.device_count()} GPUs here")
            continue
        results[world] = spawn(measure, world, args, backend=backend, timeout=args.timeout)[0]
    return report(args, results)


if __name__ == "__main__":
    main()
