"""The server's batched verification round with the paged MoDA kernel reading the KV pool in place, against the
gathering path (each row's prefix copied out of the pool, the reference attention on a [B, Tq, Lmax + Tq] mask).

A MoDA target of `--preset` shapes (default: Llama-3-8B shapes with MoDA and FFN depth K/V on, random weights,
bf16 on CUDA) and a paged KVPool (block size 16) holding B sessions of `ctx` committed tokens each (random K/V
written straight into the pool: the bench times verification, not prefill). Each round is one
`tether.server.batcher.verify_batch` over B chains of k tokens, as the RoundBatcher runs it: the forward, the
verdicts and the commit. Reported per (B, ctx, mode): median ms per round and verified tokens/s. Modes:
- in place: the "triton" backend, PagedKernelView (tether.kernels.moda.verify through block tables);
- gather: the "reference" backend, PagedBatchView (what the server ran before the paged kernel).
Eager PyTorch (no CUDA graph). Prints a table, then one JSON line.

    python bench/verify.py                                          # llama3-8b shapes + MoDA, B 1 8, ctx 4K 32K
    TRITON_INTERPRET=1 python bench/verify.py --preset tiny --device cpu --batch 2 --ctx 40 --rounds 2   # smoke
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import torch
from rich.console import Console
from rich.table import Table

from tether.kernels.moda import moda_backend
from tether.server.kv_pool import KVPool
from tether.server.rounds import verify_batch
from tether.server.verifier import SequenceVerifier
from tether.shared.attention import register_backend
from tether.shared.config import preset
from tether.shared.model import Transformer
from tether.shared.speculative import DraftTree

MODES = {"in place": "triton", "gather": "reference"}


def build(name: str, device: str, max_len: int) -> Transformer:
    cfg = dataclasses.replace(preset(name), moda=True, moda_ffn_kv=True, max_seq_len=max_len)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    with torch.device(device):
        model = Transformer(cfg).to(dtype)
    return model.eval()


def sessions(model: Transformer, pool: KVPool, batch: int, ctx: int, capacity: int) -> list[SequenceVerifier]:
    """B verifiers whose caches already hold `ctx` committed random positions."""
    vers = []
    for _ in range(batch):
        ver = SequenceVerifier(model, None, capacity=capacity, pool=pool)
        ver.cache.reserve(ctx)
        ver.cache.advance(ctx)
        vers.append(ver)
    g = torch.Generator(device=pool.device).manual_seed(0)
    pool.k.normal_(generator=g)
    pool.v.normal_(generator=g)
    return vers


def time_rounds(
    model: Transformer, vers: list[SequenceVerifier], ctx: int, k: int, rounds: int, warmup: int
) -> list[float]:
    cuda = model.device.type == "cuda"
    g = torch.Generator().manual_seed(1)
    times = []
    for r in range(warmup + rounds):
        items = [(v, DraftTree.chain(int(torch.randint(100, (1,), generator=g)), torch.randint(100, (k - 1,),
                                                                                               generator=g).tolist()))
                 for v in vers]  # fmt: skip
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        results = verify_batch(model, items)
        if cuda:
            torch.cuda.synchronize()
        if r >= warmup:
            times.append((time.perf_counter() - t0) * 1e3)
        bad = [x for x in results if isinstance(x, Exception)]
        if bad:
            raise bad[0]
        for v in vers:  # every round sees the same context length
            v.cache.truncate(ctx)
    return times


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="llama3-8b")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--ctx", type=int, nargs="+", default=[4096, 32768])
    ap.add_argument("--k", type=int, default=8, help="tokens per chain (root + k - 1 drafts)")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    args = ap.parse_args()
    if "in place" in args.modes:
        register_backend("triton", moda_backend)  # also on the CPU under TRITON_INTERPRET=1 (a smoke run)
    max_len = max(args.ctx) + args.k + 64
    model = build(args.preset, args.device, max_len)
    rows = []
    for B in args.batch:
        for ctx in args.ctx:
            blocks = B * (-(-(ctx + args.k + 16) // 16) + 1)
            pool = KVPool(model.cfg, blocks, 16, device=args.device, dtype=model.embed_tokens.weight.dtype)
            vers = sessions(model, pool, B, ctx, max_len)
            for mode in args.modes:
                model.backend = MODES[mode]
                ms = time_rounds(model, vers, ctx, args.k, args.rounds, args.warmup)
                med = statistics.median(ms)
                rows.append({"B": B, "ctx": ctx, "k": args.k, "mode": mode, "ms": med,
                             "tokens_per_s": B * args.k / med * 1e3})  # fmt: skip
            del pool, vers
            if args.device == "cuda":
                torch.cuda.empty_cache()
    console = Console()
    dev = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    t = Table(title=f"batched verify round, {args.preset} + MoDA, k={args.k}, {dev}")
    for c in ("B", "ctx", "mode", "ms / round", "scored tokens/s", "x gather"):
        t.add_column(c, justify="right")
    for r in rows:
        base = next((x["ms"] for x in rows if (x["B"], x["ctx"], x["mode"]) == (r["B"], r["ctx"], "gather")), None)
        r["speedup"] = base / r["ms"] if base else None
        t.add_row(str(r["B"]), str(r["ctx"]), r["mode"], f"{r['ms']:.2f}", f"{r['tokens_per_s']:.0f}",
                  f"{r['speedup']:.2f}" if r["speedup"] else "")  # fmt: skip
    console.print(t)
    record = {"bench": "verify", "device": dev, "preset": args.preset, "torch": torch.__version__, "rows": rows}
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
