"""The link benchmark (issue [6/7]): tokens/s and bytes per token of edge drafting against server-only streaming,
over a shaped link, against any deployment; the synchronous bound beside them; what a resync costs after an outage.

Setup: tether-netsim on this host in front of the server, the edge client (ONNX by default) behind it. The server
is `--server HOST:PORT` (any running tether-server: run the bench on its host, or the real path's round trip adds
to every cell), else one started in this process on `--device` the way `tether-server serve` builds it
(tether.server.daemon: the same models, service config and kernel warm-up; on CUDA the Triton step replays its
CUDA graphs, captured by `--warmup` untimed generations per mode). Server and client then share one Python
process; `--server` against a `tether-server serve` of its own keeps the server out of it. netsim runs in a child
process of its own (`--netsim process`, the default; `thread` puts it in this one): a proxy on the client's thread
competes with it for the interpreter lock, which no real network does. Pairing (the
one-off client-part download) happens before shaping and is never timed. Generations are greedy and ignore
end-of-text, so every cell writes exactly `--new-tokens` tokens after PROMPT.

Modes (`--modes`): server-only (the target decodes alone and streams its tokens over Generate); hybrid chain and
hybrid tree (ClientConfig.tree), each without and with pipelining (ClientConfig.pipeline: round r+1 drafted while r is
verified), named chain, chain+pipe, tree, tree+pipe (and auto, auto+pipe: the client picks the shape). +pipe sends
round r+1 before r's verdict where the server takes overlapping rounds (ClientConfig.overlap, the default); +ahead
drafts it as early but sends it once the verdict bears its guess out (the pipelining before overlap). A mode the
client in use cannot run (a ClientConfig without those fields) is reported "n/a", never run as something else.
Every hybrid mode is forced (ClientConfig.mode "hybrid"); `adaptive` is the client as it ships (ClientConfig.mode
"auto", its default tree and pipelining: auto+pipe when it drafts): it streams or drafts, whichever it measures
faster (tether.client.mode_choice). `server-draft` is the server-only stream from a second server that drafts for
itself (`serve --server-draft`, k = --k): in this process after the first one is closed, or `--server-draft-server`.
Grid: every load in `--load` x every RTT in `--rtt-ms` (one-way latency RTT/2 each way) x every bandwidth in `--mbps`
(a cap each way). A load is N background clients (0: idle; `full`: the server's max batch, ServiceConfig.max_batch,
or `--full-load` against --server): bench/server.py's synthetic Generate streams (random prompts of
`--load-prompt-len`, `--load-tokens` each, one after another), in a child process on the server's own address
(not through netsim), running through every cell of that load and killed after it (bounded by --load-limit-s).

Per cell (definitions, also in the JSON's "definitions"):
- tok_s: tokens / wall, the wall from sending the open (server-only: the Generate call) to the last token;
- tau: tokens per round, (accepted + rounds) / rounds; round_ms: the client's mean round time, from its first
  token to its last over the rounds between them (drafting, the round trip and the server's round; with
  pipelining the interval between verdicts);
- server_round_ms: the server's own mean round time over the cell, request to verdict (tether_verify_seconds:
  batching wait, the step, the verdict, the reply's encoding), read from the in-process service or scraped from
  `--metrics-url` (a remote server's `--metrics-port`); none otherwise;
- payload_B_per_tok: message payloads up + down (tokens, q rows, KV deltas) per token; wire_B_per_tok: bytes both
  ways as netsim counted them (HTTP/2 and gRPC framing included), per token;
- the synchronous bound, hybrid modes only: tau / (RTT + step), what a client that waits for each verdict and
  drafts in no time could reach. bound_tok_s takes step = server_round_ms of the cell; bound_rtt0_tok_s takes
  step = round_ms of the same mode and bandwidth at RTT 0 (in the same run; needs 0 in `--rtt-ms`), which counts
  the client's drafting too. Each has its ratio tok_s / bound (bound_ratio, bound_rtt0_ratio). Bandwidth is in
  neither: at 1 Mbit/s the deltas' transfer time is part of what the ratio shows.
- where a hybrid round's time goes, per round (the client's Stats): work_ms, the client's time not spent waiting
  for a verdict; wait_ms, from sending a round to its verdict's arrival; to_send_ms, from a verdict's arrival to
  the next round's sending (round_ms ~ wait_ms + to_send_ms); overhead_ms = wait_ms - RTT - server_round_ms, what
  the wire, gRPC on both ends and netsim add to each round trip.
Then outages (`--outages-s`, with `--outage-mode` at `--outage-rtt-ms` / `--outage-mbps`): the client writes at a
reader's pace (`--pace` tokens/s, policy keep); once it has written 2 x pace tokens the link is cut for the outage's
seconds; reported: offline tokens, the first resync's duration (request to next verified token) and its bytes.

- switches (hybrid modes and adaptive): each change of online mode, [ms, payload bytes up, down]: a switch to
  streaming until its first chunk (its prompt's bytes up), a catch-up until the next verified token (tether.client
  .adaptive); adaptive's first stream may come straight after the open (tether.client.mode_choice).
- mean_batch: the server's mean batch size (rounds and stream steps per step) over the cell, where the bench reads
  the server's metrics: how full the background clients keep it.
The summary (record "summary", one cell per load, bandwidth and RTT): each mode's tok_s, the better of server-only
and the hybrid modes measured (`best_other`; server-draft is another deployment, not this client's option) and
adaptive's ratio to it (`adaptive_ratio`; issue #45's target: >= 0.95 in every cell).
Prints a table per part, then one JSON line (record "bench": "link"); `--plot FILE` draws tokens/s against RTT, a
panel per bandwidth, a line per mode and each hybrid mode's synchronous bound dashed (matplotlib, when installed).

    python bench/link.py --device cpu --plot bench/link.png      # the full grid, in-process server on the CPU
    python bench/link.py --device cuda --cache-dir /var/cache/tether --plot link-h200.png   # the server on a GPU
    python bench/link.py --server 10.0.0.5:50051 --metrics-url http://10.0.0.5:9100/metrics   # a deployment
    python bench/link.py --quick                                 # RTT 0 and 10 ms, 100 Mbit/s, 16 tokens, idle
    python bench/link.py --device cuda --mbps 100 --load 0 full --outages-s 5   # issue #45's table

Tests: tests/server/test_bench_link.py (a tiny grid and a short outage on the CPU; the record's structure and bounds).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import NoReturn

from rich.console import Console
from rich.table import Table

from tether.client.server_only import ServerOnlySession, server_tokenizer
from tether.client.session import ClientConfig, EdgeSession
from tether.client.session_types import BACKENDS, CODECS, PRECISIONS
from tether.client.transport import LinkDown, Replicas, ServerError
from tether.netsim.process import NetSimProcess
from tether.netsim.proxy import NetSimThread
from tether.v1 import tether_pb2 as pb

PROMPT = "import json\n\n\ndef load_settings(path):\n    "
SERVER_ONLY = "server-only"
SERVER_DRAFT = "server-draft"  # the server-only stream, from a server that drafts for itself (serve --server-draft)
ADAPTIVE = "adaptive"  # the client's default (ClientConfig.mode "auto": it streams or drafts, whichever is faster)
STREAMED = (SERVER_ONLY, SERVER_DRAFT)  # the modes a Generate stream measures
# The hybrid modes: the ClientConfig fields each sets. A client without a field does what LEGACY says.
MODES = {
    "chain": {"tree": "chain", "pipeline": False},
    "chain+ahead": {"tree": "chain", "pipeline": True, "overlap": False},
    "chain+pipe": {"tree": "chain", "pipeline": True, "overlap": True},
    "tree": {"tree": "tree", "pipeline": False},
    "tree+ahead": {"tree": "tree", "pipeline": True, "overlap": False},
    "tree+pipe": {"tree": "tree", "pipeline": True, "overlap": True},
    "auto": {"tree": "auto", "pipeline": False},
    "auto+ahead": {"tree": "auto", "pipeline": True, "overlap": False},
    "auto+pipe": {"tree": "auto", "pipeline": True, "overlap": True},
}
# ClientConfig fields the bench's flags of that name set, where the client in use has them: the tree's shape, and
# how many overlapping rounds queue behind the one in flight
CLIENT_INTS = ("tree_nodes", "tree_depth", "tree_top_k", "overlap_depth")
# What a client from before tree rounds and pipelining does; one from before overlapping rounds sends a round drafted
# ahead after the verdict it depends on.
LEGACY = {"tree": "chain", "pipeline": False, "overlap": False}
DEFAULT_MODES = (SERVER_ONLY, SERVER_DRAFT, "auto+pipe", ADAPTIVE)
MODEL_CALLS = 4096  # the in-process server's max_model_calls_per_caller: the background clients share one host
FULL = "full"  # --load's word for the server's whole batch (ServiceConfig.max_batch background clients)
PIPELINE_HITS = "pipeline_hits"  # the Stats field counting rounds sent pre-drafted (shown when the client has it)
# Where a round's time goes: the row's key (ms per round) -> the Stats field (s, summed), shown when the client has it
ROUND_PARTS = {"work_ms": "round_work_s", "wait_ms": "verdict_wait_s", "to_send_ms": "verdict_to_send_s"}
DEFINITIONS = {
    "tok_s": "tokens / wall; wall from sending the open (server-only: the Generate call) to the last token",
    "tau": "tokens per round: (accepted + rounds) / rounds",
    "round_ms": "client's mean round time: first token to last token / rounds (drafting + round trip + server)",
    "server_round_ms": "server's mean round time over the cell, request to verdict (tether_verify_seconds)",
    "bound_tok_s": "tau / (RTT + server_round_ms)",
    "bound_rtt0_tok_s": "tau / (RTT + round_ms of the same mode and bandwidth at RTT 0)",
    "bound_ratio": "tok_s / bound_tok_s",
    "bound_rtt0_ratio": "tok_s / bound_rtt0_tok_s",
    "work_ms": "the client's time per round not spent waiting for a verdict (drafting, ahead too; adopting; sending)",
    "to_send_ms": "per round, from a verdict's arrival to the next round's sending: the client's part of the critical "
    "path (round_ms ~ wait_ms + to_send_ms)",
    "wait_ms": "per round, from sending it to its verdict's arrival at the client",
    "overhead_ms": "wait_ms - RTT - server_round_ms: what the wire, gRPC on both ends and netsim add to a round trip",
    "payload_B_per_tok": "message payload bytes up + down per token",
    "switches": "each change of online mode: [ms until its first token, payload bytes up, down]",
    "wire_B_per_tok": "bytes both ways through netsim per token (HTTP/2 + gRPC framing included)",
}


def client_options(mode: str) -> dict | None:
    """The ClientConfig fields of a hybrid mode, or None when the client in use cannot run it (it lacks a field
    whose value the mode needs to differ from LEGACY)."""
    have = {f.name for f in dataclasses.fields(ClientConfig)}
    if mode == ADAPTIVE:  # the client's own defaults, the online mode left to it
        return {"mode": "auto"} if "mode" in have else None
    options = {}
    for name, value in MODES[mode].items():
        if name in have:
            options[name] = value
        elif value != LEGACY[name]:
            return None
    return options


def bench_module(name: str) -> ModuleType:
    """bench/NAME.py as a module (bench/ is no package), under the key bench/server.py's `sibling` uses."""
    key = f"tether_bench_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, Path(__file__).with_name(f"{name}.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    return sys.modules[key]


class LocalServer:
    """The default models (or --model / --drafter) served on 127.0.0.1:0 in this process, by serve's own engine
    (tether.server.engine_core.Engine.build) with serve's defaults: on the Triton backend its kernel warm-up (which also
    captures the step graphs a `--cache-dir` recorded and those of k = 5 rounds), then the settled heap.
    `server_draft`: serve --server-draft (--server-draft-k = --k). Every background client comes from this host, so
    the per-caller bound on calls waiting for the model threads is raised past what --load sends."""

    def __init__(self, args: argparse.Namespace, server_draft: bool = False):
        import torch

        from tether.server.engine_core import Engine
        from tether.server.model_loading import pick_device
        from tether.server.rpc_server import make_server
        from tether.server.serve_config import ServeConfig
        from tether.server.service import TetherService

        extra = {k: v for k, v in (("model", args.model), ("drafter", args.drafter)) if v}
        cfg = ServeConfig(device=pick_device(args.device), cache_dir=args.cache_dir, server_draft=server_draft,
                          server_draft_k=args.k, max_model_calls_per_caller=MODEL_CALLS, **extra)  # fmt: skip
        if cfg.device.startswith("cuda") and not torch.cuda.is_available():
            fail(f"--device {cfg.device}: this host has no CUDA device (--device cpu, or --server HOST:PORT)")
        self.device = cfg.device
        engine = Engine.build(cfg)
        self.max_batch = engine.config.max_batch  # --load full: this many background clients
        self.warm = engine.warm_up()
        engine.settle()
        self.service = TetherService(engine)
        self.server, port = make_server(self.service, "127.0.0.1:0")
        self.server.start()
        self.address = f"127.0.0.1:{port}"

    def describe(self) -> str:
        import torch

        if self.device.startswith("cuda"):
            return f"{torch.cuda.get_device_name()}, in-process server ({self.warm})"
        return f"cpu ({os.cpu_count()} cores), in-process server"

    def close(self) -> None:
        self.server.stop(grace=1).wait(30)
        self.service.engine.close()  # and settle()'s frozen heap back to the collector


class Background:
    """`n` other users of the server, loading it while a cell is measured: bench/server.py's synthetic Generate
    clients (bench/server_clients.generate_until: greedy streams of --load-tokens after random --load-prompt-len
    prompts, one after another per client) in a child process of their own, on the server's own address (their
    links are not the timed client's). Bounded: the process ends by itself after --load-limit-s, and close() ends
    it sooner. n = 0: nothing runs."""

    def __init__(self, address: str, n: int, args: argparse.Namespace):
        self.proc = None
        if n <= 0:
            return
        server = bench_module("server")
        limit = args.load_limit_s
        spec = server.parser().parse_args(["--mode", "generate", "--duration", str(limit), "--tokens",
                                           str(args.load_tokens), "--prompt-len", str(args.load_prompt_len),
                                           "--timeout", str(limit + 60)])  # fmt: skip
        spec = json.dumps({k: v for k, v in vars(spec).items() if k not in ("clients", "worker")})
        cmd = [sys.executable, str(Path(server.__file__).resolve()), "--worker", address, "--worker-clients", str(n),
               "--worker-seed", str(n), "--worker-first", "0", "--worker-spec", spec]  # fmt: skip
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            server.read_line(self.proc, time.monotonic() + 120 + n)  # ready: its first stream ran
            self.proc.stdin.write("go\n")
            self.proc.stdin.flush()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


class Rig:
    """tether-netsim in front of the server, the client's weight cache, and what the bench reads of the server."""

    def __init__(self, upstream: str, args: argparse.Namespace, service=None, metrics_url: str = ""):
        self.args = args
        self.sim = (NetSimProcess if args.netsim == "process" else NetSimThread)(("127.0.0.1", 0), upstream)
        self.sim.start()
        self.cache = tempfile.TemporaryDirectory(prefix="tether-link-")
        self.probe = bench_module("server").ServerProbe(service, metrics_url)

    def config(self, **kw) -> ClientConfig:
        a = self.args
        base = dict(server=self.sim.address, cache_dir=self.cache.name, max_new_tokens=a.new_tokens, k=a.k,
                    codec=a.codec, backend=a.backend, precision=a.precision, threads=a.threads, api_key=a.api_key,
                    round_timeout_s=10.0, connect_timeout_s=60.0, backoff_initial_s=0.05,
                    backoff_max_s=0.5)  # fmt: skip
        have = {f.name for f in dataclasses.fields(ClientConfig)}
        base |= {name: getattr(a, name) for name in CLIENT_INTS if name in have and getattr(a, name)}
        # Exactly --new-tokens: the server's Generate streams past end-of-text only when told (SamplingParams).
        base |= {"ignore_eos": True} if "ignore_eos" in have else {}
        # The hybrid column drafts here throughout; the client's default (auto) may stream instead.
        base |= {"mode": "hybrid"} if "mode" in have else {}
        return ClientConfig(**{**base, **kw})

    def shape(self, rtt_ms: float, mbps: float) -> None:
        self.sim.set_link(latency_ms=rtt_ms / 2, jitter_ms=0, bandwidth_kbps=mbps * 1000)

    def sample(self) -> tuple[int, float, float]:
        """Wire bytes so far, and the server's round-time sum (s) and count (0, 0 when it cannot be read)."""
        s, m = self.sim.stats(), self.probe.sample()
        verify_s, rounds = m.get("tether_verify_seconds_sum", 0.0), m.get("tether_verify_seconds_count", 0)
        return s.up_bytes + s.down_bytes, verify_s, rounds

    def batches(self) -> tuple[float, float]:
        """The server's batch-size sum and count so far (0, 0 when it cannot be read)."""
        m = self.probe.sample()
        return m.get("tether_batch_size_sum", 0.0), m.get("tether_batch_size_count", 0)

    def close(self) -> None:
        self.sim.stop()
        self.cache.cleanup()


def pair(rig: Rig) -> tuple[pb.ModelInfo, object]:
    """Fill the client's weight cache over an unshaped link; the server's ModelInfo and tokenizer."""
    rig.shape(0, 0)
    session = EdgeSession(rig.config())
    try:
        info = session.model_info()
        tokenizer = server_tokenizer(session) if info.server_only else session.pair().tokenizer
    finally:
        session.close()
    return info, tokenizer


def cell(tokens: int, wall_s: float, payload: int, wire: int) -> dict:
    return {"tokens": tokens, "wall_s": wall_s, "tok_s": tokens / wall_s if wall_s > 0 else None,
            "payload_B_per_tok": payload / tokens if tokens else None,
            "wire_B_per_tok": wire / tokens if tokens else None}  # fmt: skip


def run_hybrid(rig: Rig, mode: str) -> dict:
    """One generation of `--new-tokens` tokens in a hybrid mode (client_options(mode) must not be None)."""
    session = EdgeSession(rig.config(**client_options(mode)))
    session.stop_ids = frozenset()  # exactly --new-tokens in every mode (ignore_eos: a client without it too)
    try:
        prompt = session.pair().tokenizer.encode(PROMPT)  # the session takes token ids
        w0, v0, n0 = rig.sample()
        result = session.run(prompt)
        w1, v1, n1 = rig.sample()
    finally:
        session.close()
    s = result.stats
    row = cell(len(result.token_ids), s.wall_s, s.bytes_up + s.bytes_down, w1 - w0)
    stats = dataclasses.asdict(s)
    per_round = {key: 1e3 * stats[field] / s.rounds if s.rounds and field in stats else None
                 for key, field in ROUND_PARTS.items()}  # fmt: skip
    return row | {"tau": s.tau, "rounds": s.rounds, "round_ms": 1e3 * s.decode_s / s.rounds if s.rounds else None,
                  "server_round_ms": 1e3 * (v1 - v0) / (n1 - n0) if n1 > n0 else None,
                  "ttft_ms": 1e3 * s.ttft_s, "offline_tokens": s.offline_tokens,
                  "pipeline_hits": stats.get(PIPELINE_HITS), **per_round,
                  "stream_tokens": stats.get("stream_tokens"), "mode_switches": stats.get("mode_switches"),
                  "switches": [[1e3 * t, up, down] for t, (up, down) in
                               zip(stats.get("switch_s", ()), stats.get("switch_bytes", ()), strict=True)],
                  "client_stats": {k: v for k, v in stats.items() if not isinstance(v, list)}}  # fmt: skip


def run_server_only(rig: Rig, info: pb.ModelInfo, tokenizer) -> dict:
    """One Generate stream of `--new-tokens` tokens over a channel opened (and asked for ModelInfo) beforehand."""
    cfg = rig.config()
    replicas = Replicas(cfg.server, 0, keepalive_s=cfg.keepalive_s)
    metadata = (("authorization", f"Bearer {cfg.api_key}"),) if cfg.api_key else ()
    try:
        replicas.stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=metadata, timeout=cfg.connect_timeout_s)
        w0 = rig.sample()[0]
        session = ServerOnlySession(replicas.stub, metadata, cfg, info, tokenizer, stop_ids=())
        result = session.run(tokenizer.encode(PROMPT))
        wire = rig.sample()[0] - w0
    finally:
        replicas.close()
    s = result.stats
    return cell(len(result.token_ids), s.wall_s, s.bytes_up + s.bytes_down, wire) | {
        "tau": None, "rounds": None, "round_ms": None, "server_round_ms": None, "ttft_ms": 1e3 * s.ttft_s,
        "offline_tokens": 0, "pipeline_hits": None, "stream_tokens": len(result.token_ids),
        "mode_switches": None} | dict.fromkeys(ROUND_PARTS)  # fmt: skip


def measure(rig: Rig, mode: str, info: pb.ModelInfo, tokenizer) -> dict:
    """One cell of `mode` over the rig (a server-draft rig for SERVER_DRAFT), with the server's mean batch size over
    it where the bench reads the server's metrics (`mean_batch`: how full the background clients keep it)."""
    b0 = rig.batches()
    try:
        row = _measure(rig, mode, info, tokenizer)
    except (LinkDown, ServerError) as e:  # e.g. a stream whose tokens stopped under full load: the cell says so
        row = {"failed": f"{type(e).__name__}: {e}"}
    b1 = rig.batches()
    return row | {"mean_batch": (b1[0] - b0[0]) / (b1[1] - b0[1]) if b1[1] > b0[1] else None}


def _measure(rig: Rig, mode: str, info: pb.ModelInfo, tokenizer) -> dict:
    if mode in STREAMED:
        return run_server_only(rig, info, tokenizer)
    if info.server_only:
        return {"skipped": "the server runs no drafter"}
    if client_options(mode) is None:
        return {"skipped": "this client has no ClientConfig.tree / pipeline"}
    return run_hybrid(rig, mode)


def add_bounds(rows: list[dict]) -> None:
    """The synchronous bounds of each measured hybrid row, and its ratios to them (module docstring)."""
    at_rtt0 = {(r["mode"], r["mbps"], r.get("load")): r["round_ms"] for r in rows
               if r["rtt_ms"] == 0 and r.get("round_ms")}  # fmt: skip
    for r in rows:
        tau, rtt = r.get("tau"), r["rtt_ms"]
        wait, server = r.get("wait_ms"), r.get("server_round_ms")
        r["overhead_ms"] = wait - rtt - server if wait is not None and server is not None else None
        rtt0 = at_rtt0.get((r["mode"], r["mbps"], r.get("load")))
        for key, step in (("bound", r.get("server_round_ms")), ("bound_rtt0", rtt0)):
            bound = 1e3 * tau / (rtt + step) if tau and step else None
            r[f"{key}_tok_s"] = bound
            r[f"{key}_ratio"] = r["tok_s"] / bound if bound and r.get("tok_s") else None


def run_outage(rig: Rig, outage_s: float, mode: str) -> dict:
    """At --pace, once 2 x pace tokens are written, cut the link for `outage_s`; the resync that follows."""
    pace = rig.args.pace
    online, finished = threading.Event(), threading.Event()
    session = None

    def on_event(e) -> None:
        if e.kind == "tokens" and len(session.tokens) >= 2 * pace:
            online.set()

    def cutter() -> None:
        while not online.wait(0.1):
            if finished.is_set():
                return
        rig.sim.cut()
        finished.wait(outage_s)
        rig.sim.restore()

    session = EdgeSession(rig.config(max_new_tokens=int(pace * (outage_s + 5)), pace_tokens_per_s=pace,
                                     round_timeout_s=1.0, policy="keep", **client_options(mode)), on_event)  # fmt: skip
    session.stop_ids = frozenset()
    thread = threading.Thread(target=cutter, daemon=True)
    try:
        prompt = session.pair().tokenizer.encode(PROMPT)
        thread.start()
        result = session.run(prompt)
    finally:
        finished.set()
        if thread.is_alive():
            thread.join(60)
        rig.sim.restore()
        session.close()
    s = result.stats
    up, down = s.resync_bytes[0] if s.resync_bytes else (0, 0)
    return {"outage_s": outage_s, "mode": mode, "tokens": len(result.token_ids), "offline_tokens": s.offline_tokens,
            "resyncs": s.resyncs, "resync_ms": 1e3 * s.resync_s[0] if s.resync_s else None, "resync_up_B": up,
            "resync_down_B": down}  # fmt: skip


def parser() -> argparse.ArgumentParser:
    defaults = argparse.ArgumentDefaultsHelpFormatter
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=defaults)
    ap.add_argument("--server", default="", metavar="HOST:PORT",
                    help="a running tether-server; empty: one in this process on --device")  # fmt: skip
    ap.add_argument("--metrics-url", default="",
                    help="--server's Prometheus metrics, for the server's round time; empty: none")  # fmt: skip
    ap.add_argument("--device", default="", help="in-process server: cpu or cuda; empty: cuda when present")
    ap.add_argument("--model", default="", help="in-process server: target directory; empty: deploy/models")
    ap.add_argument("--drafter", default="", help="in-process server: drafter directory; empty: deploy/models")
    ap.add_argument("--cache-dir", default="",
                    help="in-process server: serve's --cache-dir (kernels, graphs); empty: Triton's own")  # fmt: skip
    ap.add_argument(
        "--modes",
        nargs="+",
        default=list(DEFAULT_MODES),
        choices=(*STREAMED, *MODES, ADAPTIVE),
        help="server-only streaming (server-draft: from a server that drafts for itself), hybrid modes (the draft's "
        "shape, +pipe = pipelined drafting), adaptive (the client's default: it streams or drafts)",
    )
    ap.add_argument("--server-draft-server", default="", metavar="HOST:PORT",
                    help="with --server: a `serve --server-draft` for the server-draft mode; empty: that mode is "
                    "skipped (without --server, one in this process)")  # fmt: skip
    ap.add_argument("--load", nargs="+", default=["0", FULL], metavar="N",
                    help=f"background clients loading the server, each load in turn (0: idle; {FULL}: the server's "
                    "max batch, ServiceConfig.max_batch)")  # fmt: skip
    ap.add_argument("--full-load", type=int, default=128, help=f"with --server: clients --load {FULL} means")
    ap.add_argument("--load-tokens", type=int, default=128, help="background clients: tokens per Generate stream")
    ap.add_argument("--load-prompt-len", type=int, default=128, help="background clients: random prompt tokens")
    ap.add_argument("--load-limit-s", type=float, default=900.0,
                    help="background clients: their process ends by itself after this long (a bound)")  # fmt: skip
    ap.add_argument("--netsim", choices=("process", "thread"), default="process",
                    help="where the proxy runs: a child process of its own, or a thread of the bench's")  # fmt: skip
    ap.add_argument("--rtt-ms", type=float, nargs="+", default=[0, 10, 50, 150], help="round trips netsim adds")
    ap.add_argument("--mbps", type=float, nargs="+", default=[1, 10, 100], help="bandwidth cap each way (0: none)")
    ap.add_argument("--new-tokens", type=int, default=200, help="tokens each generation writes")
    ap.add_argument("--k", type=int, default=5, help="draft tokens per chain round")
    for name in CLIENT_INTS:
        ap.add_argument("--" + name.replace("_", "-"), type=int, default=0,
                        help=f"ClientConfig.{name}; 0: the client's default")  # fmt: skip
    ap.add_argument("--codec", default="lossless", choices=tuple(CODECS), help="the KV deltas' codec")
    ap.add_argument("--backend", default="onnx", choices=BACKENDS, help="the client's drafter runtime")
    ap.add_argument("--precision", default="fp32", choices=PRECISIONS, help="the ONNX client part's weights")
    ap.add_argument("--threads", type=int, default=1, help="the ONNX drafter's intra-op threads (ClientConfig.threads)")
    ap.add_argument("--api-key", default="", help="bearer key, when the server asks for one")
    ap.add_argument("--warmup", type=int, default=1, help="untimed generations per mode first (graphs, caches)")
    ap.add_argument("--outages-s", type=float, nargs="*", default=[5, 30], help="outages to measure (none: skip)")
    ap.add_argument(
        "--outage-mode", default="chain", choices=(*MODES, ADAPTIVE), help="the client's mode in outage runs"
    )
    ap.add_argument("--outage-rtt-ms", type=float, default=50, help="the link of the outage runs: RTT")
    ap.add_argument("--outage-mbps", type=float, default=10, help="the link of the outage runs: bandwidth")
    ap.add_argument("--pace", type=float, default=20.0, help="tokens/s the client writes at in the outage runs")
    ap.add_argument("--plot", type=Path, default=None, help="write tokens/s vs RTT here (PNG)")
    ap.add_argument("--quick", action="store_true", help="a sanity run: RTT 0 and 10 ms, 100 Mbit/s, 16 tokens, "
                    "idle server, no outage, no warm-up")  # fmt: skip
    return ap


def settings(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, `--quick` applied and checked (argparse's one line and status 2 when they cannot run)."""
    ap = parser()
    args = ap.parse_args(argv)
    if args.quick:
        args.rtt_ms, args.mbps, args.new_tokens, args.outages_s, args.warmup = [0, 10], [100], 16, [], 0
        args.load = ["0"]
    if args.new_tokens < 2 or args.k < 1 or args.pace <= 0 or min(args.rtt_ms) < 0 or min(args.mbps) < 0:
        ap.error("--new-tokens must be at least 2, --k at least 1, --pace positive, RTTs and bandwidths >= 0")
    if any(load != FULL and not (load.isdigit()) for load in args.load):
        ap.error(f"--load takes client counts (0 and up) or {FULL}")
    if args.outages_s and client_options(args.outage_mode) is None:
        ap.error(f"--outage-mode {args.outage_mode}: this client has no ClientConfig.tree / pipeline")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = settings(argv)
    for address in (args.server, args.server_draft_server):
        if address:
            reach(args, address)
    rows, outages, where, model = [], [], [], ""
    plain = [m for m in args.modes if m != SERVER_DRAFT]
    for server_draft, modes in ((False, plain), (True, [SERVER_DRAFT] if SERVER_DRAFT in args.modes else [])):
        if not modes:
            continue
        if server_draft and args.server and not args.server_draft_server:
            rows += [{"mode": SERVER_DRAFT, "load": load, "load_clients": None, "rtt_ms": rtt, "mbps": mbps,
                      "skipped": "no --server-draft-server"} for load in args.load for mbps in args.mbps
                     for rtt in args.rtt_ms]  # fmt: skip
            continue
        part, lost, here, model_id = run_server(args, modes, server_draft)
        rows, outages, model = rows + part, outages + lost, model or model_id
        where.append(here)
    order = {key: {v: i for i, v in enumerate(values)} for key, values in
             (("load", args.load), ("mbps", args.mbps), ("rtt_ms", args.rtt_ms), ("mode", args.modes))}  # fmt: skip
    rows.sort(key=lambda r: tuple(order[k][r[k]] for k in ("load", "mbps", "rtt_ms", "mode")))
    add_bounds(rows)
    cells = summary(rows, args.modes)
    where = "; ".join(where) + f", netsim in a {args.netsim}"
    console = Console(width=200)
    console.print(grid_table(args, rows, where))
    console.print(summary_table(args, cells))
    if outages:
        console.print(outage_table(args, outages))
    if args.plot:
        plot(rows, args.plot, console)
    flags = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    record = {"bench": "link", "device": where, "host": platform.node(), "model": model,
              "torch": _torch_version(), "args": flags, "prompt": PROMPT, "definitions": DEFINITIONS, "rows": rows,
              "summary": cells, "outages": outages}  # fmt: skip
    print(json.dumps(record))
    return record


def run_server(args: argparse.Namespace, modes: list[str], server_draft: bool) -> tuple[list, list, str, str]:
    """Every cell of `modes` against one server (--server-draft's when `server_draft`): in this process unless
    --server (--server-draft-server) names one; each load of --load in turn, its background clients running
    through that load's cells. Then, on the plain server, the outage runs. Its rows, outages, where it ran and
    the model's id."""
    remote = args.server_draft_server if server_draft else args.server
    local = LocalServer(args, server_draft) if not remote else None
    restore_threads = _one_thread(local)
    rig, rows, outages = None, [], []
    try:
        address = remote or local.address
        metrics = "" if server_draft else args.metrics_url
        rig = Rig(address, args, local.service if local else None, metrics)
        info, tokenizer = pair(rig)
        for _ in range(args.warmup):
            for mode in modes:
                measure(rig, mode, info, tokenizer)
        for load in args.load:
            n = load_clients(load, local, args)
            background = Background(address, n, args)
            try:
                for mbps in args.mbps:
                    for rtt in args.rtt_ms:
                        rig.shape(rtt, mbps)
                        for mode in modes:
                            head = {"mode": mode, "load": load, "load_clients": n, "rtt_ms": rtt, "mbps": mbps}
                            rows.append(head | measure(rig, mode, info, tokenizer))
            finally:
                background.close()
        if args.outages_s and not server_draft and not info.server_only:
            rig.shape(args.outage_rtt_ms, args.outage_mbps)
            outages = [run_outage(rig, o, args.outage_mode) for o in args.outages_s]
    except ServerError as e:  # a refusal reconnecting will not fix (a key, a model the client refuses): one line
        fail(str(e))
    finally:
        if rig is not None:
            rig.close()
        if local is not None:
            local.close()
        restore_threads()
    where = local.describe() if local else f"server at {remote}"
    return rows, outages, (f"{SERVER_DRAFT}: " if server_draft else "") + where, info.model_id


def load_clients(load: str, local: LocalServer | None, args: argparse.Namespace) -> int:
    """Background clients of a --load value: a count, or FULL: the server's max batch (--full-load for --server)."""
    if load != FULL:
        return int(load)
    return local.max_batch if local is not None else args.full_load


def summary(rows: list[dict], modes: list[str]) -> list[dict]:
    """Per (load, bandwidth, RTT): each mode's tokens/s, the better of server-only and the hybrid modes (server-draft
    is another deployment, not an option of this client), and adaptive's ratio to it (the issue's target: >= 0.95)."""
    cells: dict[tuple, dict] = {}
    for r in rows:
        key = (r["load"], r["mbps"], r["rtt_ms"])
        cell_ = cells.setdefault(key, {"load": r["load"], "load_clients": r["load_clients"], "mbps": r["mbps"],
                                       "rtt_ms": r["rtt_ms"], "tok_s": {}})  # fmt: skip
        cell_["tok_s"][r["mode"]] = r.get("tok_s")
    for c in cells.values():
        rivals = {m: v for m, v in c["tok_s"].items() if v and (m == SERVER_ONLY or m in MODES)}
        best = max(rivals, key=rivals.get, default=None)
        mine = c["tok_s"].get(ADAPTIVE)
        c |= {"best_other": best, "best_other_tok_s": rivals.get(best),
              "adaptive_ratio": mine / rivals[best] if mine and best else None}  # fmt: skip
    return list(cells.values())


def reach(args: argparse.Namespace, address: str) -> None:
    """Ask a server for its ModelInfo directly, before netsim is in the way: one line and exit when nothing answers
    there (transport.first_contact's hint names what does)."""
    session = EdgeSession(ClientConfig(server=address, api_key=args.api_key, connect_timeout_s=10.0))
    try:
        session.model_info()
    except ServerError as e:
        fail(str(e))
    finally:
        session.close()


def fail(message: str) -> NoReturn:
    """End the bench with one line on stderr and status 2 (what `tether-server` does for an actionable error)."""
    print(f"bench/link.py: {message}", file=sys.stderr)
    raise SystemExit(2)


def _one_thread(local: LocalServer | None) -> Callable[[], None]:
    """A CPU server shares the cores with the client: one intra-op thread for torch; returns what restores it."""
    if local is None or local.device.startswith("cuda"):
        return lambda: None
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    return lambda: torch.set_num_threads(before)


def _torch_version() -> str | None:
    torch = sys.modules.get("torch")
    return torch.__version__ if torch is not None else None


def _num(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def grid_table(args: argparse.Namespace, rows: list[dict], where: str) -> Table:
    t = Table(title=f"end to end over netsim: {where}; {args.new_tokens} tokens, greedy, k={args.k}, codec "
                    f"{args.codec}, {args.backend} client; bound = tau / (RTT + step)")  # fmt: skip
    columns = ("mode", "load", "RTT ms", "Mbit/s", "tok/s", "batch", "tau", "round ms", "server ms", "bound",
               "x bound", "bound@0", "x bound@0", "payload B/tok", "wire B/tok", "pre-drafted", "work ms", "wait ms",
               "to send ms", "overhead ms")  # fmt: skip
    for c in columns:
        t.add_column(c, justify="right")
    for r in rows:
        head = (r["mode"], _load(r), f"{r['rtt_ms']:g}", f"{r['mbps']:g}")
        if "skipped" in r or "failed" in r:
            t.add_row(*head, "failed" if "failed" in r else "n/a", *["-"] * (len(columns) - 5))
            continue
        hits = f"{r['pipeline_hits']}/{r['rounds']}" if r.get("pipeline_hits") is not None else "-"
        t.add_row(*head, _num(r["tok_s"], ".1f"), _num(r["mean_batch"], ".1f"), _num(r["tau"], ".2f"),
                  _num(r["round_ms"], ".1f"),
                  _num(r["server_round_ms"], ".2f"), _num(r["bound_tok_s"], ".0f"), _num(r["bound_ratio"], ".2f"),
                  _num(r["bound_rtt0_tok_s"], ".0f"), _num(r["bound_rtt0_ratio"], ".2f"),
                  _num(r["payload_B_per_tok"], ",.0f"), _num(r["wire_B_per_tok"], ",.0f"), hits,
                  *(_num(r.get(key), ".1f") for key in (*ROUND_PARTS, "overhead_ms")))  # fmt: skip
    return t


def _load(r: dict) -> str:
    n = r.get("load_clients")
    return r["load"] if n is None or r["load"] != FULL else f"{FULL} ({n})"


def summary_table(args: argparse.Namespace, cells: list[dict]) -> Table:
    """Tokens/s per mode by load and RTT, and adaptive's ratio to the better of server-only and the hybrid."""
    modes = list(args.modes)
    t = Table(title=f"tokens/s by server load (background Generate clients) and RTT, {args.new_tokens} tokens; "
              f"adaptive / the better of {SERVER_ONLY} and hybrid (target >= 0.95)")  # fmt: skip
    for c in ("load", "Mbit/s", "RTT ms", *modes, "adaptive / best", "best"):
        t.add_column(c, justify="right")
    for c in cells:
        t.add_row(_load(c), f"{c['mbps']:g}", f"{c['rtt_ms']:g}", *(_num(c["tok_s"].get(m), ".0f") for m in modes),
                  _num(c["adaptive_ratio"], ".2f"), c["best_other"] or "-")  # fmt: skip
    return t


def outage_table(args: argparse.Namespace, outages: list[dict]) -> Table:
    t = Table(title=f"resync after an outage ({args.outage_mode}, RTT {args.outage_rtt_ms:g} ms, {args.outage_mbps:g} "
                    f"Mbit/s, client at {args.pace:g} tok/s, policy keep)")  # fmt: skip
    for c in ("outage s", "offline tokens", "resyncs", "resync ms", "resync up B", "resync down B"):
        t.add_column(c, justify="right")
    for o in outages:
        t.add_row(f"{o['outage_s']:g}", str(o["offline_tokens"]), str(o["resyncs"]), _num(o["resync_ms"], ".0f"),
                  f"{o['resync_up_B']:,}", f"{o['resync_down_B']:,}")  # fmt: skip
    return t


def plot(rows: list[dict], path: Path, console: Console) -> bool:
    """Tokens/s against RTT, a panel per load and bandwidth: a line per mode, each hybrid mode's bound dashed in its
    colour (bound_tok_s, else bound_rtt0_tok_s). False (and one line said) without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        console.print(f"matplotlib is not installed: no plot written to {path}")
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured = [r for r in rows if r.get("tok_s")]
    panels = list(dict.fromkeys((r["load"], r["mbps"]) for r in measured))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels) + 1, 4.6), sharey=True, squeeze=False,
                             layout="constrained")  # fmt: skip
    for ax, (load, mbps) in zip(axes[0], panels, strict=True):
        for i, mode in enumerate(dict.fromkeys(r["mode"] for r in measured)):
            mine = sorted((r for r in measured if r["mode"] == mode and r["mbps"] == mbps and r["load"] == load),
                          key=lambda r: r["rtt_ms"])  # fmt: skip
            if not mine:
                continue
            colour = f"C{i}"
            ax.plot([r["rtt_ms"] for r in mine], [r["tok_s"] for r in mine], marker="o", color=colour, label=mode)
            bound = [(r["rtt_ms"], r["bound_tok_s"] or r["bound_rtt0_tok_s"]) for r in mine]
            bound = [(x, y) for x, y in bound if y]
            if bound:
                ax.plot(*zip(*bound, strict=True), linestyle="--", color=colour, alpha=0.6, label=f"{mode} bound")
        loaded = "idle" if load == "0" else f"load {load}"
        ax.set_title(f"{loaded}, " + ("unlimited" if mbps == 0 else f"{mbps:g} Mbit/s"))
        ax.set_xlabel("RTT (ms)")
        ax.set_yscale("log")
        ax.grid(alpha=0.3, which="both")
    axes[0][0].set_ylabel("tokens / s, end to end")
    fig.legend(
        *axes[0][0].get_legend_handles_labels(),
        loc="outside lower center",
        ncol=min(5, 2 + len(panels)),
        fontsize="small",
    )
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


if __name__ == "__main__":
    main()
