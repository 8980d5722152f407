"""Server-side speculation against plain decoding: Generate's tokens/s with `serve --server-draft` and without.

Two engines in this process, each built from a ServeConfig as `tether-server serve` builds it (Engine.build, warmed
up: on a GPU its kernels compiled and its step graphs captured) over the same models (the default target and MoA
drafter, or --model / --drafter) on --device, each behind its own gRPC server on 127.0.0.1: one decodes plainly, one
with --server-draft (--k draft tokens a round). For each B of --streams and each mode: the first --prompts held-out
prompts (deploy/models/prompts/heldout.jsonl, under the model's tokenizer), B Generate streams at a time started
together (threads, blocking stubs), each --tokens greedy tokens with ignore_eos, so every stream has the same length.
A row: aggregate tokens/s over the batches' wall time, tokens/s per stream, mean time to first token, and for
server-draft tau (tokens per round, from the engine's counts) and its speed over plain at the same B. Greedy
server-draft output must be plain decoding's: in float32 the run fails if any stream differs; in bf16 / fp16, where
verifying k + 1 rows at once may round a near-tie otherwise than one row, the streams that differ are counted. One
warm-up generation per mode first. Prints a table, then one JSON line.

    python bench/server_draft.py --device cpu --streams 1 --prompts 8 --tokens 128       # the B = 1 figure
    python bench/server_draft.py --streams 1 4 16 --prompts 32                           # on a GPU
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import torch
from rich.console import Console
from rich.table import Table

from tether.server.engine_core import Engine
from tether.server.model_loading import default_model_dir, pick_device
from tether.server.rpc_server import make_server
from tether.server.serve_config import ServeConfig
from tether.server.service import TetherService
from tether.v1 import tether_pb2 as pb
from tether.v1 import tether_pb2_grpc

ROOT = Path(__file__).resolve().parents[1]
MODES = ("plain", "server-draft")


def stream(stub, request: pb.OpenSession, go: threading.Barrier) -> tuple[list[int], float]:
    """One Generate stream, started with the others: its tokens and its time to first token."""
    go.wait()
    t0 = time.perf_counter()
    tokens, first = [], None
    for msg in stub.Generate(request, timeout=3600):
        first = time.perf_counter() - t0 if first is None else first
        tokens += msg.tokens
    return tokens, first


def run(stub, requests: list[pb.OpenSession], b: int) -> tuple[list[list[int]], list[float], float]:
    """The requests, b at a time: every stream's tokens, time to first token, and the batches' wall time."""
    outs, firsts, wall = [], [], 0.0
    with ThreadPoolExecutor(b) as pool:
        for i in range(0, len(requests), b):
            group = requests[i : i + b]
            go = threading.Barrier(len(group))
            t0 = time.perf_counter()
            done = list(pool.map(lambda r, go=go: stream(stub, r, go), group))
            wall += time.perf_counter() - t0
            outs += [d[0] for d in done]
            firsts += [d[1] for d in done]
    return outs, firsts, wall


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    ap.add_argument("--model", default=str(default_model_dir()), help="target model directory")
    ap.add_argument("--drafter", default=str(default_model_dir("drafter")), help="drafter directory")
    ap.add_argument("--device", default="", help="cpu / cuda (default: cuda when present)")
    ap.add_argument("--dtype", default="", help="default: bfloat16 on CUDA, float32 elsewhere")
    ap.add_argument("--k", type=int, default=5, help="server-draft: draft tokens per round")
    ap.add_argument("--streams", type=int, nargs="+", default=[1], help="concurrent Generate streams B, in turn")
    ap.add_argument("--prompts", type=int, default=8, help="held-out prompts, each one stream")
    ap.add_argument("--prompt-file", type=Path, default=ROOT / "deploy/models/prompts/heldout.jsonl")
    ap.add_argument("--tokens", type=int, default=128, help="greedy tokens per stream (ignore_eos)")
    ap.add_argument("--kv-pool-mb", type=int, default=256, help="each engine's KV pool")
    args = ap.parse_args(argv)
    torch.set_grad_enabled(False)
    base = ServeConfig(model=args.model, drafter=args.drafter, device=pick_device(args.device), dtype=args.dtype,
                       kv_pool_mb=args.kv_pool_mb, round_graph_tokens=args.k + 1, server_draft_k=args.k,
                       max_sessions=max(args.streams))  # fmt: skip
    engines = {mode: Engine.build(dataclasses.replace(base, server_draft=mode == "server-draft")) for mode in MODES}
    servers = []
    try:
        for engine in engines.values():
            engine.warm_up()
            server, port = make_server(TetherService(engine), "127.0.0.1:0")
            server.start()
            servers.append((server, grpc.insecure_channel(f"127.0.0.1:{port}")))
        stubs = {m: tether_pb2_grpc.TetherStub(c) for m, (_, c) in zip(MODES, servers, strict=True)}
        return measure(args, engines, stubs)
    finally:
        for server, channel in servers:
            channel.close()
            server.stop(grace=None)
        for engine in engines.values():
            engine.close()


def measure(args: argparse.Namespace, engines: dict, stubs: dict) -> dict:
    engine = engines["plain"]
    tok, fp = engine.tokenizer, engine.model_fingerprint
    texts = [json.loads(line)["text"] for line in args.prompt_file.read_text().splitlines() if line.strip()]
    sampling = pb.SamplingParams(ignore_eos=True)
    requests = [pb.OpenSession(prompt=tok.encode(t), max_new_tokens=args.tokens, model_fingerprint=fp,
                               sampling=sampling) for t in texts[: args.prompts]]  # fmt: skip
    for mode in MODES:
        run(stubs[mode], requests[:1], 1)  # warm-up
    exact = engine.target.dtype == torch.float32
    rows = []
    for b in args.streams:
        plain = None
        for mode in MODES:
            stats = engines[mode].decoding.stats if mode == "server-draft" else None
            before = (stats.rounds, stats.accepted) if stats else None
            outs, firsts, wall = run(stubs[mode], requests, b)
            n = sum(len(o) for o in outs)
            row = {"mode": mode, "streams": b, "tokens": n, "wall_s": round(wall, 3),
                   "tokens_per_s": round(n / wall, 1), "tokens_per_s_per_stream": round(n / wall / b, 1),
                   "ttft_ms": round(1000 * sum(firsts) / len(firsts), 1)}  # fmt: skip
            if stats:
                rounds, accepted = stats.rounds - before[0], stats.accepted - before[1]
                differ = sum(a != p for a, p in zip(outs, plain["outs"], strict=True))
                if differ and exact:
                    raise SystemExit(f"server-draft differs from plain decoding on {differ} streams in float32")
                row |= {"tau": round((accepted + rounds) / rounds, 3), "differ": differ,
                        "speedup": round(row["tokens_per_s"] / plain["row"]["tokens_per_s"], 3)}  # fmt: skip
            else:
                plain = {"outs": outs, "row": row}
            rows.append(row)
    target = engine.target
    device = torch.cuda.get_device_name() if str(target.device).startswith("cuda") else platform.processor() or "cpu"
    record = {"bench": "server_draft", "model": args.model, "drafter": args.drafter, "k": args.k,
              "prompts": len(requests), "tokens": args.tokens, "dtype": str(target.dtype).removeprefix("torch."),
              "attention": target.backend, "device": device, "threads": torch.get_num_threads(),
              "rows": rows}  # fmt: skip
    title = (f"Generate, plain vs server-draft (k {args.k}): {len(requests)} held-out prompts x {args.tokens} greedy "
             f"tokens, {record['dtype']}, {target.backend} attention, {device}")  # fmt: skip
    table = Table(title=title)
    for c in ("streams", "mode", "tokens/s", "per stream", "TTFT ms", "tau", "vs plain", "differ"):
        table.add_column(c, justify="right")
    for r in rows:
        table.add_row(str(r["streams"]), r["mode"], f"{r['tokens_per_s']:.1f}", f"{r['tokens_per_s_per_stream']:.1f}",
                      f"{r['ttft_ms']:.0f}", str(r.get("tau", "-")), f"{r['speedup']:.2f}x" if "speedup" in r else "-",
                      str(r.get("differ", "-")))  # fmt: skip
    Console(width=120).print(table)
    print(json.dumps(record), flush=True)
    return record


if __name__ == "__main__":
    main()
