"""Capacity: how many users one server sustains at a per-user token rate, per mode (issues [3/7] and #45: the
headline figure of edge drafting, at a real model's shape and acceptance).

Every mode runs bench/server.py's machinery (its in-process server, or `--target HOST:PORT`, and its client
processes over real gRPC) over a timed window of `--duration` seconds, each client adding `--rtt-ms` to every
round and to each stream's start (bench/server.py --rtt-ms: a sleep, as a link would; no netsim):
- hybrid: Session clients sending drafts, each paced to the rate (after a verdict that gave tau tokens it waits
  until its token budget at the rate allows the next round), one round in flight. The drafting costs the server
  nothing: it happened on the edge. Their drafts and acceptance are either
  - replayed (`--acceptance FILE`, always with `--preset`): chains of --k random draft tokens whose verdicts the
    server is forced to give an accepted length drawn from a histogram recorded from a trained target on held-out
    prompts (bench/forced_acceptance.py; the file is bench/traces.py's `record_acceptance`, recorded first when
    missing with --model / --drafter on --prompt-file); each session reopens on a new random prompt after
    --session-rounds rounds; or
  - traced (the default without --preset): drafts the default drafter proposed on real prompts, `--traces FILE`
    (recorded first when missing), replayed against the same target, so acceptance is real (bench/traces.py).
- server-only: Generate streams (greedy plain decoding on the server), `--tokens` each (default: the traces'
  length, 256 replayed), one after another per client. A stream cannot be paced from the client (the server decodes
  ahead of the reader), so these run flat out; the round trip delays only each stream's start.
- server-draft: the same Generate streams from a second server that drafts for itself (`serve --server-draft`,
  k = --k, its drafter's cost real; with --acceptance its verdicts forced the same way): the datacenter's baseline.
  In this process only, after the first server is stopped (its models reused).
- auto (not run: derived): the adaptive client (tether.client.mode_choice) streams or drafts, whichever gives it
  more; where every user measures the same, all of them settle on the better of hybrid and server-only, so auto
  sustains max(hybrid, server-only) and the record names the pick. A population that splits is not measured.

bench/acceptance-compact.json is such a file: the shipped default pair (deploy/models: the 19M compact target and
its MoA drafter), 64 held-out prompts x 128 greedy tokens, k = 5, float32 on a CPU: tau 4.68 (63% of the rounds
accept all 5 drafts: greedy continuations of a small model repeat themselves, so this likely overstates what an 8B
pair accepts). bench/acceptance-86m.json: the trained 86M pair (deploy/models/README.md's `medium` recipe, its MoA TLI 4
drafter), the same prompts and k, bf16 on an H100: tau 4.92 (69% of the rounds accept all 5).

`--preset NAME` (llama3-1b, llama3-8b, any of tether.shared.config.PRESETS; `--layers` keeps fewer) serves a target
of those shapes with seeded random weights (a verify step's cost depends on shapes, not values) and a MoA drafter
of --drafter's config built for it with random weights; the tokenizer is --model's (its ids fit the vocabulary).

"Sustains N": over the window at least `--share` (default 0.95) of the N clients (rounded up: all of them below 20
clients) each got >= 0.95 x the rate. Per mode, RTT and rate (every one of `--rtt-ms` x `--rate`), N is searched
by doubling from a start (`--start-clients`, 1, for a mode's first rate; after that the count sustained at the rate
before, scaled by the rates' ratio) up to `--max-clients`, or halving down when the start fails, then bisected
between the last pass and the first failure until the gap is at most 1/8 of the last pass (`--no-bisect`: doubling
only). A count whose run fails outright (a server error, a timeout) fails. Streamed modes do not depend on the
round trip but for each stream's start: they are searched at the first RTT only, and the record says so
(`measured_rtt_ms`). Saturation (`--saturation`): total tokens/s with --max-clients clients unpaced, once per mode
at the first RTT. Latency: at the largest count sustained, p50 / p99 of hybrid rounds (write to verdict, the RTT
included) and of the gaps between a stream's messages.

Prints a compact table (users sustained per mode by RTT and rate, hybrid / server-only, auto's pick), then one JSON
line; `--plot FILE` draws users per GPU against per-user tokens/s, one line per mode, a panel per RTT. `--merge
FILE...` reads the output of several runs (a mode or an RTT each, to keep each run short) and prints, plots and
records them as one, auto and the ratios recomputed.

    python bench/capacity.py --device cpu --rate 20 --rtt-ms 50 --max-clients 64 --traces traces.json --prompts 32
    python bench/capacity.py --preset llama3-8b --acceptance bench/acceptance-compact.json --rate 10 20 40 \
        --rtt-ms 50 --max-clients 512 > cap-8b-50.txt
    python bench/capacity.py --preset llama3-8b --acceptance bench/acceptance-compact.json --modes server-only \
        --rate 10 20 40 --rtt-ms 50 10 150 --max-clients 512 > cap-8b-streams.txt
    python bench/capacity.py --merge cap-8b-*.txt --plot cap-8b.png
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import importlib.util
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HYBRID, SERVER_ONLY, SERVER_DRAFT, AUTO = "hybrid", "server-only", "server-draft", "auto"
RUN_MODES = (HYBRID, SERVER_ONLY, SERVER_DRAFT)  # what runs; AUTO is derived from two of them
STREAMED = (SERVER_ONLY, SERVER_DRAFT)
REPLAYED_TOKENS = 256  # a stream's tokens when no traces give their length


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
    rounds = mode == HYBRID
    rates = row["client_tokens_per_s"]
    out = {"clients": row["clients"], "tokens_per_s": row["accepted_tokens_per_s" if rounds else "tokens_per_s"],
           "client_min_tokens_per_s": min(rates), "client_median_tokens_per_s": rates[len(rates) // 2],
           "p50_ms": row["p50_ms" if rounds else "gap_p50_ms"], "p99_ms": row["p99_ms" if rounds else "gap_p99_ms"],
           "wall_s": row["wall_s"]}  # fmt: skip
    if rounds:
        out |= {"tau": row["tau"], "trace_match": row.get("trace_match"), "mean_batch": row["mean_batch"]}
    else:
        out |= {"ttft_p50_ms": row["ttft_p50_ms"], "ttft_p99_ms": row["ttft_p99_ms"]}
    if share is not None:
        out |= {"clients_at_rate": row["clients_at_rate"], "sustained": sustained(row, share)}
    return out


class Capacity:
    """The searches against one server (`address`); `replayed`: hybrid rounds are random drafts whose verdicts
    the server is forced to replay (else the --traces file's drafts)."""

    def __init__(self, args: argparse.Namespace, server, address: str, probe, tokens: int, replayed: bool):
        self.args, self.server, self.address, self.probe, self.tokens = args, server, address, probe, tokens
        self.replayed = replayed

    def bench_args(self, mode: str, n: int, rate: float, rtt_ms: float) -> argparse.Namespace:
        """bench/server.py's arguments for one run (its parser, so its defaults and checks)."""
        a = self.args
        kind = "generate" if mode in STREAMED else "random" if self.replayed else "trace"
        argv = ["--mode", kind, "--clients", str(n), "--duration", str(a.duration), "--rate", str(rate),
                "--tokens", str(self.tokens), "--warmup-rounds", str(a.warmup_rounds), "--k", str(a.k),
                "--prompt-len", str(a.prompt_len), "--rounds", str(a.session_rounds), "--rtt-ms", str(rtt_ms),
                "--channels", str(a.channels), "--client-procs", str(a.client_procs), "--timeout", str(a.timeout),
                "--rpc-timeout", str(a.rpc_timeout), "--seed", str(a.seed)]  # fmt: skip
        if not self.replayed:
            argv += ["--traces", a.traces]
        return self.server.parser().parse_args(argv)

    def run(self, mode: str, n: int, rate: float, rtt_ms: float) -> dict:
        t0 = time.perf_counter()
        try:
            row = self.server.measure(self.bench_args(mode, n, rate, rtt_ms), self.address, n, self.probe)
        except (RuntimeError, TimeoutError, OSError) as e:  # the client process failed: a server error, a timeout
            row = {"clients": n, "error": f"{type(e).__name__}: {e}"}
        paced = rate > 0
        s = probe_summary(mode, row, self.args.share if paced else None)
        verdict = ("sustained" if s["sustained"] else "not sustained") if paced else "unpaced"
        detail = s.get("error") or (f"{s.get('clients_at_rate', '-')} / {n} at rate, {s['tokens_per_s']:.0f} tok/s, "
                                    f"slowest client {s['client_min_tokens_per_s']:.1f} tok/s")  # fmt: skip
        print(f"{mode} at {rate:g} tok/s, RTT {rtt_ms:g} ms: {n} clients, {verdict} ({detail}; "
              f"{time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)  # fmt: skip
        return s

    def search(self, mode: str, rate: float, rtt_ms: float, start: int = 1) -> dict:
        """Clients sustained at `rate`: doubling up from `start` (or halving down from it when it fails), then
        bisection (see the module docstring)."""
        a = self.args
        probes: list[dict] = []

        def ok(n: int) -> bool:
            probes.append(self.run(mode, n, rate, rtt_ms))
            return probes[-1]["sustained"]

        n = max(1, min(start, a.max_clients))
        if ok(n):
            passed, failed = n, None
            while passed < a.max_clients:
                n = min(2 * passed, a.max_clients)
                if not ok(n):
                    failed = n
                    break
                passed = n
        else:
            passed, failed = 0, n
            while failed > 1:
                n = failed // 2
                if ok(n):
                    passed = n
                    break
                failed = n
        if a.bisect and failed is not None:
            while failed - passed > max(1, passed // 8):
                mid = (passed + failed) // 2
                if ok(mid):
                    passed = mid
                else:
                    failed = mid
        at = next((p for p in probes if p["clients"] == passed), None)
        return {"mode": mode, "rate": rate, "rtt_ms": rtt_ms, "measured_rtt_ms": rtt_ms, "sustained": passed,
                "first_failed": failed, "at_sustained": at,
                "probes": sorted(probes, key=lambda p: p["clients"])}  # fmt: skip

    def cells(self, modes: list[str]) -> tuple[list[dict], dict]:
        """Every (mode, RTT, rate) search of `modes` against this server (streamed modes at the first RTT, copied
        to the others), and each mode's saturation run (--saturation)."""
        a = self.args
        cells, saturation = [], {}
        for mode in modes:
            rtts = a.rtt_ms[:1] if mode in STREAMED else a.rtt_ms
            for rtt in rtts:
                start, last = a.start_clients, None
                for rate in a.rate:
                    if last is not None:  # the count sustained at the rate before, scaled to this one
                        start = max(1, round(last["sustained"] * last["rate"] / rate))
                    last = self.search(mode, rate, rtt, start)
                    cells.append(last)
            if mode in STREAMED:
                cells += [c | {"rtt_ms": rtt} for rtt in a.rtt_ms[1:] for c in cells if c["mode"] == mode
                          and c["rtt_ms"] == a.rtt_ms[0]]  # fmt: skip
            if a.saturation:
                saturation[mode] = self.run(mode, a.max_clients, 0.0, a.rtt_ms[0])
        return cells, saturation


def with_auto(cells: list[dict]) -> list[dict]:
    """The cells plus auto's, per (RTT, rate): the better of hybrid and server-only (the module docstring), with
    `picks` naming it (hybrid on a tie: it also writes offline); none where either is missing."""
    out = list(cells)
    by = {(c["mode"], c["rtt_ms"], c["rate"]): c for c in cells}
    for (mode, rtt, rate), hybrid in list(by.items()):
        plain = by.get((SERVER_ONLY, rtt, rate))
        if mode != HYBRID or plain is None:
            continue
        best = hybrid if hybrid["sustained"] >= plain["sustained"] else plain
        out.append({"mode": AUTO, "rate": rate, "rtt_ms": rtt, "sustained": best["sustained"], "picks": best["mode"],
                    "derived": True})  # fmt: skip
    return out


def ratios(cells: list[dict]) -> list[dict]:
    """hybrid / server-only users sustained per (RTT, rate) (None where server-only sustains none)."""
    by = {(c["mode"], c["rtt_ms"], c["rate"]): c["sustained"] for c in cells}
    return [{"rtt_ms": rtt, "rate": rate, "hybrid_over_server_only": h / by[(SERVER_ONLY, rtt, rate)]
             if by.get((SERVER_ONLY, rtt, rate)) else None}
            for (mode, rtt, rate), h in by.items() if mode == HYBRID]  # fmt: skip


def table(args: argparse.Namespace, cells: list[dict], where: str, acceptance: str):
    """Users sustained per mode, a row per (RTT, rate): the ten-second read."""
    from rich.table import Table

    modes = list(dict.fromkeys(c["mode"] for c in cells))
    t = Table(title=f"Users one server sustains at a per-user rate ({args.share:.0%} of them at >= 0.95 x the rate "
              f"over {args.duration:g} s); {acceptance}; {where}")  # fmt: skip
    for c in ("RTT ms", "tok/s per user", *modes, "hybrid / server-only", "auto picks"):
        t.add_column(c, justify="right")
    by = {(c["mode"], c["rtt_ms"], c["rate"]): c for c in cells}
    for rtt in args.rtt_ms:
        for rate in args.rate:
            row = [by.get((m, rtt, rate)) for m in modes]
            h, s = by.get((HYBRID, rtt, rate)), by.get((SERVER_ONLY, rtt, rate))
            ratio = f"{h['sustained'] / s['sustained']:.2f}x" if h and s and s["sustained"] else "-"
            auto = by.get((AUTO, rtt, rate))
            t.add_row(f"{rtt:g}", f"{rate:g}", *(_users(args, c) for c in row), ratio, auto["picks"] if auto else "-")
    return t


def _users(args: argparse.Namespace, cell: dict | None) -> str:
    if cell is None:
        return "-"
    return (">= " if cell["sustained"] >= args.max_clients else "") + str(cell["sustained"])


def plot(args: argparse.Namespace, cells: list[dict], path: Path, title: str) -> bool:
    """Users per GPU against per-user tokens/s, one line per mode, a panel per RTT (False without matplotlib)."""
    try:
        import matplotlib
    except ImportError:
        print(f"matplotlib is not installed: no plot written to {path}", file=sys.stderr)
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(dict.fromkeys(c["mode"] for c in cells))
    fig, axes = plt.subplots(1, len(args.rtt_ms), figsize=(4.6 * len(args.rtt_ms) + 1, 4.4), sharey=True,
                             squeeze=False, layout="constrained")  # fmt: skip
    for ax, rtt in zip(axes[0], args.rtt_ms, strict=True):
        for i, mode in enumerate(modes):
            mine = sorted((c for c in cells if c["mode"] == mode and c["rtt_ms"] == rtt), key=lambda c: c["rate"])
            style = {"linestyle": ":", "marker": "x"} if mode == AUTO else {"marker": "o"}
            ax.plot([c["rate"] for c in mine], [max(c["sustained"], 0.5) for c in mine], color=f"C{i}", label=mode,
                    **style)  # fmt: skip
        ax.set_title(f"RTT {rtt:g} ms")
        ax.set_xlabel("tokens / s per user")
        ax.set_yscale("log", base=2)
        ax.grid(alpha=0.3, which="both")
    axes[0][0].set_ylabel("users per GPU (sustained)")
    fig.suptitle(title, fontsize="small")
    fig.legend(*axes[0][0].get_legend_handles_labels(), loc="outside lower center", ncol=len(modes), fontsize="small")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", type=float, nargs="+", default=[10.0, 20.0, 40.0], help="tokens/s each user needs")
    ap.add_argument("--rtt-ms", type=float, nargs="+", default=[10.0, 50.0, 150.0], help="each user's round trip")
    ap.add_argument("--max-clients", type=int, default=64, help="the largest count searched, and the saturation run's")
    ap.add_argument("--duration", type=float, default=10.0, help="seconds timed per run")
    ap.add_argument("--share", type=float, default=0.95, help="share of clients that must get 0.95 x the rate")
    ap.add_argument("--start-clients", type=int, default=1,
                    help="the count each mode's first search starts from (doubling up or halving down)")  # fmt: skip
    ap.add_argument("--no-bisect", dest="bisect", action="store_false", help="doubling only")
    ap.add_argument("--saturation", action=argparse.BooleanOptionalAction, default=True,
                    help="each mode's unpaced run at --max-clients")  # fmt: skip
    ap.add_argument("--modes", nargs="+", default=list(RUN_MODES), choices=RUN_MODES,
                    help="auto is derived from hybrid and server-only when both run")  # fmt: skip
    ap.add_argument("--preset", default="", help="a target of this preset's shapes with random weights (e.g. "
                    "llama3-8b); hybrid acceptance replayed from --acceptance")  # fmt: skip
    ap.add_argument("--layers", type=int, default=0, help="with --preset: keep this many layers (0: all)")
    ap.add_argument("--acceptance", default="", help="recorded accepted lengths to force (recorded there first when "
                    "missing); with --preset, default acceptance.json")  # fmt: skip
    ap.add_argument("--prompt-file", default=str(ROOT / "deploy/models/prompts/heldout.jsonl"),
                    help="recording --acceptance: the held-out prompts")  # fmt: skip
    ap.add_argument("--acceptance-prompts", type=int, default=64, help="recording --acceptance: prompts")
    ap.add_argument("--acceptance-tokens", type=int, default=128, help="recording --acceptance: tokens per prompt")
    ap.add_argument("--session-rounds", type=int, default=64, help="replayed: rounds a session runs before a new one")
    ap.add_argument(
        "--traces", default="traces.json", help="traced: recorded drafts (recorded here first when missing)"
    )
    ap.add_argument("--prompts", type=int, default=32, help="recording traces: standard-library prompts")
    ap.add_argument("--prompt-len", type=int, default=256, help="prompt tokens (traces, replayed sessions)")
    ap.add_argument("--trace-tokens", type=int, default=256, help="recording traces: tokens generated per prompt")
    ap.add_argument("--k", type=int, default=5, help="draft tokens per round (recording, replay, server-draft)")
    ap.add_argument("--tokens", type=int, default=0,
                    help=f"streams: tokens each (0: the traces' length; replayed: {REPLAYED_TOKENS})")  # fmt: skip
    ap.add_argument("--warmup-rounds", type=int, default=2, help="hybrid: untimed rounds per client first")
    load_server().add_deployment_options(ap)
    ap.add_argument("--frontends", type=int, default=0,
                    help="in-process server: gRPC in this many front-end processes (serve --frontends)")  # fmt: skip
    ap.add_argument("--rpc-timeout", type=float, default=60.0, help="seconds per message / unary call")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per run, all included")
    ap.add_argument("--plot", type=Path, default=None, help="write users per GPU vs tokens/s per user here (PNG)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--merge", nargs="+", default=[], metavar="FILE",
                    help="print (and --plot) earlier runs' output files as one record; runs nothing")  # fmt: skip
    return ap


def random_models(args: argparse.Namespace, device: str) -> tuple:
    """A --preset target with seeded random weights (bench/invariance.py's), a MoA drafter of --drafter's config
    built for it with random weights, --model's tokenizer, and a fingerprint naming the shapes."""
    import torch

    from tether.shared.drafter import load_drafter_config
    from tether.shared.drafter_loading import build_drafter

    server = load_server()
    shape = argparse.Namespace(preset=args.preset, layers=args.layers, device=device, dtype="", attention="auto",
                               model=args.model)  # fmt: skip
    target, tok = server.sibling("invariance").random_target(shape)
    dcfg = load_drafter_config(args.drafter)  # its TLI layers at most the target's (a --layers cut)
    dcfg = dataclasses.replace(dcfg, target_fingerprint="", tli=min(dcfg.tli, target.cfg.n_layers))
    torch.manual_seed(1)
    drafter = build_drafter(target, dcfg).to(device=target.device, dtype=target.dtype).eval()
    fp = hashlib.sha256(f"random {args.preset} {target.cfg.n_layers} layers seed 0".encode()).hexdigest()
    return target, drafter, tok, fp


def acceptance_file(args: argparse.Namespace, sargs: argparse.Namespace) -> dict:
    """--acceptance, recorded first with the trained --model / --drafter when the file is missing."""
    server = load_server()
    traces = server.sibling("traces")
    if not os.path.exists(args.acceptance):
        target, drafter, tok, fp = server.load_models(argparse.Namespace(model=args.model, drafter=args.drafter,
                                                                         device=sargs.device))  # fmt: skip

        def progress(i: int, n: int) -> None:
            print(f"\rrecording acceptance: {i} / {n} held-out prompts", end="\n" if i == n else "", file=sys.stderr,
                  flush=True)  # fmt: skip

        rec = traces.record_acceptance(target, drafter, tok, prompt_file=args.prompt_file,
                                       prompts=args.acceptance_prompts, tokens=args.acceptance_tokens, k=args.k,
                                       target_fingerprint=fp, drafter_dir=args.drafter, progress=progress)  # fmt: skip
        traces.save(args.acceptance, rec)
        del target, drafter
    return traces.load_acceptance(args.acceptance)


def merge(args: argparse.Namespace) -> dict:
    """--merge: the records of several runs (each file's last JSON line, e.g. one mode or one RTT per GPU run) as
    one table, plot and record; auto and the ratios recomputed over the cells of all of them."""
    from rich.console import Console

    records = [json.loads(Path(f).read_text().strip().splitlines()[-1]) for f in args.merge]
    cells = with_auto([c for r in records for c in r["cells"] if c["mode"] != AUTO])
    first = records[0]["args"]
    args.rtt_ms = sorted({c["rtt_ms"] for c in cells})
    args.rate = sorted({c["rate"] for c in cells})
    args.max_clients = max(r["args"]["max_clients"] for r in records)
    args.share, args.duration = first["share"], first["duration"]
    said = "; ".join(dict.fromkeys(_said(r["acceptance"]) for r in records))
    where = "; ".join(dict.fromkeys(r["device"] for r in records))
    Console(width=200).print(table(args, cells, where, said))
    if args.plot:
        plot(args, cells, args.plot, f"{records[0]['target']}: users sustained per mode; {said}")
    record = {"bench": "capacity", "merged": args.merge, "device": where, "target": records[0]["target"],
              "acceptance": records[0]["acceptance"], "cells": cells, "ratios": ratios(cells)}  # fmt: skip
    print(json.dumps(record))
    return record


def _said(acceptance: dict) -> str:
    """How a record's hybrid acceptance came about, in one line (acceptance_summary's)."""
    if "counts" in acceptance:
        return (f"acceptance replayed: tau {acceptance['tau']:.2f} recorded on {acceptance['prompts']} held-out "
                f"prompts, {acceptance['forced_tau']:.2f} forced")  # fmt: skip
    if acceptance:
        return (f"drafts replayed from {acceptance['prompts']} standard-library prompts (recorded tau "
                f"{acceptance['tau']:.2f})")  # fmt: skip
    return "no hybrid"


def main(argv: list[str] | None = None) -> dict:
    args = parser().parse_args(argv)
    if args.merge:
        return merge(args)
    if min(args.rate) <= 0 or args.max_clients < 1 or args.duration <= 0 or not 0 < args.share <= 1:
        raise SystemExit("--rate and --duration must be positive, --max-clients at least 1, --share in (0, 1]")
    args.acceptance = args.acceptance or ("acceptance.json" if args.preset else "")
    if args.acceptance and args.target:
        raise SystemExit("replayed acceptance forces the in-process server's verdicts: it cannot run with --target")
    if SERVER_DRAFT in args.modes and args.target:
        raise SystemExit("server-draft starts a server of its own in this process: it cannot run with --target")
    import grpc
    import torch
    from rich.console import Console

    from tether.server.model_loading import default_model_dir

    server = load_server()
    # The in-process server's settings: bench/server.py's parser (and defaults), sized for --max-clients.
    args.model = args.model or str(default_model_dir())
    args.drafter = args.drafter or str(default_model_dir("drafter"))
    sargv = ["--clients", str(args.max_clients), "--prompt-len", str(args.prompt_len), "--k", str(args.k),
             "--prompts", str(args.prompts), "--trace-tokens", str(args.trace_tokens), "--kv-pool-mb",
             str(args.kv_pool_mb), "--device", args.device, "--model", args.model,
             "--drafter", args.drafter, "--frontends", str(args.frontends)]  # fmt: skip
    sargs = server.parser().parse_args(sargv)
    sargs.device = sargs.device or ("cuda" if torch.cuda.is_available() else "cpu")
    accepted = acceptance_file(args, sargs) if args.acceptance else None
    if accepted and accepted["k"] != args.k:
        raise SystemExit(f"{args.acceptance} was recorded with k = {accepted['k']}; this run drafts k = {args.k}")
    forced = None
    if accepted:
        fa = server.sibling("forced_acceptance")
        forced = fa.ForcedAcceptance(fa.AcceptanceHistogram(accepted["counts"]), args.seed)
    models = None
    if not args.target:
        models = random_models(args, sargs.device) if args.preset else server.load_models(sargs)
    cells, saturation, where, recorded = [], {}, "", None
    plain = [m for m in args.modes if m != SERVER_DRAFT]
    for server_draft, modes in ((0, plain), (args.k, [SERVER_DRAFT] if SERVER_DRAFT in args.modes else [])):
        if modes:
            part, sat, where, recorded = serve_and_search(args, sargs, models, server_draft, modes, forced, recorded)
            cells, saturation = cells + part, saturation | sat
    cells = with_auto(cells)
    acceptance, said = acceptance_summary(args, accepted, forced, recorded)
    shape = args.model
    if args.preset:
        shape = f"{args.preset} (random weights{f', {args.layers} layers' if args.layers else ''})"
    where = f"target {shape}; {where}"
    Console(width=200).print(table(args, cells, where, said))
    if args.plot:
        plot(args, cells, args.plot, f"{shape}: users sustained per mode; {said}")
    flags = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    record = {"bench": "capacity", "device": where, "host": platform.node(), "cpus": len(os.sched_getaffinity(0)),
              "torch": torch.__version__, "grpcio": grpc.__version__, "args": flags, "target": shape,
              "acceptance": acceptance, "cells": cells, "saturation": saturation, "ratios": ratios(cells)}  # fmt: skip
    print(json.dumps(record))
    return record


def serve_and_search(
    args: argparse.Namespace,
    sargs: argparse.Namespace,
    models: tuple | None,
    server_draft: int,
    modes: list[str],
    forced,
    recorded: dict | None,
) -> tuple[list, dict, str, dict | None]:
    """`modes`' cells against one server: --target, or one started here on `models` (`server_draft` > 0: with
    --server-draft), its verdicts `forced` while they run (when given); traced hybrid rounds read (and first
    record) --traces. The cells, the saturation runs, where they ran and the traces."""
    import torch

    server = load_server()
    service = rpc = None
    if args.target:
        address, where = args.target, f"server at {args.target}"
    else:
        service, rpc, port = server.start_server(sargs, models, server_draft)
        address = f"127.0.0.1:{port}"
        where = torch.cuda.get_device_name() if sargs.device.startswith("cuda") else f"cpu ({os.cpu_count()} cores)"
        where += ", in-process server"
    try:
        if forced is None and HYBRID in modes and recorded is None:
            if not os.path.exists(args.traces):
                if service is None:
                    raise SystemExit(f"{args.traces} does not exist (record it with bench/server.py --record-traces)")
                e = service.engine
                server.record_traces(sargs, args.traces, e.target, e.drafter, e.tokenizer, e.model_fingerprint)
            recorded = server.sibling("traces").load(args.traces)
        tokens = args.tokens or (recorded["tokens"] if recorded else REPLAYED_TOKENS)
        with server.ServerProbe(service, args.metrics_url, rpc) as probe, forced or contextlib.nullcontext():
            cells, saturation = Capacity(args, server, address, probe, tokens, forced is not None).cells(modes)
    finally:
        if rpc is not None:
            server.stop_server(service, rpc)
    return cells, saturation, where, recorded


def acceptance_summary(args: argparse.Namespace, accepted: dict | None, forced, recorded: dict | None):
    """The record's "acceptance" and the line the table and plot say it in."""
    out = {}
    if accepted:
        out = {k: v for k, v in accepted.items() if k != "format"} | {"file": args.acceptance, "forced_tau": forced.tau}
    elif recorded:
        out = {k: v for k, v in recorded.items() if k != "traces"} | load_server().sibling("traces").summary(recorded)
    return out, _said(out)


if __name__ == "__main__":
    main()
