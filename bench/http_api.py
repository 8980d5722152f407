"""The OpenAI-compatible HTTP API under load: N concurrent streaming clients, beside the Generate RPC at the same N.

A server in this process (tether.server.service, its gRPC server and its HTTP API on one event loop, the default
models on `--device`, or `--model` / `--drafter`), or a running one at `--target URL` (with `--grpc-target
HOST:PORT` for the Generate rows). For each N of `--clients`, in turn:
- `http`: N asyncio clients (httpx, one event loop on this thread) each POST /v1/completions with `stream: true`,
  a prompt of `--prompt-len` random token ids (its own per client), `--tokens` max_tokens, ignore_eos (so every
  stream has the same length), temperature `--temperature` with a per-client seed, and stream_options.include_usage
  (the tokens counted are the server's usage). All start together.
- `grpc`: N Generate streams with the same prompts and settings (threads, the blocking grpc stubs: grpc.aio clients
  would share the server's completion queue in this process), started together.
Each row: aggregate completion tokens/s over the wall time of the N streams, per-stream tokens/s, time to first
token (request sent to the first text received) p50 / p99, and inter-token latency p50 / p99: the gaps between
successive tokens as the client receives them (a chunk of k tokens counts one gap and k - 1 gaps of 0; a stream
alone decodes 16 chained steps per chunk, so its tokens arrive in bursts). One warm-up request per protocol first.
Prints a table, then one JSON line. (Not bench/http.py: run as a script, a file of that name in bench/ would hide the
standard library's `http` package from every other benchmark in the folder.)

    python bench/http_api.py --clients 1 8 32
    python bench/http_api.py --device cpu --clients 1 8 32 --tokens 64 --prompt-len 32
    python bench/http_api.py --target http://10.0.0.5:8000 --grpc-target 10.0.0.5:50051 --clients 1 16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return round(s[min(len(s) - 1, int(q / 100 * len(s)))], 2)


def stamps_to_gaps(stamps: list[tuple[float, int]]) -> list[float]:
    """Per-token gaps from (arrival time, tokens in it): k tokens arriving together are one gap and k - 1 zeros."""
    gaps = []
    for (prev, _), (now, k) in zip(stamps, stamps[1:], strict=False):
        gaps += [now - prev] + [0.0] * (k - 1)
    return gaps


async def http_stream(client: httpx.AsyncClient, url: str, body: dict) -> dict:
    t0 = time.perf_counter()
    stamps: list[tuple[float, int]] = []
    tokens = 0
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line.removeprefix("data: "))
            if "error" in event:
                raise RuntimeError(f"stream error: {event['error']['message']}")
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            if event["choices"] and event["choices"][0]["text"]:
                stamps.append((time.perf_counter(), 1))
    return {"t0": t0, "stamps": stamps, "tokens": tokens, "end": time.perf_counter()}


def grpc_stream(stub, prompt: list[int], body: dict, go: threading.Barrier) -> dict:
    from tether.v1 import tether_pb2 as pb

    sampling = pb.SamplingParams(temperature=body["temperature"], seed=body["seed"], ignore_eos=True)  # as HTTP's
    request = pb.OpenSession(prompt=prompt, max_new_tokens=body["max_tokens"], sampling=sampling)
    go.wait()
    t0 = time.perf_counter()
    stamps = [(time.perf_counter(), len(m.tokens)) for m in stub.Generate(request)]
    return {"t0": t0, "stamps": stamps, "tokens": sum(k for _, k in stamps), "end": time.perf_counter()}


def summarise(protocol: str, n: int, streams: list[dict]) -> dict:
    start, end = min(s["t0"] for s in streams), max(s["end"] for s in streams)
    tokens = sum(s["tokens"] for s in streams)
    ttft = [(s["stamps"][0][0] - s["t0"]) * 1e3 for s in streams if s["stamps"]]
    itl = [g * 1e3 for s in streams for g in stamps_to_gaps(s["stamps"])]
    per_stream = [s["tokens"] / (s["end"] - s["t0"]) for s in streams]
    return {"protocol": protocol, "clients": n, "tokens": tokens, "wall_s": round(end - start, 3),
            "tokens_per_s": round(tokens / (end - start), 1),
            "tokens_per_s_per_stream": round(sum(per_stream) / len(per_stream), 1),
            "ttft_p50_ms": pct(ttft, 50), "ttft_p99_ms": pct(ttft, 99),
            "itl_p50_ms": pct(itl, 50), "itl_p99_ms": pct(itl, 99)}  # fmt: skip


def bodies(args: argparse.Namespace, n: int, vocab: int) -> list[dict]:
    rng = random.Random(n)
    return [{"prompt": [rng.randrange(2, vocab) for _ in range(args.prompt_len)], "max_tokens": args.tokens,
             "temperature": args.temperature, "seed": i, "stream": True, "ignore_eos": True,
             "stream_options": {"include_usage": True}} for i in range(n)]  # fmt: skip


async def run_http(url: str, requests: list[dict]) -> list[dict]:
    limits = httpx.Limits(max_connections=len(requests) + 1, max_keepalive_connections=len(requests) + 1)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        return list(await asyncio.gather(*(http_stream(client, url, b) for b in requests)))


def run_grpc(address: str, requests: list[dict]) -> list[dict]:
    import grpc

    from tether.v1 import tether_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        stub = tether_pb2_grpc.TetherStub(channel)
        go = threading.Barrier(len(requests))
        with ThreadPoolExecutor(len(requests)) as pool:
            return list(pool.map(lambda b: grpc_stream(stub, b["prompt"], b, go), requests))


def start_server(args: argparse.Namespace):
    """The models served in this process: gRPC and the HTTP API on 127.0.0.1, free ports."""
    import torch

    from tether.server.batcher import warm_up
    from tether.server.engine_core import Engine
    from tether.server.http_api import start_http
    from tether.server.model_loading import default_model_dir, load, pick_device
    from tether.server.rpc_server import make_server
    from tether.server.serve_config import ServiceConfig
    from tether.server.service import TetherService
    from tether.shared.checkpoint import fingerprint
    from tether.shared.drafter_loading import load_drafter
    from tether.shared.openai_app import HttpConfig

    model = args.model or str(default_model_dir())
    target, tok = load(model, pick_device(args.device))
    fp = fingerprint(model)
    drafter = None
    if args.drafter != "none":
        drafter = load_drafter(args.drafter or default_model_dir("drafter"), target, target_fingerprint=fp)
    torch.set_grad_enabled(False)
    config = ServiceConfig(max_new_tokens=max(1024, args.tokens), max_streams=max(4096, 2 * max(args.clients)))
    service = TetherService(Engine(target, drafter, tok, config, model_fingerprint=fp))
    if target.backend == "triton":
        warm_up(target, service.engine.pool)  # as `tether-server serve` does before it listens
    server, port = make_server(service, "127.0.0.1:0")
    server.start()
    http_config = HttpConfig(max_streams=max(256, 2 * max(args.clients)))
    http, http_port = start_http(service.engine, config.model_id, http_config)
    return service, server, http, f"http://127.0.0.1:{http_port}", f"127.0.0.1:{port}"


def table(args: argparse.Namespace, rows: list[dict], where: str):
    from rich.table import Table

    def f(x, fmt=".1f"):
        return "-" if x is None else format(x, fmt)

    t = Table(title=f"Streaming completions, {args.tokens} tokens each, prompt {args.prompt_len}, "
                    f"temperature {args.temperature:g}, {where}")  # fmt: skip
    for c in ("clients", "protocol", "tokens/s", "tokens/s per stream", "TTFT p50 / p99 ms", "ITL p50 / p99 ms",
              "wall s"):  # fmt: skip
        t.add_column(c, justify="right")
    for r in rows:
        t.add_row(str(r["clients"]), r["protocol"], f(r["tokens_per_s"]), f(r["tokens_per_s_per_stream"]),
                  f"{f(r['ttft_p50_ms'], '.0f')} / {f(r['ttft_p99_ms'], '.0f')}",
                  f"{f(r['itl_p50_ms'], '.2f')} / {f(r['itl_p99_ms'], '.2f')}", f(r["wall_s"], ".2f"))  # fmt: skip
    return t


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32], help="concurrent streams, in turn")
    ap.add_argument("--tokens", type=int, default=64, help="completion tokens per stream (ignore_eos)")
    ap.add_argument("--prompt-len", type=int, default=32, help="prompt tokens (random ids, one prompt per client)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    flags = {"--device": "in-process server: cpu / cuda (default: cuda when present)",
             "--model": "in-process server: model directory (default: deploy/models/target)",
             "--drafter": "in-process server: drafter directory, or none (default: the shipped one)",
             "--target": "URL of a running server's HTTP API instead of one in-process",
             "--grpc-target": "with --target: HOST:PORT of its gRPC port (for the Generate rows)"}  # fmt: skip
    for flag, text in flags.items():
        ap.add_argument(flag, default="", help=text)
    args = ap.parse_args(argv)
    service = server = http = None
    if args.target:
        url, address = args.target.rstrip("/"), args.grpc_target
        vocab = 256  # ids every byte-level vocabulary has
        where = f"server at {url}"
    else:
        service, server, http, url, address = start_server(args)
        vocab = service.engine.target.cfg.vocab_size
        where = f"in-process server on {service.engine.target.device} ({platform.machine()})"
    rows = []
    try:
        warm = bodies(args, 1, vocab)
        asyncio.run(run_http(url, warm))
        if address:
            run_grpc(address, warm)
        for n in args.clients:
            requests = bodies(args, n, vocab)
            rows.append(summarise("http", n, asyncio.run(run_http(url, requests))))
            if address:
                rows.append(summarise("grpc", n, run_grpc(address, requests)))
    finally:
        if http is not None:
            http.stop()
            server.stop(grace=None)
            service.engine.close()
    from rich.console import Console

    Console(width=150).print(table(args, rows, where))
    record = {"bench": "http", "where": where, "args": vars(args), "rows": rows}
    print(json.dumps(record), flush=True)
    return record


if __name__ == "__main__":
    main()
