"""Capacity: how many clients one server sustains at a per-client token rate, with edge drafting and server-only
(issue [3/7], the request path: the headline figure of edge drafting).

Both modes run bench/server.py's machinery (its in-process server, or `--target HOST:PORT`, and its client
processes over real gRPC), against the same server, over a timed window of `--duration` seconds:
- edge: trace-replay Session clients (bench/server.py --mode trace; drafts the default drafter proposed on real
  prompts, `--traces FILE`, recorded first when the file does not exist), each pacing itself to `--rate` tokens/s:
  after a verdict that gave tau tokens it waits until its token budget at --rate allows the next round. The
  drafting itself costs the server nothing: it happened on the edge, at recording time.
- server-only: Generate streams (greedy plain decoding on the server) of the traces' prompts, `--tokens` each
  (default: the traces' length), one after another per client; each client counts the tokens it received.
  A stream cannot be paced from the client (the server decodes ahead of the reader), so these run flat out.

"Sustains N": over the window at least `--share` (default 0.95) of the N clients (rounded up: all of them below 20
clients) each got >= 0.95 x --rate tokens/s. N is searched by doubling from 1 up to `--max-clients` until a count
fails, then bisected between the last pass and the first failure until the gap is at most 1/8 of the last pass
(`--no-bisect`: doubling only). A count whose run fails outright (a server error, a timeout) fails. Saturation:
total tokens/s with N = --max-clients clients unpaced (edge: accepted + bonus tokens; server-only: streamed
tokens). Latency: at the largest count sustained, p50 / p99 of edge rounds (write to verdict) and of the gaps
between a server-only stream's messages (a message carries every token decoded since the last one).

Prints a table (mode, clients sustained at the rate, tokens/s at saturation, p50 / p99 latency), the ratio
sustained(edge) / sustained(server-only), then one JSON line.

    python bench/capacity.py --device cpu --rate 20 --max-clients 64 --traces traces.json --prompts 32
    python bench/capacity.py --rate 20 --max-clients 1024 --traces traces.json     # CUDA when present
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

MODES = {"edge": "trace", "server-only": "generate"}  # capacity mode -> bench/server.py --mode


def load_server():
    """bench/server.py as a module (bench/ is no package)."""
    if "tether_bench_server" not in sys.modules:
        path = Path(__file__).resolve().parent / "server.py"
        spec = importlib.util.spec_from_file_location("tether_bench_server", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules["tether_bench_server"] = module
        spec.loader.exec_module(module)
    return sys.modules["tether_bench_server"]


def sustained(row: dict, share: float) -> bool:
    """Whether a paced run delivered the rate: at least ceil(share x N) clients at 0.95 x rate or more."""
    n = row["clients"]
    return "error" not in row and row["clients_at_rate"] >= math.ceil(share * n - 1e-9)


def probe_summary(mode: str, row: dict, share: float | None) -> dict:
    """The part of a bench/server.py row the capacity record keeps."""
    if "error" in row:
        return row | ({"sustained": False} if share is not None else {})
    edge = mode == "edge"
    rates = row["client_tokens_per_s"]
    out = {"clients": row["clients"], "tokens_per_s": row["accepted_tokens_per_s" if edge else "tokens_per_s"],
           "client_min_tokens_per_s": min(rates), "client_median_tokens_per_s": rates[len(rates) // 2],
           "p50_ms": row["p50_ms" if edge else "gap_p50_ms"], "p99_ms": row["p99_ms" if edge else "gap_p99_ms"],
           "wall_s": row["wall_s"]}  # fmt: skip
    if edge:
        out |= {"tau": row["tau"], "trace_match": row["trace_match"], "mean_batch": row["mean_batch"]}
    else:
        out |= {"ttft_p50_ms": row["ttft_p50_ms"], "ttft_p99_ms": row["ttft_p99_ms"]}
    if share is not None:
        out |= {"clients_at_rate": row["clients_at_rate"], "sustained": sustained(row, share)}
    return out


class Capacity:
    def __init__(self, args: argparse.Namespace, server, address: str, probe, tokens: int):
        self.args, self.server, self.address, self.probe, self.tokens = args, server, address, probe, tokens

    def bench_args(self, mode: str, n: int, rate: float) -> argparse.Namespace:
        """bench/server.py's arguments for one run (its parser, so its defaults and checks)."""
        a = self.args
        argv = ["--mode", MODES[mode], "--clients", str(n), "--duration", str(a.duration), "--rate", str(rate),
                "--traces", a.traces, "--tokens", str(self.tokens), "--warmup-rounds", str(a.warmup_rounds),
                "--channels", str(a.channels), "--client-procs", str(a.client_procs), "--timeout", str(a.timeout),
                "--rpc-timeout", str(a.rpc_timeout), "--seed", str(a.seed)]  # fmt: skip
        return self.server.parser().parse_args(argv)

    def run(self, mode: str, n: int, rate: float) -> dict:
        t0 = time.perf_counter()
        try:
            row = self.server.measure(self.bench_args(mode, n, rate), self.address, n, self.probe)
        except (RuntimeError, TimeoutError, OSError) as e:  # the client process failed: a server error, a timeout
            row = {"clients": n, "error": f"{type(e).__name__}: {e}"}
        paced = rate > 0
        s = probe_summary(mode, row, self.args.share if paced else None)
        verdict = ("sustained" if s["sustained"] else "not sustained") if paced else "unpaced"
        detail = s.get("error") or (f"{s.get('clients_at_rate', '-')} / {n} at rate, {s['tokens_per_s']:.0f} tok/s, "
                                    f"slowest client {s['client_min_tokens_per_s']:.1f} tok/s")  # fmt: skip
        print(f"{mode}: {n} clients, {verdict} ({detail}; {time.perf_counter() - t0:.0f} s)", file=sys.stderr,
              flush=True)  # fmt: skip
        return s

    def search(self, mode: str) -> dict:
        """Clients sustained at --rate: doubling from 1 to --max-clients, then bisection (see the docstring)."""
        a = self.args
        probes: list[dict] = []

        def ok(n: int) -> bool:
            probes.append(self.run(mode, n, a.rate))
            return probes[-1]["sustained"]

        passed, failed, n = 0, None, 1
        while True:
            if not ok(n):
                failed = n
                break
            passed = n
            if n >= a.max_clients:
                break
            n = min(2 * n, a.max_clients)
        if a.bisect and failed is not None:
            while failed - passed > max(1, passed // 8):
                mid = (passed + failed) // 2
                if ok(mid):
                    passed = mid
                else:
                    failed = mid
        at = next((p for p in probes if p["clients"] == passed), None)
        saturation = self.run(mode, a.max_clients, 0.0)
        return {"sustained": passed, "first_failed": failed, "at_sustained": at, "saturation": saturation,
                "probes": sorted(probes, key=lambda p: p["clients"])}  # fmt: skip


def table(args: argparse.Namespace, results: dict, where: str, traces: dict):
    from rich.table import Table

    def f(x, fmt):
        return "-" if x is None else format(x, fmt)

    t = Table(title=f"Clients one server sustains at {args.rate:g} tokens/s each ({args.share:.0%} of them at "
              f">= {0.95 * args.rate:g} tok/s over {args.duration:g} s), saturation with {args.max_clients} clients "
              f"unpaced; drafts replayed from {traces['prompts']} standard-library prompts (recorded tau "
              f"{traces['tau']:.2f}); {where}")  # fmt: skip
    cols = ("mode", "clients sustained", "tokens/s at saturation", "per client at saturation",
            "p50 / p99 ms at sustained", "latency of", "tau at sustained", "runs")  # fmt: skip
    for c in cols:
        t.add_column(c, justify="right")
    for mode, r in results.items():
        at, sat = r["at_sustained"], r["saturation"]
        most = r["sustained"] >= args.max_clients
        lat = "-" if at is None else f"{at['p50_ms']:.1f} / {at['p99_ms']:.1f}"
        sat_tps = sat.get("tokens_per_s")
        t.add_row(mode, (">= " if most else "") + str(r["sustained"]), f(sat_tps, ".0f"),
                  f(None if sat_tps is None else sat_tps / sat["clients"], ".1f"), lat,
                  "rounds" if mode == "edge" else "stream messages",
                  f(at.get("tau") if at else None, ".2f"), str(len(r["probes"]) + 1))  # fmt: skip
    return t


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", type=float, default=20.0, help="tokens/s each client needs")
    ap.add_argument("--max-clients", type=int, default=64, help="the largest count searched, and the saturation run's")
    ap.add_argument("--duration", type=float, default=10.0, help="seconds timed per run")
    ap.add_argument("--share", type=float, default=0.95, help="share of clients that must get 0.95 x --rate")
    ap.add_argument("--no-bisect", dest="bisect", action="store_false", help="doubling only")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--traces", default="traces.json", help="recorded drafts (recorded here first when missing)")
    ap.add_argument("--prompts", type=int, default=32, help="recording: standard-library prompts")
    ap.add_argument("--prompt-len", type=int, default=256, help="recording: prompt tokens")
    ap.add_argument("--trace-tokens", type=int, default=256, help="recording: tokens generated per prompt")
    ap.add_argument("--k", type=int, default=5, help="recording: draft tokens per round")
    ap.add_argument("--tokens", type=int, default=0, help="server-only: tokens per stream (0: the traces' length)")
    ap.add_argument("--warmup-rounds", type=int, default=2, help="edge: untimed rounds per client first")
    load_server().add_deployment_options(ap)
    ap.add_argument("--frontends", type=int, default=0,
                    help="in-process server: gRPC in this many front-end processes (serve --frontends)")  # fmt: skip
    ap.add_argument("--rpc-timeout", type=float, default=60.0, help="seconds per message / unary call")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per run, all included")
    ap.add_argument("--seed", type=int, default=0)
    return ap


def main(argv: list[str] | None = None) -> dict:
    args = parser().parse_args(argv)
    if args.rate <= 0 or args.max_clients < 1 or args.duration <= 0 or not 0 < args.share <= 1:
        raise SystemExit("--rate and --duration must be positive, --max-clients at least 1, --share in (0, 1]")
    import grpc
    import torch
    from rich.console import Console

    server = load_server()
    # The in-process server's settings: bench/server.py's parser (and defaults), sized for --max-clients.
    sargv = ["--clients", str(args.max_clients), "--prompt-len", str(args.prompt_len), "--k", str(args.k),
             "--prompts", str(args.prompts), "--trace-tokens", str(args.trace_tokens), "--kv-pool-mb",
             str(args.kv_pool_mb), "--device", args.device, "--model", args.model,
             "--drafter", args.drafter, "--frontends", str(args.frontends)]  # fmt: skip
    sargs = server.parser().parse_args(sargv)
    sargs.device = sargs.device or ("cuda" if torch.cuda.is_available() else "cpu")
    service = rpc = None
    if args.target:
        address, where = args.target, f"server at {args.target}"
    else:
        service, rpc, port = server.start_server(sargs)
        address = f"127.0.0.1:{port}"
        where = torch.cuda.get_device_name() if sargs.device.startswith("cuda") else f"cpu ({os.cpu_count()} cores)"
        where += ", in-process server"
    traces = server.sibling("traces")
    try:
        if not os.path.exists(args.traces):
            if service is None:
                raise SystemExit(f"{args.traces} does not exist (record it with bench/server.py --record-traces)")
            e = service.engine
            server.record_traces(sargs, args.traces, e.target, e.drafter, e.tokenizer, e.model_fingerprint)
        recorded = traces.load(args.traces)
        tokens = args.tokens or recorded["tokens"]
        with server.ServerProbe(service, args.metrics_url, rpc) as probe:
            cap = Capacity(args, server, address, probe, tokens)
            results = {mode: cap.search(mode) for mode in args.modes}
    finally:
        if rpc is not None:
            server.stop_server(service, rpc)
    summary = {k: v for k, v in recorded.items() if k != "traces"} | traces.summary(recorded)
    Console(width=200).print(table(args, results, where, summary))
    edge, plain = (results.get(m, {}).get("sustained") for m in ("edge", "server-only"))
    ratio = edge / plain if edge is not None and plain else None
    if edge is not None and plain is not None:
        print(f"sustained at {args.rate:g} tokens/s: edge / server-only = {edge} / {plain}"
              + (f" = {ratio:.2f}x" if ratio else " (server-only sustains none)"))  # fmt: skip
    record = {"bench": "capacity", "device": where, "host": platform.node(), "cpus": len(os.sched_getaffinity(0)),
              "torch": torch.__version__, "grpcio": grpc.__version__, "args": vars(args), "tokens_per_stream": tokens,
              "traces": summary, "modes": results, "ratio": ratio}  # fmt: skip
    print(json.dumps(record))
    return record


if __name__ == "__main__":
    main()
