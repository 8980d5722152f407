"""The engine's CPU per routed message: gRPC in the server's process against front-end processes (serve --frontends).

The request path's bound on a GPU host is the server process's own CPU per round (BENCHMARKS.md, "The request path
on the H200"), most of it gRPC's. This bench isolates that routing cost from the model: a client process keeps
`--streams` Session streams busy with rounds sent before any `open` (each answered at once with an inline
REASON_OUT_OF_ORDER error: a message in, validated, a message out, no model work), and `--unary` callers with
GetModelInfo. It reports messages/s and the CPU time per message of the engine process alone (its own getrusage:
front ends are other processes) and of the front ends, for each `--frontends` count (0: grpc.aio in the engine
process, as before). What matters is the engine's: it is the one process every round must pass through. The
server loads `--model` and `--drafter` (the default ones unless given), though no message reaches them.
Prints a table, then one JSON line.

    python bench/frontends.py --frontends 0 1 2 --streams 64 --messages 200
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import resource
import subprocess
import sys
import time

import grpc
from rich.console import Console
from rich.table import Table

from tether.server.engine_core import Engine
from tether.server.launch import LaunchPlan, listen
from tether.server.model_loading import default_model_dir, load
from tether.server.serve_config import ServiceConfig
from tether.server.service import TetherService
from tether.shared.checkpoint import fingerprint
from tether.shared.drafter_loading import load_drafter
from tether.v1 import tether_pb2 as pb
from tether.v1 import tether_pb2_grpc


def cpu_s(pid: int | None = None) -> float:
    """CPU time of this process, or of another of ours (Linux /proc)."""
    if pid is None:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime
    try:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def client(port: int, streams: int, unary: int, messages: int) -> dict:
    """The client process: `streams` Session streams and `unary` GetModelInfo callers, `messages` each."""
    local = [("grpc.use_local_subchannel_pool", 1)]  # a TCP connection per channel, spread over the front ends
    chans = [
        grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=local) for _ in range(max(1, min(streams + unary, 16)))
    ]
    stubs = [tether_pb2_grpc.TetherStub(c) for c in chans]
    bad_round = pb.ClientMessage(round=pb.DraftRound(round=1, root=0))

    async def stream(i: int) -> int:
        call = stubs[i % len(stubs)].Session()
        for _ in range(messages):
            await call.write(bad_round)
            reply = await call.read()
            assert reply.error.reason == pb.REASON_OUT_OF_ORDER, reply
        await call.done_writing()
        return messages

    async def calls(i: int) -> int:
        for _ in range(messages):
            await stubs[i % len(stubs)].GetModelInfo(pb.GetModelInfoRequest())
        return messages

    await asyncio.gather(stream(0), calls(0))  # warm: connections up, first calls through
    input_line = await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    if input_line.strip() != "go":
        raise SystemExit(1)
    t0 = time.perf_counter()
    done = await asyncio.gather(*[stream(i) for i in range(streams)], *[calls(i) for i in range(unary)])
    wall = time.perf_counter() - t0
    for c in chans:
        await c.close()
    return {"messages": sum(done), "wall_s": wall}


def measure(service, frontends: int, args) -> dict:
    server, port = listen(service, "127.0.0.1:0", LaunchPlan(frontends=frontends))
    server.start()
    try:
        cmd = [sys.executable, __file__, "--worker", str(port), "--streams", str(args.streams), "--unary",
               str(args.unary), "--messages", str(args.messages)]  # fmt: skip
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        pids = server.pids() if frontends else []
        engine0, fronts0 = cpu_s(), sum(cpu_s(p) for p in pids)
        proc.stdin.write("go\n")
        proc.stdin.flush()
        out = json.loads(proc.stdout.readline())
        engine, fronts = cpu_s() - engine0, sum(cpu_s(p) for p in pids) - fronts0
        proc.wait(timeout=60)
    finally:
        server.stop(grace=1).wait(30)
    n = out["messages"]
    return {"frontends": frontends, "messages": n, "wall_s": out["wall_s"], "messages_per_s": n / out["wall_s"],
            "engine_cpu_us_per_message": 1e6 * engine / n,
            "frontends_cpu_us_per_message": 1e6 * fronts / n if frontends else None}  # fmt: skip


def main(argv: list[str] | None = None) -> dict | None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--frontends", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--streams", type=int, default=64, help="Session streams, each sending --messages rounds")
    ap.add_argument("--unary", type=int, default=0, help="GetModelInfo callers, each making --messages calls")
    ap.add_argument("--messages", type=int, default=200)
    ap.add_argument("--model", default=str(default_model_dir()), help="target directory (default: the default one)")
    ap.add_argument("--drafter", default=str(default_model_dir("drafter")), help="drafter directory trained for it")
    ap.add_argument("--worker", type=int, default=0, help=argparse.SUPPRESS)  # the client process: the port
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(asyncio.run(client(args.worker, args.streams, args.unary, args.messages))), flush=True)
        return None
    target, tok = load(args.model, "cpu", "float32")
    drafter = load_drafter(args.drafter, target)
    config = ServiceConfig(max_streams=max(4096, 2 * args.streams), max_calls_per_key=max(512, 2 * args.unary))
    service = TetherService(Engine(target, drafter, tok, config, model_fingerprint=fingerprint(args.model)))
    try:
        rows = [measure(service, n, args) for n in args.frontends]
    finally:
        service.engine.close()
    t = Table(title=f"routing only: {args.streams} streams x {args.messages} refused rounds, {args.unary} unary "
              f"callers; {os.cpu_count()} cores")  # fmt: skip
    for c in ("front ends", "messages", "messages/s", "engine CPU us / message", "front ends CPU us / message"):
        t.add_column(c, justify="right")
    for r in rows:
        fe = r["frontends_cpu_us_per_message"]
        t.add_row(str(r["frontends"]) if r["frontends"] else "0 (grpc.aio here)", f"{r['messages']:,}",
                  f"{r['messages_per_s']:,.0f}", f"{r['engine_cpu_us_per_message']:.1f}",
                  "-" if fe is None else f"{fe:.1f}")  # fmt: skip
    Console().print(t)
    record = {"bench": "frontends", "host": platform.node(), "cpus": os.cpu_count(), "args": vars(args), "rows": rows}
    print(json.dumps(record))
    return record


if __name__ == "__main__":
    main()
