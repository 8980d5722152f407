"""`tether-server serve`: load the target and drafter, serve `tether.v1.Tether` until SIGTERM or Ctrl-C.

Contract: prints one line `listening on HOST:PORT` once the port is bound (port 0 picks a free one), serves
until SIGTERM/SIGINT, then stops taking new calls and gives the ones in flight `grace_s` seconds to finish.
Defaults serve deploy/models on 127.0.0.1:50051. With `--http-port P` (0: any free port) it also serves the
OpenAI-compatible HTTP API (tether.server.http_api) on `--http-host`, on the same event loop, and prints a second
line `http listening on HOST:PORT`; it takes the same API keys and TLS files as gRPC. `--drafter none` serves
without a drafter: server-only decoding over Generate and HTTP (ModelInfo.server_only; Session, Resync and
FetchWeights are refused with REASON_NO_DRAFTER).

A port that another process listens on (--port, --metrics-port, --http-port), even one that shares its port with
SO_REUSEPORT, is refused in one line (CommandError, exit status 2) before the models load, and again at the bind
should it be taken meanwhile (what start-up took is given back); gRPC binds without SO_REUSEPORT unless --frontends
share the port among themselves (tether.server.rpc_server). --device cuda on a machine without it is one line too.

Start-up is logged by phase at INFO: the kernel cache in use, models loaded in X s, the kernel warm-up in X s and
how many files it added to the cache, then one line `ready in X s (warm cache|cold cache|no kernel warm-up)`,
counted from the call of `serve` (after Python's imports) to the port taking calls. A warm-up that adds nothing
to Triton's cache found every kernel and autotuning result there: a warm start (tether.server.warm_cache).
`--cache-dir DIR` keeps that cache in DIR (empty: Triton's own, TRITON_CACHE_DIR or ~/.triton/cache), and the ONNX
client part's exports in DIR/onnx (tether.server.client_export: made on the first request for each precision, or
before the port opens for those `--onnx-precisions` names).
`warm(cfg)` (`tether-server warm`) loads the models, runs the same warm-up and exits: it fills a cache directory
before the first `serve` (a Kubernetes initContainer, a provisioning step; an image build has no GPU).

    tether-server serve --port 50051 --max-sessions 64 --cache-dir /var/cache/tether
    tether-server serve --http-port 8000 --drafter none   # an OpenAI-compatible endpoint, the target decoding alone
    tether-server serve --tp 2          # a tensor-parallel target over 2 GPUs (tether.server.tp_serve)
    tether-server serve --engines 3 --frontends 2   # 3 engine processes on one GPU (tether.server.engines)
    tether-server warm --cache-dir /var/cache/tether
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from tether.server import heap
from tether.server.batcher import warm_up
from tether.server.engines import EngineWorkers, engine_share
from tether.server.generate import DTYPES, attention_backend, default_model_dir, load, pick_device
from tether.server.http_api import start_http
from tether.server.logs import configure_logging
from tether.server.metrics import serve_metrics
from tether.server.pool_budget import DEFAULT_SHARE, resolve_kv_pool
from tether.server.rounds import step_runner
from tether.server.rpc_server import TLSFiles, make_server
from tether.server.service import ServiceConfig, TetherService
from tether.server.tp_serve import TPTarget, join_rank0, shard, start_followers
from tether.server.warm_cache import (
    count_entries,
    current_dir,
    kernel_cache_dir,
    load_shapes,
    record_shapes,
    use_cache_dir,
)
from tether.shared.chat_template import ChatFormat
from tether.shared.checkpoint import fingerprint
from tether.shared.cli_support import CommandError, Refusal, address_in_use, host, port, port_or_off
from tether.shared.drafter import load_drafter
from tether.shared.ids import MAX_ENGINES
from tether.shared.model import Transformer
from tether.shared.weights import ONNX_PRECISIONS, client_part_tensors

log = logging.getLogger("tether.server")


@dataclass(frozen=True)
class ServeConfig:
    model: str = str(default_model_dir())  # target model directory, or a hub id in the local Hugging Face cache
    revision: str = ""  # the hub revision (branch, tag or commit) when --model is a hub id; empty: main
    drafter: str = str(default_model_dir("drafter"))  # drafter directory trained for that target; "none": no drafter
    host: str = "127.0.0.1"  # address to listen on
    port: int = 50051  # port to listen on (0 = any free port)
    device: str = ""  # "cpu" / "cuda"; empty = cuda when present
    dtype: str = ""  # weights and activations; empty = bfloat16 on CUDA, float32 on CPU
    attention: str = "auto"  # attention backend; auto = the Triton MoDA kernels on CUDA, the reference elsewhere
    max_sessions: int = 256  # sessions held at once (the least recently used idle one is evicted past it)
    max_sessions_per_key: int = 64  # sessions one API key may hold at once
    session_lease_s: float = 300.0  # a session idle this long expires: its quota and KV memory go back
    stream_idle_s: float = 120.0  # a Session stream that sends nothing this long is closed (its session stays)
    max_streams: int = 4096  # Session and Generate streams open at once, over all callers
    max_model_calls_per_caller: int = 128  # calls of one key (without keys, one host) waiting for the model threads
    api_keys: str = ""  # file with one API key per line ('#' comments); empty = no authentication
    metrics_port: int = 0  # Prometheus metrics over HTTP on host:metrics_port; 0 = off
    tls_cert: str = ""  # PEM certificate: serve over TLS (with tls_key)
    tls_key: str = ""  # PEM private key of tls_cert
    tls_client_ca: str = ""  # PEM CA bundle: require client certificates signed by it (mTLS)
    grace_s: float = 5.0  # seconds in-flight calls get to finish on shutdown
    # Past the pool the least recently used idle sessions are evicted. Auto: --kv-pool-share of the device's free
    # memory once the models are loaded, split over --engines (256 MB off CUDA): tether.server.pool_budget.
    kv_pool_mb: int = 0  # MB of the paged KV pool all sessions share; 0 = auto (a share of the free device memory)
    kv_pool_share: float = DEFAULT_SHARE  # with --kv-pool-mb 0: the part of the free device memory the pool takes
    kv_block_size: int = 16  # positions per KV block
    prefill_chunk: int = 2048  # prompt / resync-history positions per prefill forward (bounds attention memory)
    tp: int = 1  # tensor-parallel ranks: one process per GPU, rank 0 speaks gRPC (gloo ranks on CPU)
    log_format: str = "text"  # json: one JSON object per line with session ids (for log pipelines)
    log_level: str = "info"  # the least severe log records written
    cache_dir: str = ""  # keeps compiled kernels + autotuning across restarts (DIR/triton); empty = Triton's default
    # The ONNX client part is exported on its first request, per precision, and kept in DIR/onnx with --cache-dir.
    onnx_precisions: str = ""  # export these before the port opens: a comma list of fp32, fp16, int8 (e.g. fp32,int8)
    http_host: str = "127.0.0.1"  # address of the OpenAI-compatible HTTP API
    http_port: int = -1  # port of the OpenAI-compatible HTTP API: -1 = off, 0 = any free port
    http_max_streams: int = 256  # HTTP generations at once; past it requests get 429 with Retry-After
    http_max_n: int = 8  # choices (n) one HTTP request may ask for; each is a generation of http_max_streams
    served_model_name: str = ""  # name in ModelInfo and /v1/models; empty: tether-default, or the model folder's name
    round_graph_tokens: int = 6  # capture at start the step graphs of rounds this long (k + 1), all batches; 0 = none
    frontends: int = 0  # gRPC in this many front-end processes sharing the port, the models here; 0 = in this process
    # Several engine processes on the device, each with a copy of the models, its share of the KV pool and sessions;
    # the front ends route each session's calls to the engine holding it (tether.server.engines). Needs frontends.
    engines: int = 1  # engine processes (the host work of one process bounds rounds/s before the GPU does)


# The fields that take one of a fixed set of values, and those whose values a function checks (the CLI's flags).
CHOICES = {"dtype": ("", *DTYPES), "attention": ("auto", "triton", "reference", "sdpa"), "log_format": ("text", "json"),
           "log_level": ("debug", "info", "warning", "error")}  # fmt: skip
TYPES = {
    "host": host("--port"),
    "http_host": host("--http-port"),
    "port": port,
    "metrics_port": port,
    "http_port": port_or_off,
}

# The flags of `tether-server warm`: what decides which kernels the warm-up compiles, and where they go.
WARM_FIELDS = ("model", "drafter", "device", "dtype", "attention", "kv_pool_mb", "kv_block_size", "prefill_chunk",
               "cache_dir", "round_graph_tokens", "log_format", "log_level")  # fmt: skip


def check_ports(cfg: ServeConfig) -> None:
    """Refuse a port out of range or taken before the models load (seconds); the binds check again (a race)."""
    for flag, number in (("--port", cfg.port), ("--metrics-port", cfg.metrics_port)):
        if not 0 <= number <= 65535:
            raise ValueError(f"{flag} is a port from 0 to 65535, got {number}")
        if address_in_use(cfg.host, number):
            raise CommandError(Refusal.ADDRESS_IN_USE, f"{flag} {number}: {cfg.host}:{number} is in use by another "
                               "process (a tether-server already running?): stop it, or pick another port")  # fmt: skip
    if cfg.metrics_port and cfg.metrics_port == cfg.port:
        raise ValueError(f"--metrics-port and --port are both {cfg.port}: give each its own port")
    if cfg.http_port > 0 and address_in_use(cfg.http_host, cfg.http_port):
        raise CommandError(Refusal.ADDRESS_IN_USE, f"--http-port {cfg.http_port}: {cfg.http_host}:{cfg.http_port} is "
                           "in use by another process: stop it, or pick another port")  # fmt: skip


def start_metrics(service: TetherService, host_name: str, number: int) -> None:
    """Prometheus metrics over HTTP on host_name:number, or one CommandError when it cannot listen there."""
    try:
        serve_metrics(service.metrics, host_name, number)
    except OSError as e:
        reason = Refusal.ADDRESS_IN_USE if e.errno == errno.EADDRINUSE else Refusal.CANNOT_LISTEN
        raise CommandError(reason, f"--metrics-port {number}: cannot listen on {host_name}:{number}: "
                           f"{e.strerror or e}") from None  # fmt: skip


def start_http_api(service: TetherService, model_id: str, config) -> tuple[object, int]:
    """The OpenAI-compatible HTTP API (tether.server.http_api), or one CommandError when it cannot listen."""
    try:
        return start_http(service, model_id, config)
    except OSError as e:
        reason = Refusal.ADDRESS_IN_USE if e.errno == errno.EADDRINUSE else Refusal.CANNOT_LISTEN
        raise CommandError(reason, f"--http-port {config.port}: cannot listen on {config.host}:{config.port}: "
                           f"{e.strerror or e}") from None  # fmt: skip


def read_api_keys(path: str) -> frozenset[str]:
    if not path:
        return frozenset()
    keys = [ln.strip() for ln in Path(path).read_text().splitlines()]
    keys = frozenset(k for k in keys if k and not k.startswith("#"))
    if not keys:
        raise ValueError(f"{path} holds no API keys")
    return keys


def use_cache(cfg: ServeConfig) -> Path:
    """Point Triton at --cache-dir (before anything compiles, and before --tp followers start: they inherit
    TRITON_CACHE_DIR); the directory Triton's cache is in either way."""
    kernel_dir = use_cache_dir(cfg.cache_dir) if cfg.cache_dir else kernel_cache_dir()
    log.info("kernel cache %s: %d files", kernel_dir, count_entries(kernel_dir))
    return kernel_dir


def service_config(cfg: ServeConfig) -> ServiceConfig:
    for name in (
        "max_sessions",
        "max_sessions_per_key",
        "max_streams",
        "max_model_calls_per_caller",
        "session_lease_s",
        "stream_idle_s",
    ):
        if not getattr(cfg, name) > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(cfg, name)}")
    # Auto is the CPU's fixed default here: the engine sizes the pool from the device's free memory once the models
    # are loaded (pool_budget.resolve_kv_pool). Both flags are checked here, before anything loads.
    pool = resolve_kv_pool(cfg.kv_pool_mb, cfg.kv_pool_share, "cpu", engines=cfg.engines)
    return ServiceConfig(max_sessions=cfg.max_sessions, api_keys=read_api_keys(cfg.api_keys), model_id=model_name(cfg),
                         max_sessions_per_key=cfg.max_sessions_per_key, session_lease_s=cfg.session_lease_s,
                         stream_idle_s=cfg.stream_idle_s, max_streams=cfg.max_streams,
                         max_model_calls_per_caller=cfg.max_model_calls_per_caller,
                         kv_pool_bytes=pool.bytes, kv_block_size=cfg.kv_block_size,
                         prefill_chunk=cfg.prefill_chunk)  # fmt: skip


def model_name(cfg: ServeConfig) -> str:
    """--served-model-name (serve sets it to the hub id of a --model given as one), else "tether-default" for the
    default models, else the model directory's name."""
    if cfg.served_model_name:
        return cfg.served_model_name
    model = Path(cfg.model).resolve()
    return "tether-default" if model == default_model_dir().resolve() else model.name


def load_models(cfg: ServeConfig, device: str):
    t0 = time.perf_counter()
    target, tokenizer = load(cfg.model, device, cfg.dtype, cfg.attention, fused=None if cfg.tp == 1 else False)
    model_fp = fingerprint(cfg.model)
    drafter = None
    if cfg.drafter != "none":
        drafter = load_drafter(cfg.drafter, target, target_fingerprint=model_fp)
    log.info("models loaded in %.1f s", time.perf_counter() - t0, extra={"event": "models_loaded"})
    return target, tokenizer, drafter, model_fp


def _http_config(cfg: ServeConfig, config: ServiceConfig):
    from tether.shared.openai_app import HttpConfig

    return HttpConfig(host=cfg.http_host, port=cfg.http_port, api_keys=config.api_keys,
                      max_streams=cfg.http_max_streams, max_n=cfg.http_max_n, grace_s=cfg.grace_s,
                      tls_cert=cfg.tls_cert, tls_key=cfg.tls_key, tls_client_ca=cfg.tls_client_ca)  # fmt: skip


def warm_kernels(target, pool, kernel_dir: Path, drafter=None, round_tokens: int = 0) -> str:
    """serve's kernel warm-up (batcher.warm_up) on the Triton backend, then the step graphs: those an earlier run
    recorded, and with a drafter those of every batch size and width for rounds of `round_tokens` tokens; "warm
    cache" when it added no file to Triton's cache (everything was there), "cold cache" when it compiled or tuned
    anything."""
    if not (isinstance(target, Transformer) and target.backend == "triton"):
        return "no kernel warm-up"
    from tether.kernels.moda_prefill import interpreting

    before, t0 = count_entries(kernel_dir), time.perf_counter()
    warm_up(target, pool, drafter=drafter)
    root, runner = current_dir(), step_runner(target, pool)
    if root is not None:  # the step graphs the last run captured (serve records them when it stops)
        n = runner.capture_shapes(load_shapes(root, _shapes_key(target, pool)), drafter=drafter)
        log.info("captured %d step graphs recorded by an earlier run", n)
    if drafter is not None and round_tokens > 0:
        t1 = time.perf_counter()
        n = runner.capture_shapes(runner.round_shapes(round_tokens), drafter=drafter)
        log.info("captured %d step graphs for rounds of %d tokens in %.1f s", n, round_tokens, time.perf_counter() - t1)
    seconds, added = time.perf_counter() - t0, count_entries(kernel_dir) - before
    if interpreting():
        state = "interpreted kernels, nothing cached"
    else:
        state = "cold cache" if added > 0 else "warm cache"
    log.info("warm-up: attention kernels compiled and tuned in %.1f s (%s: %d new files in %s, %d before)", seconds,
             state, added, kernel_dir, before, extra={"event": "warm_up", "warm_up_s": round(seconds, 2),
                                                      "cache_files_added": added})  # fmt: skip
    return state


def _shapes_key(target: Transformer, pool) -> str:
    """Step graphs are captured for one model, dtype and block size."""
    ident = json.dumps([target.cfg.to_dict(), str(pool.k.dtype), pool.block_size], sort_keys=True)
    return hashlib.sha256(ident.encode()).hexdigest()[:16]


def _record_shapes(target, pool) -> None:
    root = current_dir()
    if root is not None and isinstance(target, Transformer) and target.backend == "triton":
        record_shapes(root, _shapes_key(target, pool), step_runner(target, pool).shapes())


def warm(cfg: ServeConfig) -> int:
    """`tether-server warm`: load the models, run serve's kernel warm-up into the cache directory, exit."""
    t_start = time.perf_counter()
    configure_logging(cfg.log_format, cfg.log_level)
    device = pick_device(cfg.device)
    backend = attention_backend(device, cfg.attention)
    if backend != "triton":
        raise ValueError(f"nothing to warm on {device}: the {backend} attention backend compiles no kernels "
                         "(the Triton kernels need a CUDA device)")  # fmt: skip
    kernel_dir = use_cache(cfg)
    config = service_config(cfg)
    target, tokenizer, drafter, model_fp = load_models(cfg, device)
    torch.set_grad_enabled(False)
    service = TetherService(target, drafter, tokenizer, config, model_fingerprint=model_fp)
    try:
        state = warm_kernels(target, service.pool, kernel_dir, drafter, cfg.round_graph_tokens)
    finally:
        service.close()
    print(f"warmed {kernel_dir} in {time.perf_counter() - t_start:.1f} s ({state})", flush=True)
    return 0


def serve(cfg: ServeConfig, ready: threading.Event | None = None) -> int:
    t_start = time.perf_counter()
    configure_logging(cfg.log_format, cfg.log_level)
    device = pick_device(cfg.device)
    if bool(cfg.tls_cert) != bool(cfg.tls_key) or (cfg.tls_client_ca and not cfg.tls_cert):
        raise ValueError("TLS needs both --tls-cert and --tls-key (and --tls-client-ca only with them)")
    if cfg.tp < 1:
        raise ValueError(f"--tp must be at least 1, got {cfg.tp}")
    if cfg.prefill_chunk < 1:
        raise ValueError(f"--prefill-chunk must be at least 1, got {cfg.prefill_chunk}")
    if cfg.frontends < 0:
        raise ValueError(f"--frontends is 0 (gRPC in this process) or more, got {cfg.frontends}")
    if not 1 <= cfg.engines <= MAX_ENGINES:
        raise ValueError(f"--engines is 1 to {MAX_ENGINES}, got {cfg.engines}")
    if cfg.engines > 1 and (cfg.frontends < 1 or cfg.tp > 1 or 0 < cfg.kv_pool_mb < cfg.engines):
        raise ValueError("--engines E > 1 needs --frontends N >= 1 (they route the calls), --tp 1, and --kv-pool-mb 0 "
                         "(auto) or at least E MB (each engine takes an even share)")  # fmt: skip
    if cfg.tp > 1 and device.startswith("cuda") and torch.cuda.device_count() < cfg.tp:
        raise ValueError(f"--tp {cfg.tp} needs {cfg.tp} GPUs, this host has {torch.cuda.device_count()}")
    whole, cfg = cfg, engine_share(cfg, 0)  # this process is engine 0: its share of the pool and the limits
    config = service_config(cfg)
    if whole.engines > 1:
        config = dataclasses.replace(config, engine=0)
    precisions = [p for p in cfg.onnx_precisions.split(",") if p]
    if not set(precisions) <= set(ONNX_PRECISIONS):
        raise ValueError(f"--onnx-precisions takes {', '.join(ONNX_PRECISIONS)}, got {cfg.onnx_precisions!r}")
    if precisions and cfg.drafter == "none":
        raise ValueError("--onnx-precisions exports the drafter's client part: it needs a drafter, not --drafter none")
    if not -1 <= cfg.http_port <= 65535 or cfg.http_max_streams < 1 or cfg.http_max_n < 1:
        raise ValueError("--http-port is -1 (off), 0 (any free port) or a port; --http-max-streams and --http-max-n "
                         "at least 1")  # fmt: skip
    check_ports(cfg)
    kernel_dir = use_cache(cfg)
    workers = EngineWorkers(whole) if whole.engines > 1 else None  # they load and warm up while this one does
    try:
        return _serve(cfg, whole, config, device, precisions, kernel_dir, workers, t_start, ready)
    finally:
        if workers is not None:
            workers.stop()


def _serve(cfg: ServeConfig, whole: ServeConfig, config: ServiceConfig, device: str, precisions: list[str],
           kernel_dir: Path, workers: EngineWorkers | None, t_start: float,
           ready: threading.Event | None) -> int:  # fmt: skip
    """serve, once its flags are checked: `cfg` is this engine's share of `whole`, the command line's."""
    followers, tp_target = [], None
    if cfg.tp > 1:
        kind = "cuda" if device.startswith("cuda") else "cpu"
        followers, port = start_followers(cfg.tp, cfg.model, kind, cfg.dtype, config.kv_pool_bytes,
                                          cfg.kv_block_size, cfg.attention)  # fmt: skip
        cmd_group = join_rank0(cfg.tp, port, kind)
        device = "cuda:0" if kind == "cuda" else "cpu"
    target, tokenizer, drafter, model_fp = load_models(cfg, device)
    torch.set_grad_enabled(False)
    extra = {}
    if cfg.tp > 1:
        # The client part ships whole weights: take them before this rank keeps only its shard.
        if drafter is not None:
            part = client_part_tensors(target, drafter)
            extra["client_weights"] = {k: v.detach().cpu().clone() for k, v in part.items()}
        tp_target = TPTarget(shard(target, 0, cfg.tp), cmd_group)
        extra["pool"] = tp_target.make_pool(config.kv_pool_bytes, config.kv_block_size)
        target = tp_target
    if cfg.cache_dir:
        extra["export_dir"] = Path(cfg.cache_dir).expanduser() / "onnx"
    chat = ChatFormat.from_model_dir(cfg.model, tokenizer)
    service = TetherService(target, drafter, tokenizer, config, model_fingerprint=model_fp, chat_format=chat, **extra)
    for precision in precisions:
        t0 = time.perf_counter()
        service.exporter.part(precision)
        log.info("ONNX client part (%s) ready in %.1f s", precision, time.perf_counter() - t0)
    cache_state = warm_kernels(target, service.pool, kernel_dir, drafter, cfg.round_graph_tokens)
    frozen = heap.settle()  # start-up's heap out of every later collection's walk (tether.server.heap)
    pauses = heap.GCPauses(service.metrics.gc_pause).install()
    log.info("heap settled: %d objects frozen out of the garbage collector's walks", frozen)
    tls = TLSFiles(cfg.tls_cert, cfg.tls_key, cfg.tls_client_ca) if cfg.tls_cert else None
    engines = workers.wait_ready() if workers is not None else []

    def give_back() -> None:
        """What start-up took, when a port was taken since serve checked it."""
        pauses.remove()
        heap.release()
        service.close()
        if tp_target is not None:
            tp_target.stop()
            for p in followers:
                p.terminate()

    server = None
    try:
        server, port = make_server(service, f"{cfg.host}:{cfg.port}", tls=tls, frontends=cfg.frontends,
                                   engines=engines, log_format=cfg.log_format, log_level=cfg.log_level)  # fmt: skip
        if cfg.metrics_port:
            start_metrics(service, cfg.host, cfg.metrics_port)
    except CommandError:
        if server is not None:
            server.stop(None)  # the front ends, if any, already took calls
        give_back()
        raise
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    server.start()
    notes = [f"tensor-parallel over {cfg.tp} ranks"] if cfg.tp > 1 else []
    notes += [f"{cfg.frontends} front-end processes"] if cfg.frontends else []
    notes += [f"{whole.engines} engine processes"] if whole.engines > 1 else []
    print(f"listening on {cfg.host}:{port}" + (f" ({', '.join(notes)})" if notes else ""), flush=True)
    http = None
    if cfg.http_port >= 0:
        try:
            http, http_port = start_http_api(service, config.model_id, _http_config(cfg, config))
        except CommandError:
            server.stop(None).wait(10)
            give_back()
            raise
        print(f"http listening on {cfg.http_host}:{http_port}", flush=True)
    ready_s = time.perf_counter() - t_start
    log.info("ready in %.1f s (%s)", ready_s, cache_state,
             extra={"event": "ready", "ready_s": round(ready_s, 2), "kernel_cache": cache_state})  # fmt: skip
    if ready is not None:
        ready.set()
    # Wake up now and then: a signal the kernel hands to another thread (gloo's, gRPC's) only sets a flag that
    # the main thread acts on when it runs, and a plain wait() would sleep through it.
    while not stop.wait(0.5):
        pass
    if http is not None:
        http.stop()
    if not server.stop(grace=cfg.grace_s).wait(cfg.grace_s + 10):
        log.warning("calls still running %.0f s after the grace period; exiting anyway", cfg.grace_s + 10)
    _record_shapes(target, service.pool)
    pauses.remove()
    heap.release()
    service.close()
    if tp_target is not None:
        stopped = tp_target.stop()
        for p in followers:
            p.join(timeout=30 if stopped else 0)
            if p.is_alive():
                p.terminate()
    print("stopped", flush=True)
    if tp_target is not None:
        # A handler stuck in a collective would block the interpreter's exit (it joins the gRPC worker threads).
        os._exit(0)
    return 0
