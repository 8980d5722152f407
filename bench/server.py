"""The request path under load: N synthetic clients against one server over real gRPC (issue [3/7]).

A server (tether.server.service on tether.server.rpc_server, in this process on 127.0.0.1, the default models on
`--device`; or any server at `--target HOST:PORT`) and a client process apart from it. The clients are asyncio
coroutines in that process (`--client-procs` spreads them over several), each on a grpc.aio channel of its own
(`--channels C`: C shared connections per process instead). They run in another process because grpc.aio keeps
one event loop per process in practice (tether.server.rpc_server.event_loop): aio clients on a second loop beside
the server's would share its completion queue; and so the server process's CPU time counts the server alone.

- `random` (default): each client opens a Session with a `--prompt-len` prompt of random token ids (the
  vocabulary from GetModelInfo, which also gives the fingerprint) and the client's default delta codec (lossless),
  then sends `--warmup-rounds` and `--rounds` DraftRounds of `--k` random draft tokens, each rooted at the last
  verdict's bonus, reading every verdict. Random drafts are almost never accepted, so this measures the server's
  cost per round (k + 1 tokens scored), not speculation. Timed: the rounds after the warm-up, all clients started
  together once every one of them has opened and warmed up; a round's latency is its write to its verdict.
- `generate`: the server-only baseline, N concurrent Generate streams of `--tokens` tokens (random prompts of
  `--prompt-len`); total and per-stream tokens/s and time to first token.

Per client count (`--clients 1 32 128`, in turn against the same server): rounds/s, scored and accepted tokens/s
(accepted = the verdicts' accepted + 1), p50 / p99 round latency, the speed-up over one client's rounds/s (else
over the first count's) and wall time; with the server in this process, also the batcher's mean batch size and
the server's mean verify time (its batch_size and verify_seconds histograms over the timed window; with --target,
scraped from --metrics-url) and the server process's CPU time per round (getrusage; the client process is not
counted). Generate rows: tokens/s, per stream, TTFT and CPU per token. Prints a table, then one JSON line.

    python bench/server.py --clients 1 32 128                    # CUDA when present, random drafts, k=5
    python bench/server.py --device cpu --clients 1 8 32 --rounds 20
    python bench/server.py --mode generate --clients 1 8 --tokens 200
    python bench/server.py --target 10.0.0.5:50051 --clients 1 64 --metrics-url http://10.0.0.5:9100/metrics
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import resource
import select
import statistics
import subprocess
import sys
import time

import grpc

from tether.v1 import tether_pb2 as pb
from tether.v1 import tether_pb2_grpc

MAX_MESSAGE = 64 << 20
LOSSLESS = pb.CODEC_FP16_SHUFFLE_ZSTD  # tether.client.session's default codec ("lossless")


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


# ---- the client process ------------------------------------------------------------------------------------


class RoundClient:
    """One Session stream: open with a random prompt, then chains of random drafts, one round at a time."""

    def __init__(self, stub, args: argparse.Namespace, vocab: int, fp: str, seed: int):
        self.stub, self.args, self.vocab, self.fp = stub, args, vocab, fp
        self.rng = random.Random(seed)
        self.call = None
        self.session_id, self.root, self.round = "", 0, 0

    async def _send(self, msg: pb.ClientMessage) -> pb.ServerMessage:
        await asyncio.wait_for(self.call.write(msg), self.args.rpc_timeout)
        reply = await asyncio.wait_for(self.call.read(), self.args.rpc_timeout)
        if reply is grpc.aio.EOF:
            raise RuntimeError("the server ended the stream")
        if reply.WhichOneof("body") == "error":
            e = reply.error
            raise RuntimeError(f"server error on round {e.round}: {pb.ErrorReason.Name(e.reason)}: {e.message}")
        return reply

    async def open(self) -> None:
        a = self.args
        self.call = self.stub.Session(timeout=a.timeout)
        prompt = [self.rng.randrange(self.vocab) for _ in range(a.prompt_len)]
        max_new = (a.warmup_rounds + a.rounds) * (a.k + 1)
        req = pb.OpenSession(prompt=prompt, max_new_tokens=max_new, model_fingerprint=self.fp, delta_codec=LOSSLESS)
        reply = await self._send(pb.ClientMessage(open=req))
        for _ in range(reply.opened.delta_parts):  # a long prompt's delta comes in parts
            await asyncio.wait_for(self.call.read(), self.args.rpc_timeout)
        self.session_id, self.root = reply.opened.session_id, reply.opened.first_token

    async def rounds(self, n: int) -> tuple[list[float], int]:
        """n rounds; their latencies (s) and the tokens they gained (accepted + bonus)."""
        times, gained = [], 0
        for _ in range(n):
            self.round += 1
            drafts = [self.rng.randrange(self.vocab) for _ in range(self.args.k)]
            msg = pb.ClientMessage(round=pb.DraftRound(round=self.round, root=self.root, tokens=drafts))
            t0 = time.perf_counter()
            v = (await self._send(msg)).verdict
            times.append(time.perf_counter() - t0)
            gained += v.accepted + 1
            self.root = v.bonus
        return times, gained

    async def close(self) -> None:
        if self.call is None:
            return
        try:
            await asyncio.wait_for(self.call.done_writing(), self.args.rpc_timeout)
            if self.session_id:
                await self.stub.Close(pb.CloseRequest(session_id=self.session_id), timeout=self.args.rpc_timeout)
        except (grpc.RpcError, TimeoutError):
            pass
        self.call.cancel()


async def generate_stream(stub, args: argparse.Namespace, vocab: int, fp: str, seed: int, tokens: int) -> dict:
    rng = random.Random(seed)
    req = pb.OpenSession(prompt=[rng.randrange(vocab) for _ in range(args.prompt_len)], max_new_tokens=tokens,
                         model_fingerprint=fp)  # fmt: skip
    t0 = time.perf_counter()
    first = last = None
    n = 0
    async for msg in stub.Generate(req, timeout=args.timeout):  # bounded: the call's deadline
        last = time.perf_counter()
        first = first or last
        n += len(msg.tokens)
    if first is None:
        raise RuntimeError("a Generate stream sent no token")
    return {"tokens": n, "ttft_s": first - t0, "stream_s": last - first}


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def emit(obj: dict) -> None:
    print(json.dumps(obj), flush=True)


async def await_go() -> None:
    line = await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    if line.strip() != "go":  # EOF: the bench process went away
        raise SystemExit(1)


async def client_process(args: argparse.Namespace, n: int, seed: int) -> None:
    """Open n clients, warm up, say "ready", wait for "go" on stdin, run the timed part, print its numbers."""
    opts = [("grpc.max_receive_message_length", MAX_MESSAGE), ("grpc.max_send_message_length", MAX_MESSAGE)]
    n_chan = n if args.channels <= 0 else min(args.channels, n)
    chans = [grpc.aio.insecure_channel(args.worker, options=opts) for _ in range(n_chan)]
    stubs = [tether_pb2_grpc.TetherStub(ch) for ch in chans]
    clients: list[RoundClient] = []
    try:
        info = await stubs[0].GetModelInfo(pb.GetModelInfoRequest(), timeout=args.rpc_timeout)
        vocab, fp = json.loads(info.model_config_json)["vocab_size"], info.model_fingerprint
        if args.prompt_len > info.max_prompt_tokens or args.k > info.max_draft_tokens:
            raise SystemExit(f"the server takes prompts of {info.max_prompt_tokens} and rounds of "
                             f"{info.max_draft_tokens} tokens at most")  # fmt: skip
        if args.mode == "generate":
            await generate_stream(stubs[0], args, vocab, fp, seed - 1, 8)  # the first stream's one-time costs
            emit({"ready": n})
            await await_go()
            t0, c0 = time.perf_counter(), cpu_s()
            streams = await asyncio.gather(*(generate_stream(stubs[i % n_chan], args, vocab, fp, seed + i,
                                                             args.tokens) for i in range(n)))  # fmt: skip
            emit({"wall_s": time.perf_counter() - t0, "cpu_s": cpu_s() - c0, "streams": streams})
            return
        clients = [RoundClient(stubs[i % n_chan], args, vocab, fp, seed + i) for i in range(n)]
        await asyncio.gather(*(c.open() for c in clients))
        await asyncio.gather(*(c.rounds(args.warmup_rounds) for c in clients))
        emit({"ready": n})
        await await_go()
        t0, c0 = time.perf_counter(), cpu_s()
        results = await asyncio.gather(*(c.rounds(args.rounds) for c in clients))
        wall = time.perf_counter() - t0
        lat = [t for ts, _ in results for t in ts]
        emit({"wall_s": wall, "cpu_s": cpu_s() - c0, "lat_s": lat, "gained": sum(g for _, g in results)})
    finally:
        await asyncio.gather(*(c.close() for c in clients), return_exceptions=True)
        for ch in chans:
            await ch.close()


# ---- the bench process --------------------------------------------------------------------------------------


def read_line(proc: subprocess.Popen, deadline: float) -> dict:
    """The client process's next JSON line, by `deadline` (time.monotonic)."""
    left = deadline - time.monotonic()
    if left <= 0 or not select.select([proc.stdout], [], [], left)[0]:
        raise TimeoutError("the client process did not answer in time")
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"the client process ended (exit status {proc.wait(timeout=10)})")
    return json.loads(line)


class ServerProbe:
    """What the bench reads of the server around the timed window: CPU time of this process (in-process server),
    the batch_size and verify_seconds histograms (from the service, or scraped from --metrics-url)."""

    def __init__(self, service=None, metrics_url: str = ""):
        self.service, self.metrics_url = service, metrics_url

    def sample(self) -> dict:
        out: dict = {}
        if self.service is not None:
            out["cpu_s"] = cpu_s()  # this process's threads only: not the client processes
            fams = [*self.service.metrics.batch_size.collect(), *self.service.metrics.verify_seconds.collect()]
            samples = [s for f in fams for s in f.samples]
        elif self.metrics_url:
            import urllib.request

            from prometheus_client.parser import text_string_to_metric_families

            with urllib.request.urlopen(self.metrics_url, timeout=10) as f:
                text = f.read().decode()
            samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
        else:
            return out
        for s in samples:
            for name in ("tether_batch_size", "tether_verify_seconds"):
                if s.name in (f"{name}_sum", f"{name}_count"):
                    out[s.name] = s.value
        return out


def delta(after: dict, before: dict, key: str) -> float | None:
    return after[key] - before[key] if key in after and key in before else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def measure(args: argparse.Namespace, address: str, n: int, probe: ServerProbe) -> dict:
    """Run n clients (over --client-procs processes) against the server at `address`; one row."""
    procs_n = max(1, min(args.client_procs, n))
    shares = [n // procs_n + (i < n % procs_n) for i in range(procs_n)]
    spec = json.dumps({k: v for k, v in vars(args).items() if k not in ("clients", "worker")})
    procs = []
    deadline = time.monotonic() + args.timeout
    try:
        for i, share in enumerate(shares):
            cmd = [sys.executable, os.path.abspath(__file__), "--worker", address, "--worker-clients", str(share),
                   "--worker-seed", str(args.seed + 100_000 * (i + 1) + 1000 * n), "--worker-spec", spec]  # fmt: skip
            procs.append(subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
        for p in procs:
            read_line(p, deadline)  # ready: opened and warmed up
        before = probe.sample()
        t0 = time.perf_counter()
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        outs = [read_line(p, deadline) for p in procs]
        wall = time.perf_counter() - t0
        after = probe.sample()
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            p.kill()
            p.wait()
    cpu = delta(after, before, "cpu_s")
    cpu_ms = None if cpu is None else 1e3 * cpu
    batches = delta(after, before, "tether_batch_size_count")
    client_cpu = sum(o["cpu_s"] for o in outs)
    row: dict = {"clients": n, "client_procs": procs_n, "wall_s": wall, "server_cpu_s": cpu, "client_cpu_s": client_cpu}
    if args.mode == "generate":
        streams = [s for o in outs for s in o["streams"]]
        tokens = sum(s["tokens"] for s in streams)
        ttft = [s["ttft_s"] for s in streams]
        per_stream = [(s["tokens"] - 1) / s["stream_s"] for s in streams if s["stream_s"] > 0]
        return row | {"tokens": tokens, "tokens_per_s": tokens / wall,
                      "tokens_per_s_per_stream": statistics.mean(per_stream) if per_stream else None,
                      "ttft_p50_ms": 1e3 * pct(ttft, 0.5), "ttft_p99_ms": 1e3 * pct(ttft, 0.99),
                      "server_cpu_ms_per_token": ratio(cpu_ms, tokens),
                      "client_cpu_ms_per_token": 1e3 * row["client_cpu_s"] / tokens}  # fmt: skip
    lat = [t for o in outs for t in o["lat_s"]]
    rounds, gained = len(lat), sum(o["gained"] for o in outs)
    return row | {"rounds": rounds, "rounds_per_s": rounds / wall, "scored_tokens_per_s": rounds * (args.k + 1) / wall,
                  "accepted_tokens_per_s": gained / wall, "tau": gained / rounds,
                  "p50_ms": 1e3 * pct(lat, 0.5), "p99_ms": 1e3 * pct(lat, 0.99), "max_ms": 1e3 * max(lat),
                  "mean_batch": ratio(delta(after, before, "tether_batch_size_sum"), batches),
                  "server_verify_ms": ratio(1e3 * (delta(after, before, "tether_verify_seconds_sum") or 0),
                                            delta(after, before, "tether_verify_seconds_count")),
                  "server_cpu_ms_per_round": ratio(cpu_ms, rounds),
                  "client_cpu_ms_per_round": 1e3 * row["client_cpu_s"] / rounds}  # fmt: skip


def start_server(args: argparse.Namespace):
    """The default models (or --model / --drafter) served on 127.0.0.1:0 in this process."""
    import torch

    from tether.server.batcher import warm_up
    from tether.server.generate import default_model_dir, load
    from tether.server.rpc_server import make_server
    from tether.server.service import ServiceConfig, TetherService
    from tether.shared.checkpoint import fingerprint
    from tether.shared.drafter import load_drafter

    torch.set_grad_enabled(False)
    args.model = args.model or str(default_model_dir())
    args.drafter = args.drafter or str(default_model_dir("drafter"))
    fp = fingerprint(args.model)
    target, tok = load(args.model, args.device)
    drafter = load_drafter(args.drafter, target, target_fingerprint=fp)
    most = max(args.clients)
    config = ServiceConfig(max_sessions=max(256, 2 * most), max_streams=max(4096, 2 * most),
                           max_new_tokens=max(1024, args.tokens), kv_pool_bytes=args.kv_pool_mb << 20,
                           batch_window_s=args.batch_window_ms / 1e3, max_batch=args.max_batch)  # fmt: skip
    service = TetherService(target, drafter, tok, config, model_fingerprint=fp)
    if target.backend == "triton":
        warm_up(target, service.pool)  # as `tether-server serve` does before it listens
    server, port = make_server(service, "127.0.0.1:0")
    server.start()
    return service, server, port


def baseline(rows: list[dict]) -> dict:
    """The row speed-ups are relative to: one client when measured, else the first count."""
    return next((r for r in rows if r["clients"] == 1), rows[0])


def table(args: argparse.Namespace, rows: list[dict], where: str):
    from rich.table import Table

    def f(x, fmt):
        return "-" if x is None else format(x, fmt)

    if args.mode == "generate":
        t = Table(title=f"Generate streams, {args.tokens} tokens each, prompt {args.prompt_len}, {where}")
        cols = ("streams", "tokens/s", "speed-up", "tokens/s per stream", "TTFT p50 / p99 ms",
                "CPU ms/token server / clients", "wall s")  # fmt: skip
        for c in cols:
            t.add_column(c, justify="right")
        for r in rows:
            t.add_row(str(r["clients"]), f(r["tokens_per_s"], ".0f"), f(r["speedup"], ".2f"),
                      f(r["tokens_per_s_per_stream"], ".1f"), f"{r['ttft_p50_ms']:.0f} / {r['ttft_p99_ms']:.0f}",
                      f"{f(r['server_cpu_ms_per_token'], '.2f')} / {r['client_cpu_ms_per_token']:.2f}",
                      f"{r['wall_s']:.2f}")  # fmt: skip
        return t
    t = Table(title=f"Session rounds, {args.k} random drafts, prompt {args.prompt_len}, {args.rounds} timed rounds "
              f"per client, {where}")  # fmt: skip
    cols = ("clients", "rounds/s", "speed-up", "scored tok/s", "accepted tok/s", "p50 / p99 ms", "mean batch",
            "server verify ms", "CPU ms/round server / clients", "wall s")  # fmt: skip
    for c in cols:
        t.add_column(c, justify="right")
    for r in rows:
        t.add_row(str(r["clients"]), f(r["rounds_per_s"], ".1f"), f(r["speedup"], ".2f"),
                  f(r["scored_tokens_per_s"], ".0f"), f(r["accepted_tokens_per_s"], ".0f"),
                  f"{r['p50_ms']:.1f} / {r['p99_ms']:.1f}", f(r["mean_batch"], ".2f"), f(r["server_verify_ms"], ".1f"),
                  f"{f(r['server_cpu_ms_per_round'], '.1f')} / {r['client_cpu_ms_per_round']:.1f}",
                  f"{r['wall_s']:.2f}")  # fmt: skip
    return t


def parser() -> argparse.ArgumentParser:
    from tether.server.service import ServiceConfig  # the in-process server's defaults

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", default="random", choices=["random", "generate"])
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 32, 128], help="client counts, run in turn")
    ap.add_argument("--rounds", type=int, default=50, help="random: timed rounds per client")
    ap.add_argument("--warmup-rounds", type=int, default=2, help="random: untimed rounds per client first")
    ap.add_argument("--k", type=int, default=5, help="random: draft tokens per round (k + 1 scored with the root)")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=200, help="generate: tokens per stream")
    ap.add_argument("--channels", type=int, default=0, help="connections per client process; 0: one per client")
    ap.add_argument("--client-procs", type=int, default=1, help="client processes the clients are spread over")
    ap.add_argument("--target", default="", help="HOST:PORT of a running server instead of one in this process")
    ap.add_argument("--metrics-url", default="", help="with --target: its Prometheus endpoint (batch size)")
    ap.add_argument("--device", default="", help="in-process server: cpu / cuda (default: cuda when present)")
    ap.add_argument("--model", default="", help="in-process server: target directory (default: deploy/models/target)")
    ap.add_argument("--drafter", default="", help="in-process server: drafter directory (default: the shipped one)")
    ap.add_argument("--kv-pool-mb", type=int, default=256, help="in-process server: KV pool size")
    ap.add_argument(
        "--batch-window-ms",
        type=float,
        default=ServiceConfig.batch_window_s * 1e3,
        help="in-process server: the batcher's extra wait before a step (0: continuous batching)",
    )
    ap.add_argument(
        "--max-batch", type=int, default=ServiceConfig.max_batch, help="in-process server: rounds per step at most"
    )
    ap.add_argument("--rpc-timeout", type=float, default=60.0, help="seconds per message / unary call")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per client count, all included")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--worker", default="", help=argparse.SUPPRESS)  # the client process: the server's address
    ap.add_argument("--worker-clients", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--worker-seed", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--worker-spec", default="", help=argparse.SUPPRESS)
    return ap


def main(argv: list[str] | None = None) -> dict:
    args = parser().parse_args(argv)
    if args.worker:
        spec = argparse.Namespace(**{**json.loads(args.worker_spec), "worker": args.worker})
        asyncio.run(client_process(spec, args.worker_clients, args.worker_seed))
        return {}
    if min(args.clients) < 1 or args.rounds < 1 or args.k < 1 or args.prompt_len < 1 or args.tokens < 2:
        raise SystemExit("--clients, --rounds, --k and --prompt-len must be at least 1, --tokens at least 2")
    import torch
    from rich.console import Console

    service = server = None
    if args.target:
        address, device = args.target, f"server at {args.target}"
    else:
        args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        service, server, port = start_server(args)
        address = f"127.0.0.1:{port}"
        device = torch.cuda.get_device_name() if args.device.startswith("cuda") else f"cpu ({os.cpu_count()} cores)"
    probe = ServerProbe(service, args.metrics_url)
    rows = []
    try:
        for n in args.clients:
            rows.append(measure(args, address, n, probe))
    finally:
        if server is not None:
            server.stop(grace=1).wait(30)
            service.close()
    speed = "rounds_per_s" if args.mode == "random" else "tokens_per_s"
    for r in rows:
        r["speedup"] = r[speed] / baseline(rows)[speed]
    where = f"{device}, in-process server" if service is not None else device
    Console(width=200).print(table(args, rows, where))
    record = {"bench": "server", "mode": args.mode, "device": device, "host": platform.node(),
              "cpus": len(os.sched_getaffinity(0)), "torch": torch.__version__, "grpcio": grpc.__version__,
              "args": {k: v for k, v in vars(args).items() if not k.startswith("worker")}, "rows": rows}  # fmt: skip
    print(json.dumps(record))
    return record


if __name__ == "__main__":
    main()
