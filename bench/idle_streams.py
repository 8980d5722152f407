"""Slowloris: how fast health checks, GetModelInfo and a client's rounds answer while N idle streams are held open.

A hostile or broken client can open Session streams and never send anything. The server (grpc.aio, no thread
per stream) must keep answering everyone else. A client process apart from the server opens `--streams` idle
Session streams on loopback (over `--channels` connections, as many clients would); once the server holds them all
it times, on a separate connection, `--probes` health checks, GetModelInfo calls and verification rounds of one
real session (`--model` and `--drafter`, the default models unless given; k=4 random drafts). Reports p50 / p99 /
max per call kind and the server process's resident memory growth per 1,000 idle streams, and how many of them the
server holds (grpc's core cancels the newest idle streams past a couple of thousand per server on this machine).
The bar: health and GetModelInfo within 100 ms with 1,000 idle streams.
Prints a table, then one JSON line.

    python bench/idle_streams.py --streams 0 1000 3000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from rich.console import Console
from rich.table import Table

from tether.server.engine_core import Engine
from tether.server.model_loading import default_model_dir, load
from tether.server.rpc_server import make_server
from tether.server.serve_config import ServiceConfig
from tether.server.service import TetherService
from tether.shared.checkpoint import fingerprint
from tether.shared.drafter_loading import load_drafter
from tether.v1 import tether_pb2 as pb
from tether.v1 import tether_pb2_grpc


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kb / 1024


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def client(port: int, n_streams: int, channels: int, probes: int, fp: str) -> dict:
    """The client process: hold n idle streams, say so, wait for the server's go, then time the probes."""
    local = [("grpc.use_local_subchannel_pool", 1)]  # a TCP connection per channel (else all share one)
    chans = [grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=local) for _ in range(max(1, channels))]
    try:
        stubs = [tether_pb2_grpc.TetherStub(ch) for ch in chans]
        held = [stubs[i % len(stubs)].Session() for i in range(n_streams)]
        print(f"opened {len(held)}", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)  # the server holds them all
        times: dict[str, list[float]] = {"health": [], "model_info": [], "round": []}
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            health, stub = health_pb2_grpc.HealthStub(ch), tether_pb2_grpc.TetherStub(ch)
            session = stub.Session()
            await session.write(pb.ClientMessage(open=pb.OpenSession(prompt=[1, 2, 3, 4], model_fingerprint=fp,
                                                                     max_new_tokens=1024)))  # fmt: skip
            root, gen = (await session.read()).opened.first_token, torch.Generator().manual_seed(0)
            for i in range(probes):
                t0 = time.perf_counter()
                await health.Check(health_pb2.HealthCheckRequest(), timeout=30)
                times["health"].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                await stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
                times["model_info"].append(time.perf_counter() - t0)
                drafts = torch.randint(0, 4096, (4,), generator=gen).tolist()
                t0 = time.perf_counter()
                await session.write(pb.ClientMessage(round=pb.DraftRound(round=i + 1, root=root, tokens=drafts)))
                root = (await session.read()).verdict.bonus
                times["round"].append(time.perf_counter() - t0)
            await session.done_writing()
        return {f"{k}_ms": {"p50": 1e3 * statistics.median(v), "p99": 1e3 * pct(v, 0.99), "max": 1e3 * max(v)}
                for k, v in times.items()}  # fmt: skip
    finally:
        for ch in chans:
            await ch.close()


def measure(service, n: int, args, fp: str) -> dict:
    """Serve, run the client process against it, and watch the server hold the idle streams."""
    server, port = make_server(service, "127.0.0.1:0")
    server.start()
    before = rss_mb()
    cmd = [sys.executable, __file__, "--client", str(port), "--streams", str(n), "--channels", str(args.channels),
           "--probes", str(args.probes), "--fingerprint", fp]  # fmt: skip
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().startswith("opened")
        seen, still = -1, 0
        for _ in range(1200):  # bounded: 2 minutes; done when all are held or the count stops growing for 3 s
            if server.auth.streams >= n or still >= 30:
                break
            still = still + 1 if server.auth.streams == seen else 0
            seen = server.auth.streams
            time.sleep(0.1)
        held, grown = server.auth.streams, rss_mb() - before
        proc.stdin.write("go\n")
        proc.stdin.flush()
        out = json.loads(proc.stdout.readline())
        proc.wait(timeout=60)
    finally:
        proc.kill()
        server.stop(None)
    return {"streams": n, "held": held, "server_rss_mb_per_1k_streams": 1000 * grown / max(1, n), **out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, nargs="+", default=[0, 1000, 3000], help="idle streams to hold open")
    ap.add_argument("--channels", type=int, default=8, help="connections the idle streams are spread over")
    ap.add_argument("--probes", type=int, default=100, help="timed calls of each kind")
    ap.add_argument("--model", default=str(default_model_dir()), help="target directory (default: the default one)")
    ap.add_argument("--drafter", default=str(default_model_dir("drafter")), help="drafter directory trained for it")
    ap.add_argument("--client", type=int, default=0, help=argparse.SUPPRESS)  # the client process: the server's port
    ap.add_argument("--fingerprint", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.client:
        print(json.dumps(asyncio.run(client(args.client, args.streams[0], args.channels, args.probes,
                                            args.fingerprint))), flush=True)  # fmt: skip
        return
    torch.set_grad_enabled(False)
    target, tok = load(args.model, "cpu")
    drafter = load_drafter(args.drafter, target)
    fp = fingerprint(args.model)
    rows = []
    for n in args.streams:
        service = TetherService(
            Engine(target, drafter, tok, ServiceConfig(max_streams=max(4096, 2 * n)), model_fingerprint=fp)
        )
        rows.append(measure(service, n, args, fp))
    title = f"answers while idle streams are held ({args.probes} probes each, loopback, client in its own process)"
    table = Table(title=title)
    for col in ("idle streams", "held", "health p50/p99/max ms", "GetModelInfo p50/p99/max ms", "round p50/p99/max ms",
                "server RSS MB per 1k streams"):  # fmt: skip
        table.add_column(col, justify="right")
    for r in rows:
        cells = [f"{r[k]['p50']:.2f} / {r[k]['p99']:.2f} / {r[k]['max']:.2f}" for k in ("health_ms", "model_info_ms",
                                                                                         "round_ms")]  # fmt: skip
        rss = f"{r['server_rss_mb_per_1k_streams']:.1f}" if r["streams"] else "-"
        table.add_row(str(r["streams"]), str(r["held"]), *cells, rss)
    Console(width=160).print(table)
    print(json.dumps({"bench": "idle_streams", "host": platform.node(), "cpus": len(os.sched_getaffinity(0)),
                      "torch": torch.__version__, "grpcio": grpc.__version__, "rows": rows}))  # fmt: skip


if __name__ == "__main__":
    main()
