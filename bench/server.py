"""The request path under load: N synthetic clients against one server over real gRPC (issue [3/7]).

A server (tether.server.service on tether.server.rpc_server, in this process on 127.0.0.1, the default models on
`--device`; or any server at `--target HOST:PORT`) and a client process apart from it. The clients are asyncio
coroutines in that process (`--client-procs` spreads them over several), each on a grpc.aio channel of its own
(`--channels C`: C shared connections per process instead). They run in another process because grpc.aio keeps
one event loop per process in practice (tether.server.rpc_server.event_loop): aio clients on a second loop beside
the server's would share its completion queue; and so the server process's CPU time counts the server alone.
The clients' code is bench/server_clients.py; this file starts their processes and adds up what they measured.

- `random` (default): each client opens a Session with a `--prompt-len` prompt of random token ids (the
  vocabulary from GetModelInfo, which also gives the fingerprint) and the client's default delta codec (lossless),
  then sends `--warmup-rounds` and `--rounds` DraftRounds of `--k` random draft tokens, each rooted at the last
  verdict's bonus, reading every verdict. Random drafts are almost never accepted, so this measures the server's
  cost per round (k + 1 tokens scored), not speculation. Timed: the rounds after the warm-up, all clients started
  together once every one of them has opened and warmed up; a round's latency is its write to its verdict.
- `trace`: the same rounds with real drafts: `--traces FILE` holds what the default drafter proposed, round by
  round, on real prompts (bench/traces.py has the format; `--record-traces FILE --prompts N` records them with
  the in-process engine, greedy, k = --k, `--trace-tokens` per prompt of --prompt-len, and stops; a --traces file
  that does not exist is recorded first with the in-process server's models). Client i takes trace i (round-robin),
  opens a session on its prompt and sends round r's recorded drafts after the root the server actually decided.
  On the recording's target, device and dtype the verdicts are the recorded ones, so acceptance is real; elsewhere
  they may drift (rows say how many rounds matched the recording) and tau is whatever the server measured. A
  client whose trace runs out opens a session on the next one (counted in the window; rows count the reopens).
- `generate`: the server-only baseline, N concurrent Generate streams of `--tokens` tokens (random prompts of
  `--prompt-len`, or the prompts of --traces); total and per-stream tokens/s and time to first token.

`--rtt-ms R` puts a link's round trip into every client: a sleep of R after each verdict arrives (a round's
latency includes it) and before each Generate stream opens (no netsim: hundreds of clients stay cheap).
`--duration S` times a window of S seconds instead of a number of rounds / tokens: Session clients send rounds
until it ends (a round's tokens count when its verdict arrives in it; a random-draft session that has sent its
--warmup-rounds + --rounds opens a new one), Generate clients open streams one after another and count the tokens
received in it; rates are over S, a Generate client's from its first token (a Session client opens and warms up
before the window, so its first open and prefill are not counted: neither are a stream client's); rows list every
client's tokens/s. `--rate R`
paces each Session client to R tokens/s: a round goes when the tokens gained so far are due at R (behind its
budget, a client catches up back to back); with --duration, rows count the clients that got 0.95 R or more
(bench/capacity.py searches the client count a server sustains this way).

Per client count (`--clients 1 32 128`, in turn against the same server): rounds/s, scored and accepted tokens/s
(accepted = the verdicts' accepted + 1), tau, p50 / p99 round latency, the speed-up over one client's rounds/s
(else over the first count's) and wall time; with the server in this process, also the batcher's mean batch size,
the server's mean round time (a round's wait, batch and verdict) and mean batch time (staging, GPU step,
verdicts, deltas: its batch_size, verify_seconds and batch_seconds histograms over the timed window; with
--target, scraped from --metrics-url), the server process's CPU time per round (getrusage; the client process
is not counted) and what the open sessions hold before the window (sessions, KV blocks, resident and CUDA
memory); then, in random mode with an in-process CUDA server, the GPU's own time for one client's round
(torch.profiler's kernel time), which the one-client p50 is compared with. Trace rows add the recording's tau
over the same rounds and the share of rounds whose verdict matched it. Generate rows: tokens/s, per stream, TTFT
and CPU per token. Prints a table, then one JSON line.
Engine CPU per round (`engine_cpu_us_per_round`, defined in bench/engine_cpu.py): the CPU time of the process holding
the models over the window, per round verified, by thread; `engine_host_cpu_us_per_round` leaves out the models' own
compute on a CPU device, standing for a GPU server's host work (column "engine CPU us all/host", per round).

    python bench/server.py --clients 1 32 128                    # CUDA when present, random drafts, k=5
    python bench/server.py --device cpu --clients 1 8 32 --rounds 20
    python bench/server.py --device cpu --record-traces traces.json --prompts 32
    python bench/server.py --device cpu --mode trace --traces traces.json --clients 1 8 32
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
from math import nan

import grpc


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def sibling(name: str):
    """bench/NAME.py as a module (bench/ is no package; this file runs as a script and is imported by path)."""
    import importlib.util

    key = f"tether_bench_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                                        f"{name}.py"))  # fmt: skip
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    return sys.modules[key]


def clients():
    """The client side, bench/server_clients.py."""
    return sibling("server_clients")


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

    def __init__(self, service=None, metrics_url: str = "", server=None):
        from tether.server.heap import GCPauses

        self.service, self.metrics_url = service, metrics_url
        self.frontends = getattr(server, "pids", lambda: [])  # --frontends: their CPU time is the server's too
        self.pauses = GCPauses()  # this process's collections, the in-process server's: installed by open()

    def __enter__(self) -> ServerProbe:
        self.pauses.install()
        return self

    def __exit__(self, *exc) -> None:
        self.pauses.remove()

    def sample(self) -> dict:
        out: dict = {}
        if self.service is not None:
            engine = sibling("engine_cpu")
            out["cpu_s"] = clients().cpu_s() + sum(map(engine.process_cpu_s, self.frontends()))  # not the clients
            out["engine"] = engine.sample(self.frontends())
            out |= memory(self.service)
            out |= {f"gc_{k}": v for k, v in self.pauses.snapshot(reset_max=True).items()}  # max: since last sample
            m = self.service.engine.metrics
            fams = [*m.batch_size.collect(), *m.rounds.collect(), *m.batch_seconds.collect()]
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
            for name in ("tether_batch_size", "tether_verify_seconds", "tether_batch_seconds"):
                if s.name in (f"{name}_sum", f"{name}_count"):
                    out[s.name] = s.value
        return out


def rss_mb() -> float:
    """This process's resident memory now (Linux /proc; elsewhere its peak, from getrusage)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak / 2**20 if sys.platform == "darwin" else peak / 2**10


def memory(service) -> dict:
    """What the in-process server holds: sessions open, KV blocks in use, resident memory (the bench's own
    bookkeeping included: it is small) and CUDA memory allocated."""
    import torch

    cuda = torch.cuda.memory_allocated() / 2**20 if torch.cuda.is_available() else None
    e = service.engine
    return {"sessions": len(e.table), "kv_blocks_used": e.pool.used_blocks, "rss_mb": rss_mb(), "cuda_mb": cuda}


def delta(after: dict, before: dict, key: str) -> float | None:
    return after[key] - before[key] if key in after and key in before else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def at_rate(rates: list[float], rate: float) -> int:
    """Clients that got at least 0.95 x rate."""
    return sum(r >= 0.95 * rate for r in rates)


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
                   "--worker-seed", str(args.seed + 100_000 * (i + 1) + 1000 * n),
                   "--worker-first", str(sum(shares[:i])), "--worker-spec", spec]  # fmt: skip
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
    window = args.duration if args.duration > 0 else wall  # what the rates are over
    row: dict = {"clients": n, "client_procs": procs_n, "wall_s": wall, "server_cpu_s": cpu, "client_cpu_s": client_cpu}
    # Held while every client is open and warmed up, before the window: what n open sessions cost the server.
    row |= {f"held_{key}": before[key] for key in ("sessions", "kv_blocks_used", "rss_mb", "cuda_mb") if key in before}
    if args.duration > 0:
        row |= {"duration_s": args.duration, "rate": args.rate or None}
    if args.mode == "generate":
        streams = [s for o in outs for s in o["streams"]]
        tokens = sum(s["tokens"] for s in streams)
        if args.duration > 0:  # per client: its streams one after another over its window (from its first token)
            rates = sorted(s["window_tokens"] / s["window_s"] if s["window_s"] > 0 else 0.0 for s in streams)
            ttft = [t for s in streams for t in s["ttft_s"]]
            gaps = [g for s in streams for g in s["gaps_s"]]
            row |= {"streams": sum(s["streams"] for s in streams), "client_tokens_per_s": rates,
                    "clients_at_rate": at_rate(rates, args.rate) if args.rate else None,
                    "gap_p50_ms": 1e3 * pct(gaps, 0.5), "gap_p99_ms": 1e3 * pct(gaps, 0.99)}  # fmt: skip
            per_stream = statistics.mean(rates)
        else:
            ttft = [s["ttft_s"] for s in streams]
            per_stream = [(s["tokens"] - 1) / s["stream_s"] for s in streams if s["stream_s"] > 0]
            per_stream = statistics.mean(per_stream) if per_stream else None
        return row | {"tokens": tokens, "tokens_per_s": tokens / window, "tokens_per_s_per_stream": per_stream,
                      "ttft_p50_ms": 1e3 * pct(ttft, 0.5), "ttft_p99_ms": 1e3 * pct(ttft, 0.99),
                      "server_cpu_ms_per_token": ratio(cpu_ms, tokens),
                      "client_cpu_ms_per_token": ratio(1e3 * row["client_cpu_s"], tokens)}  # fmt: skip
    clients = [c for o in outs for c in o["clients"]]
    lat = [t for c in clients for t in c["lat_s"]]
    rounds, gained = sum(c["rounds"] for c in clients), sum(c["gained"] for c in clients)
    scored = sum(c["scored"] for c in clients)
    row |= {"rounds": rounds, "rounds_per_s": rounds / window, "scored_tokens_per_s": scored / window,
            "accepted_tokens_per_s": gained / window, "tau": ratio(gained, rounds),
            "p50_ms": 1e3 * pct(lat, 0.5), "p99_ms": 1e3 * pct(lat, 0.99), "max_ms": 1e3 * max(lat, default=nan),
            "mean_batch": ratio(delta(after, before, "tether_batch_size_sum"), batches),
            "server_verify_ms": ratio(1e3 * (delta(after, before, "tether_verify_seconds_sum") or 0),
                                      delta(after, before, "tether_verify_seconds_count")),
            "server_batch_ms": ratio(1e3 * (delta(after, before, "tether_batch_seconds_sum") or 0),
                                     delta(after, before, "tether_batch_seconds_count")),
            "server_cpu_ms_per_round": ratio(cpu_ms, rounds), "gc_collections": delta(after, before, "gc_count"),
            "gc_pause_ms": ratio(delta(after, before, "gc_total_s"), 1e-3),
            "gc_max_pause_ms": 1e3 * after["gc_max_s"] if "gc_max_s" in after else None,
            "client_cpu_ms_per_round": ratio(1e3 * row["client_cpu_s"], rounds)}  # fmt: skip
    # Sessions the server evicted (rounds refused for them, the clients' resyncs) and rounds retried at capacity.
    row |= {key: sum(c[key] for c in clients) for key in ("evicted", "resyncs", "capacity_retries")}
    if "engine" in after:
        row |= sibling("engine_cpu").per_round(after["engine"], before["engine"], rounds, "cuda" not in args.device)
    if args.mode == "trace":
        row |= {"tau_recorded": ratio(sum(c["recorded"] for c in clients), rounds),
                "trace_match": ratio(sum(c["matched"] for c in clients), rounds),
                "reopens": sum(c["reopens"] for c in clients)}  # fmt: skip
    if args.duration > 0:
        rates = sorted(c["gained"] / window for c in clients)
        row |= {"client_tokens_per_s": rates, "clients_at_rate": at_rate(rates, args.rate) if args.rate else None}
    return row


def start_server(args: argparse.Namespace, models: tuple | None = None, server_draft: int = 0):
    """The default models (or --model / --drafter; or `models`: load_models' tuple) served on 127.0.0.1:0 in this
    process; `server_draft` > 0: Generate drafts that many tokens a round here (serve --server-draft)."""
    import torch

    from tether.server.engine_core import Engine
    from tether.server.launch import LaunchPlan, listen
    from tether.server.pool_budget import resolve_kv_pool
    from tether.server.serve_config import ServiceConfig
    from tether.server.service import TetherService

    target, drafter, tok, fp = models or load_models(args)
    most = max(args.clients)
    cuda = target.device.type == "cuda"  # auto --kv-pool-mb: serve's share of the memory free after loading
    pool = resolve_kv_pool(args.kv_pool_mb, device=str(target.device),
                           mem_info=torch.cuda.mem_get_info(target.device) if cuda else None)  # fmt: skip
    print(pool.note, file=sys.stderr, flush=True)
    config = ServiceConfig(max_sessions=args.max_sessions or max(256, 2 * most), max_streams=max(4096, 2 * most),
                           max_new_tokens=max(1024, args.tokens, (args.warmup_rounds + args.rounds) * (args.k + 1)),
                           kv_pool_bytes=pool.bytes,
                           batch_window_s=args.batch_window_ms / 1e3, max_batch=args.max_batch)  # fmt: skip
    # Warmed up and settled as `tether-server serve` does before it listens (--round-graph-tokens k + 1).
    engine = Engine(target, drafter, tok, config, model_fingerprint=fp, round_graph_tokens=args.k + 1,
                    server_draft=server_draft)  # fmt: skip
    engine.warm_up()
    engine.settle()
    service = TetherService(engine)
    server, port = listen(service, "127.0.0.1:0", LaunchPlan(frontends=args.frontends))
    server.start()
    return service, server, port


def stop_server(service, server) -> None:
    """Stop what start_server started; the engine hands its frozen heap back to the collector."""
    server.stop(grace=1).wait(30)
    service.engine.close()


def baseline(rows: list[dict]) -> dict:
    """The row speed-ups are relative to: one client when measured, else the first count."""
    return next((r for r in rows if r["clients"] == 1), rows[0])


def gpu_round_ms(service, args: argparse.Namespace, rows: int = 1, rounds_n: int = 20) -> tuple[float, float] | None:
    """The GPU's own time for a step of `rows` clients' rounds (each a chain of --k random drafts after a
    --prompt-len prompt): the kernels of the batcher's call (the replayed step, the drafter's server part, the
    verdicts' and deltas' copies) summed by torch.profiler, per step; and the call's wall time per step on an
    otherwise idle server. What a one-client round costs beyond the first is the request path's; a loaded server's
    batch time beyond the second is waiting (for the GIL, mostly), and `rows` / the first is what the GPU alone
    allows. None without an in-process CUDA server."""
    if service is None or service.engine.target.device.type != "cuda":
        return None
    import torch
    from torch.profiler import ProfilerActivity, profile

    from tether.server.rounds import verify_batch
    from tether.server.verifier import SequenceVerifier
    from tether.shared.speculative import DraftTree

    e = service.engine
    rng, vocab = random.Random(0), e.target.cfg.vocab_size
    vers = [SequenceVerifier(e.target, e.drafter, capacity=args.prompt_len + (2 * rounds_n + 8) * (args.k + 1),
                             pool=e.pool) for _ in range(rows)]  # fmt: skip
    try:
        roots = [ver.open([rng.randrange(vocab) for _ in range(args.prompt_len)])[0] for ver in vers]

        def one_step() -> None:
            drafts = [[rng.randrange(vocab) for _ in range(args.k)] for _ in vers]
            items = [(v, DraftTree.chain(r, d)) for v, r, d in zip(vers, roots, drafts, strict=True)]
            for i, (verdict, _) in enumerate(verify_batch(service.engine.target, items, host_deltas=True)):
                roots[i] = verdict.bonus

        for _ in range(3):  # any capture outside the profile
            one_step()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(rounds_n):
            one_step()
        wall_ms = (time.perf_counter() - t0) * 1e3 / rounds_n
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(rounds_n):
                one_step()
            torch.cuda.synchronize()
        return sum(e.self_device_time_total for e in prof.key_averages()) / 1e3 / rounds_n, wall_ms
    finally:
        for ver in vers:
            ver.release()


def table(args: argparse.Namespace, rows: list[dict], where: str):
    from rich.table import Table

    def f(x, fmt):
        return "-" if x is None else format(x, fmt)

    if args.mode == "generate":
        prompts = f"recorded prompts of {os.path.basename(args.traces)}" if args.traces else f"prompt {args.prompt_len}"
        timed = f", {args.duration:g} s timed (each client's streams one after another)" if args.duration > 0 else ""
        t = Table(title=f"Generate streams, {args.tokens} tokens each, {prompts}{timed}, {where}")
        cols = ["streams", "tokens/s", "speed-up", "tokens/s per stream", "TTFT p50 / p99 ms",
                "CPU ms/token server / clients", "wall s"]  # fmt: skip
        if args.duration > 0:
            cols[5:5] = ["gap p50 / p99 ms"] + ([f"clients >= {0.95 * args.rate:g} tok/s"] if args.rate > 0 else [])
        for c in cols:
            t.add_column(c, justify="right")
        for r in rows:
            cells = [str(r["clients"]), f(r["tokens_per_s"], ".0f"), f(r["speedup"], ".2f"),
                     f(r["tokens_per_s_per_stream"], ".1f"), f"{r['ttft_p50_ms']:.0f} / {r['ttft_p99_ms']:.0f}",
                     f"{f(r['server_cpu_ms_per_token'], '.2f')} / {f(r['client_cpu_ms_per_token'], '.2f')}",
                     f"{r['wall_s']:.2f}"]  # fmt: skip
            if args.duration > 0:
                cells[5:5] = [f"{r['gap_p50_ms']:.1f} / {r['gap_p99_ms']:.1f}"] + (
                    [f"{r['clients_at_rate']} / {r['clients']}"] if args.rate > 0 else [])  # fmt: skip
            t.add_row(*cells)
        return t
    what = (f"{args.k} random drafts" if args.mode == "random" else
            f"drafts replayed from {os.path.basename(args.traces)}")  # fmt: skip
    timed = (f"{args.duration:g} s timed" if args.duration > 0 else f"{args.rounds} timed rounds per client") + (
        f", clients paced to {args.rate:g} tokens/s" if args.rate > 0 else "")  # fmt: skip
    t = Table(title=f"Session rounds, {what}, prompt {args.prompt_len if args.mode == 'random' else 'as recorded'}, "
              f"{timed}, {where}")  # fmt: skip
    cols = ["clients", "rounds/s", "speed-up", "scored tok/s", "accepted tok/s", "tau", "p50 / p99 ms", "mean batch",
            "server round / batch ms", "CPU ms/round server / clients", "engine CPU us all/host", "wall s"]  # fmt: skip
    if args.mode == "trace":
        cols[6:6] = ["tau recorded", "trace match"]
    if args.duration > 0 and args.rate > 0:
        cols.insert(-1, f"clients >= {0.95 * args.rate:g} tok/s")
    held = any("held_sessions" in r for r in rows)
    if held:
        cols.insert(-1, "sessions held: RSS / CUDA MB")
    gc_seen = any(r.get("gc_collections") is not None for r in rows)
    if gc_seen:
        cols.insert(-1, "GC: n / ms / max ms")
    lost = any(r.get("evicted") or r.get("capacity_retries") for r in rows)  # only when the server ran out
    if lost:
        cols.insert(-1, "evicted / resyncs / retries")
    for c in cols:
        t.add_column(c, justify="right")
    for r in rows:
        cells = [str(r["clients"]), f(r["rounds_per_s"], ".1f"), f(r["speedup"], ".2f"),
                 f(r["scored_tokens_per_s"], ".0f"), f(r["accepted_tokens_per_s"], ".0f"), f(r["tau"], ".2f"),
                 f"{r['p50_ms']:.1f} / {r['p99_ms']:.1f}", f(r["mean_batch"], ".2f"),
                 f"{f(r['server_verify_ms'], '.1f')} / {f(r['server_batch_ms'], '.2f')}",
                 f"{f(r['server_cpu_ms_per_round'], '.1f')} / {f(r['client_cpu_ms_per_round'], '.1f')}",
                 f"{f(r.get('engine_cpu_us_per_round'), '.0f')} / {f(r.get('engine_host_cpu_us_per_round'), '.0f')}",
                 f"{r['wall_s']:.2f}"]  # fmt: skip
        if args.mode == "trace":
            cells[6:6] = [f(r["tau_recorded"], ".2f"), "-" if r["trace_match"] is None else f"{r['trace_match']:.0%}"]
        if args.duration > 0 and args.rate > 0:
            cells.insert(-1, f"{r['clients_at_rate']} / {r['clients']}")
        if held:
            cells.insert(-1, f"{r.get('held_sessions', '-')}: {f(r.get('held_rss_mb'), '.0f')} / "
                             f"{f(r.get('held_cuda_mb'), '.0f')}")  # fmt: skip
        if gc_seen:
            cells.insert(-1, f"{f(r.get('gc_collections'), '.0f')} / {f(r.get('gc_pause_ms'), '.1f')} / "
                             f"{f(r.get('gc_max_pause_ms'), '.1f')}")  # fmt: skip
        if lost:
            cells.insert(-1, f"{r['evicted']} / {r['resyncs']} / {r['capacity_retries']}")
        t.add_row(*cells)
    return t


def add_deployment_options(ap: argparse.ArgumentParser) -> None:
    """Where the server is and how the clients reach it: the options bench/capacity.py shares."""
    ap.add_argument("--channels", type=int, default=0, help="connections per client process; 0: one per client")
    ap.add_argument("--client-procs", type=int, default=1, help="client processes the clients are spread over")
    ap.add_argument("--target", default="", help="HOST:PORT of a running server instead of one in this process")
    ap.add_argument("--metrics-url", default="", help="with --target: its Prometheus endpoint (batch size)")
    ap.add_argument("--device", default="", help="in-process server: cpu / cuda (default: cuda when present)")
    ap.add_argument("--model", default="", help="in-process server: target directory (default: deploy/models/target)")
    ap.add_argument("--drafter", default="", help="in-process server: drafter directory (default: the shipped one)")
    ap.add_argument("--kv-pool-mb", type=int, default=0, help="in-process server: KV pool size in MB; 0: auto, as "
                    "serve's (tether.server.pool_budget: half the free GPU memory, 256 MB on the CPU)")  # fmt: skip


def parser() -> argparse.ArgumentParser:
    from tether.server.serve_config import ServiceConfig  # the in-process server's defaults

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", default="random", choices=["random", "trace", "generate"])
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 32, 128], help="client counts, run in turn")
    ap.add_argument("--rounds", type=int, default=50, help="random / trace: timed rounds per client")
    ap.add_argument("--warmup-rounds", type=int, default=2, help="random / trace: untimed rounds per client first")
    ap.add_argument("--k", type=int, default=5, help="random: draft tokens per round (k + 1 scored with the root)")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=200, help="generate: tokens per stream")
    ap.add_argument("--traces", default="", help="trace: the recorded drafts (bench/traces.py; recorded there first "
                    "when missing, with an in-process server); generate: the prompts come from it")  # fmt: skip
    ap.add_argument("--record-traces", default="", metavar="FILE", help="record --prompts traces to FILE and stop")
    ap.add_argument("--prompts", type=int, default=32, help="recording: standard-library prompts (of --prompt-len)")
    ap.add_argument("--trace-tokens", type=int, default=256, help="recording: tokens generated per prompt")
    ap.add_argument("--duration", type=float, default=0.0,
                    help="seconds timed per client count instead of --rounds / --tokens per client")  # fmt: skip
    ap.add_argument("--rate", type=float, default=0.0, help="random / trace: each client paces itself to RATE "
                    "tokens/s (accepted + 1 a round); with --duration, rows count clients at 0.95 x RATE")  # fmt: skip
    add_deployment_options(ap)
    ap.add_argument(
        "--batch-window-ms",
        type=float,
        default=ServiceConfig.batch_window_s * 1e3,
        help="in-process server: the batcher's extra wait before a step (0: continuous batching)",
    )
    ap.add_argument(
        "--max-batch", type=int, default=ServiceConfig.max_batch, help="in-process server: rounds per step at most"
    )
    ap.add_argument("--max-sessions", type=int, default=0, help="in-process server: sessions held (past it the least "
                    "recently used idle one is evicted); 0: max(256, 2 x the most --clients)")  # fmt: skip
    ap.add_argument("--frontends", type=int, default=0,
                    help="in-process server: gRPC in this many front-end processes (serve --frontends)")  # fmt: skip
    ap.add_argument("--rtt-ms", type=float, default=0.0, help="a round trip each client adds to every round (after "
                    "its verdict) and before each Generate stream: a sleep, as a link would (no netsim)")  # fmt: skip
    ap.add_argument("--rpc-timeout", type=float, default=60.0, help="seconds per message / unary call")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per client count, all included")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--worker", default="", help=argparse.SUPPRESS)  # the client process: the server's address
    ap.add_argument("--worker-clients", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--worker-seed", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--worker-first", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--worker-spec", default="", help=argparse.SUPPRESS)
    return ap


def load_models(args: argparse.Namespace):
    """The default models (or --model / --drafter) on --device: target, drafter, tokenizer, target fingerprint."""
    import torch

    from tether.server.model_loading import default_model_dir, load
    from tether.shared.checkpoint import fingerprint
    from tether.shared.drafter_loading import load_drafter

    torch.set_grad_enabled(False)
    args.model = args.model or str(default_model_dir())
    args.drafter = args.drafter or str(default_model_dir("drafter"))
    fp = fingerprint(args.model)
    target, tok = load(args.model, args.device)
    return target, load_drafter(args.drafter, target, target_fingerprint=fp), tok, fp


def record_traces(args: argparse.Namespace, path: str, target, drafter, tok, fp: str) -> dict:
    """Record --prompts traces (bench/traces.py) with the given models and save them to `path`."""
    traces = sibling("traces")

    def progress(i: int, n: int) -> None:
        print(f"\rrecording draft traces: {i} / {n} prompts", end="\n" if i == n else "", file=sys.stderr, flush=True)

    rec = traces.record(target, drafter, tok, prompts=args.prompts, prompt_len=args.prompt_len,
                        tokens=args.trace_tokens, k=args.k, target_fingerprint=fp, drafter_dir=args.drafter,
                        progress=progress)  # fmt: skip
    traces.save(path, rec)
    return rec


def main(argv: list[str] | None = None) -> dict:
    args = parser().parse_args(argv)
    if args.worker:
        spec = argparse.Namespace(**{**json.loads(args.worker_spec), "worker": args.worker})
        recorded = sibling("traces").load(spec.traces) if spec.traces else {}
        asyncio.run(clients().client_process(spec, args.worker_clients, args.worker_seed, args.worker_first, recorded))
        return {}
    if min(args.clients) < 1 or args.rounds < 1 or args.k < 1 or args.prompt_len < 1 or args.tokens < 2:
        raise SystemExit("--clients, --rounds, --k and --prompt-len must be at least 1, --tokens at least 2")
    if args.duration < 0 or args.rate < 0:
        raise SystemExit("--duration and --rate cannot be negative")
    import torch
    from rich.console import Console

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    traces = sibling("traces")
    if args.record_traces:
        rec = record_traces(args, args.record_traces, *load_models(args))
        out = {"bench": "traces", "file": args.record_traces, **{k: v for k, v in rec.items() if k != "traces"},
               **traces.summary(rec)}  # fmt: skip
        print(json.dumps(out))
        return out
    if args.mode == "trace" and not args.traces:
        raise SystemExit("--mode trace needs --traces FILE (record one with --record-traces FILE)")
    service = server = None
    if args.target:
        address, device = args.target, f"server at {args.target}"
    else:
        service, server, port = start_server(args)
        address = f"127.0.0.1:{port}"
        device = torch.cuda.get_device_name() if args.device.startswith("cuda") else f"cpu ({os.cpu_count()} cores)"
    probe = ServerProbe(service, args.metrics_url, server)
    rows = []
    try:
        if args.traces and not os.path.exists(args.traces):
            if service is None:
                raise SystemExit(f"{args.traces} does not exist (record it with --record-traces)")
            record_traces(args, args.traces, service.engine.target, service.engine.drafter, service.engine.tokenizer,
                          service.engine.model_fingerprint)  # fmt: skip
        recorded = traces.load(args.traces) if args.traces else None
        with probe:
            for n in args.clients:
                rows.append(measure(args, address, n, probe))
        gpu_ms = gpu_round_ms(service, args) if args.mode == "random" else None
        full = max((round(r["mean_batch"]) for r in rows), default=0) if gpu_ms is not None else 0
        gpu_full = gpu_round_ms(service, args, rows=full) if full > 1 else None
    finally:
        if server is not None:
            stop_server(service, server)
    speed = "tokens_per_s" if args.mode == "generate" else "rounds_per_s"
    for r in rows:
        r["speedup"] = ratio(r[speed], baseline(rows)[speed])
    where = f"{device}, in-process server" if service is not None else device
    Console(width=200).print(table(args, rows, where))
    record = {"bench": "server", "mode": args.mode, "device": device, "host": platform.node(),
              "cpus": len(os.sched_getaffinity(0)), "torch": torch.__version__, "grpcio": grpc.__version__,
              "args": {k: v for k, v in vars(args).items() if not k.startswith("worker")}, "rows": rows}  # fmt: skip
    if recorded:
        record["traces"] = {k: v for k, v in recorded.items() if k != "traces"} | traces.summary(recorded)
    if gpu_ms is not None:
        one = baseline(rows)
        record["gpu_round_ms"], record["idle_round_wall_ms"] = gpu_ms
        print(
            f"GPU time of one client's round (kernels, torch.profiler): {gpu_ms[0]:.3f} ms; the "
            f"{one['clients']}-client p50 is {one['p50_ms'] - gpu_ms[0]:.2f} ms above it"
        )
    if gpu_full is not None:
        record["gpu_step_rows"] = full
        record["gpu_step_ms"], record["idle_step_wall_ms"] = gpu_full
        print(
            f"A step of {full} rounds (the largest mean batch) on the idle server: GPU {gpu_full[0]:.3f} ms, the "
            f"batcher's call {gpu_full[1]:.3f} ms wall; the GPU alone allows {full / gpu_full[0] * 1e3:,.0f} rounds/s"
        )
    print(json.dumps(record))
    return record


if __name__ == "__main__":
    main()
