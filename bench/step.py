"""The GPU step: verify rounds of a large target next to the HBM roofline, and the default target's decode rate.

Two parts, one run (both by default):
- `verify`: a `--preset` target (default Llama-3-8B shapes, random bf16 weights; `--moda` adds depth K/V) on the
  "triton" backend and fused (tether.server.fuse; `--unfused` to compare), B sessions of `ctx` committed tokens
  in a paged pool (random K/V written straight in), one verify round = tether.server.rounds.verify_batch of B
  chains of k tokens, as a server runs it (forward, verdicts, commit; the cache truncated back after each). Timed
  per round on the host clock around a synchronised call (what a client waits for), median of `--rounds`, with
  step graphs on (CUDA graphs) and off (eager).
  Roofline: the weight bytes one forward reads (an untied embedding table is only looked up) plus the rows' K/V,
  over the device-to-device copy bandwidth measured in the same run (bytes read + written). x roofline =
  measured / roofline.
  The step alone (the forward: staging and replay, no verdicts or commit) is timed between CUDA events too.
- `decode`: the default target (deploy/models/target, bf16) decoding `--tokens` tokens greedily after a short
  prompt: in-process plain decoding (tether.server.engine.SpeculativeEngine without a drafter), the in-process
  speculative engine with the default drafter (k=5), and the Generate RPC of a real gRPC server on loopback, one
  stream, counted from the first token to the last.

Prints a table per part, then one JSON line.

    python bench/step.py                                         # H200: both parts
    python bench/step.py --parts verify --batch 8 --ctx 8192     # one verify shape
    TRITON_INTERPRET=1 python bench/step.py --device cpu --preset tiny --batch 1 --ctx 40 --rounds 2 --tokens 8
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

from tether.server.fuse import fuse
from tether.server.kv_pool import KVPool
from tether.server.model_loading import attention_backend, default_model_dir, load
from tether.server.rounds import step_batch, verify_batch
from tether.server.step import StepConfig
from tether.server.verifier import SequenceVerifier
from tether.shared.config import preset
from tether.shared.model import Transformer
from tether.shared.speculative import DraftTree


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(device: torch.device, nbytes: int = 2 << 30) -> float:
    """Bytes per second of a device-to-device copy, read + written (median of 10 after 2 warm-ups)."""
    if device.type != "cuda":
        return float("nan")
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for i in range(12):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        if i >= 2:
            times.append(a.elapsed_time(b) / 1e3)
    return 2 * nbytes / statistics.median(times)


def weight_bytes(model: Transformer) -> int:
    lookup_only = model.embed_tokens.weight if model.lm_head is not None else None
    return sum(p.numel() * p.element_size() for p in model.parameters() if p is not lookup_only)


def verify_rounds(args: argparse.Namespace, device: torch.device) -> dict:
    cfg = preset(args.preset)
    cfg = dataclasses.replace(cfg, max_seq_len=max(args.ctx) + args.k + 64,
                              **({"moda": True, "moda_ffn_kv": True} if args.moda else {}))  # fmt: skip
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    with torch.device(device):
        model = Transformer(cfg).to(dtype).eval()
    model.backend = attention_backend(str(device), "triton")
    if not args.unfused:
        fuse(model)
    bw = copy_bandwidth(device)
    wbytes = weight_bytes(model)
    rows = []
    for B in args.batch:
        for ctx in args.ctx:
            kv_bytes = 2 * cfg.n_layers * B * ctx * cfg.n_kv_heads * cfg.head_dim * torch.finfo(dtype).bits // 8
            roof_ms = (wbytes + kv_bytes) / bw * 1e3
            for graphs in (True, False):
                blocks = B * (-(-(ctx + args.k + 16) // 16) + 1)
                pool = KVPool(cfg, blocks, 16, device=device, dtype=dtype, step_config=StepConfig(graphs=graphs))
                vers = []
                for _ in range(B):
                    v = SequenceVerifier(model, None, capacity=ctx + args.k + 16, pool=pool)
                    v.cache.reserve(ctx)
                    v.cache.advance(ctx)
                    vers.append(v)
                pool.k.normal_()
                pool.v.normal_()
                g = torch.Generator().manual_seed(1)
                times = []
                for r in range(args.warmup + args.rounds):
                    items = [(v, DraftTree.chain(int(torch.randint(cfg.vocab_size, (1,), generator=g)),
                                                 torch.randint(cfg.vocab_size, (args.k - 1,), generator=g).tolist()))
                             for v in vers]  # fmt: skip
                    sync(device)
                    t0 = time.perf_counter()
                    results = verify_batch(model, items)
                    sync(device)
                    if r >= args.warmup:
                        times.append((time.perf_counter() - t0) * 1e3)
                    bad = [x for x in results if isinstance(x, Exception)]
                    if bad:
                        raise bad[0]
                    for v in vers:
                        v.cache.truncate(ctx)
                ms = statistics.median(times)
                step = step_ms(model, vers, items, device, args.rounds)
                rows.append({"B": B, "ctx": ctx, "k": args.k, "graphs": graphs, "ms": ms, "min_ms": min(times),
                             "step_ms": step, "roofline_ms": roof_ms, "x_roofline": ms / roof_ms,
                             "step_x_roofline": step / roof_ms, "tokens_per_s": B * args.k / ms * 1e3})  # fmt: skip
                if args.profile and graphs and (B, ctx) == (args.batch[0], args.ctx[0]):

                    def one_round(model=model, items=items, vers=vers, ctx=ctx):
                        verify_batch(model, items)
                        for v in vers:
                            v.cache.truncate(ctx)

                    profile(one_round, f"verify round B={B} ctx={ctx}", device)
                for v in vers:
                    v.release()
                del pool, vers
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    del model
    return {"preset": args.preset, "moda": args.moda, "copy_gb_s": bw / 1e9, "weights_gb": wbytes / 1e9, "rows": rows}


def step_ms(model: Transformer, vers: list[SequenceVerifier], items, device: torch.device, iters: int) -> float:
    """The forward alone (staging and replay or eager launch), device time between events: no verdicts, no commit.
    The rows' pending K/V are rewritten each time and never committed."""
    if device.type != "cuda":
        return float("nan")
    runner = vers[0].cache.pool.runner_for(model)
    batch = step_batch([v.cache for v in vers], [t for _, t in items])
    times = []
    with runner.lock:
        for i in range(iters + 3):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            runner.forward(batch, states=False)
            b.record()
            b.synchronize()
            if i >= 3:
                times.append(a.elapsed_time(b))
    return statistics.median(times)


def profile(fn, title: str, device: torch.device, iters: int = 20) -> None:
    """torch.profiler over `iters` calls: the top ops by host time and by device time."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch_profile(activities=acts) as prof:
        for _ in range(iters):
            fn()
        sync(device)
    import cProfile
    import pstats

    host = cProfile.Profile()
    host.enable()
    for _ in range(iters):
        fn()
    sync(device)
    host.disable()
    print(f"== profile: {title}, {iters} calls")
    pstats.Stats(host).sort_stats("tottime").print_stats(22)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
    if device.type == "cuda":
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=15, max_name_column_width=60))


def decode_rates(args: argparse.Namespace, device: torch.device) -> dict:
    from tether.server.engine import SpeculativeEngine
    from tether.shared.checkpoint import fingerprint
    from tether.shared.drafter_loading import load_drafter

    target, tok = load(args.model, str(device))
    drafter = load_drafter(args.drafter, target, target_fingerprint=fingerprint(args.model))
    prompt = tok.encode("def fibonacci(n):\n    ")
    out = {}
    for name, d in (("in-process plain", None), ("in-process speculative k=5", drafter)):
        engine = SpeculativeEngine(target, d, k=5)
        for _ in range(2):  # the first run captures the step graphs
            n = 0
            t0 = time.perf_counter()
            for chunk in engine.generate(prompt, args.tokens):
                n += len(chunk)
            wall = time.perf_counter() - t0
        out[name] = {"tokens": n, "s": wall, "tokens_per_s": n / wall, "tau": engine.stats.tau}
        if args.profile:
            profile(lambda engine=engine: [None for _ in engine.generate(prompt, 50)], f"{name}, 50 tokens", device, 3)
    out["Generate RPC, one stream"] = generate_rpc(args, target, drafter, tok, prompt)
    return out


def generate_rpc(args, target, drafter, tok, prompt: list[int]) -> dict:
    """A real server on loopback; one Generate stream of --tokens tokens, timed from its first token."""
    import grpc

    from tether.server.engine_core import Engine
    from tether.server.rpc_server import make_server
    from tether.server.serve_config import ServiceConfig
    from tether.server.service import TetherService
    from tether.shared.checkpoint import fingerprint
    from tether.v1 import tether_pb2 as pb
    from tether.v1 import tether_pb2_grpc

    fp = fingerprint(args.model)
    config = ServiceConfig(max_new_tokens=args.tokens)
    service = TetherService(Engine(target, drafter, tok, config, model_fingerprint=fp))
    server, port = make_server(service, "127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = tether_pb2_grpc.TetherStub(ch)
            fixed = pb.SamplingParams(ignore_eos=True)  # --tokens tokens, end-of-text or not
            req = pb.OpenSession(prompt=prompt, max_new_tokens=args.tokens, model_fingerprint=fp, sampling=fixed)
            for _ in range(2):  # the first stream captures the step graphs
                n, msgs, t_first = 0, 0, None
                for msg in stub.Generate(req, timeout=120):
                    t_first = t_first or time.perf_counter()
                    n += len(msg.tokens)
                    msgs += 1
                wall = time.perf_counter() - t_first
        return {"tokens": n, "messages": msgs, "s": wall, "tokens_per_s": (n - 1) / wall}
    finally:
        server.stop(grace=1).wait(10)
        service.engine.close()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", nargs="+", default=["verify", "decode"], choices=["verify", "decode"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--preset", default="llama3-8b", help="verify part: model shapes (random weights)")
    ap.add_argument("--moda", action="store_true", help="verify part: MoDA with FFN depth K/V on")
    ap.add_argument("--unfused", action="store_true", help="verify part: without tether.server.fuse's transform")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--ctx", type=int, nargs="+", default=[1024, 8192])
    ap.add_argument("--k", type=int, default=8, help="tokens per chain (root + k - 1 drafts)")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--model", default=str(default_model_dir()), help="decode part: target directory")
    ap.add_argument("--drafter", default=str(default_model_dir("drafter")), help="decode part: drafter directory")
    ap.add_argument("--tokens", type=int, default=1000, help="decode part: tokens per run")
    ap.add_argument("--profile", action="store_true", help="print torch.profiler tables of a round and of decoding")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    torch.set_grad_enabled(False)
    console = Console()
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    record: dict = {"bench": "step", "device": name, "torch": torch.__version__, "fused": not args.unfused}
    if "verify" in args.parts:
        v = record["verify"] = verify_rounds(args, device)
        t = Table(title=f"verify round, {args.preset}{' + MoDA' if args.moda else ''}, k={args.k}, {name}, "
                  f"copy {v['copy_gb_s']:.0f} GB/s")  # fmt: skip
        for c in ("B", "ctx", "graphs", "ms / round", "step ms", "roofline ms", "x roofline (round / step)",
                  "scored tokens/s"):  # fmt: skip
            t.add_column(c, justify="right")
        for r in v["rows"]:
            t.add_row(str(r["B"]), str(r["ctx"]), "on" if r["graphs"] else "off", f"{r['ms']:.2f}",
                      f"{r['step_ms']:.2f}", f"{r['roofline_ms']:.2f}",
                      f"{r['x_roofline']:.2f} / {r['step_x_roofline']:.2f}", f"{r['tokens_per_s']:.0f}")  # fmt: skip
        console.print(t)
    if "decode" in args.parts:
        d = record["decode"] = decode_rates(args, device)
        t = Table(title=f"default target, greedy, {args.tokens} tokens, {name}")
        for c in ("path", "tokens/s", "tokens", "s"):
            t.add_column(c, justify="right")
        for path, r in d.items():
            t.add_row(path, f"{r['tokens_per_s']:.0f}", str(r["tokens"]), f"{r['s']:.3f}")
        console.print(t)
    print(json.dumps(record))
    return record


if __name__ == "__main__":
    main()
