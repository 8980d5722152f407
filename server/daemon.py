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

import errno
import logging
import os
import signal
import threading
import time

import torch

from tether.server.engine_core import Engine, use_cache
from tether.server.engines import EngineWorkers, engine_share
from tether.server.http_api import start_http
from tether.server.launch import LaunchPlan, listen, start_engines
from tether.server.logs import configure_logging
from tether.server.metrics import serve_metrics
from tether.server.model_loading import attention_backend, pick_device
from tether.server.rpc_server import TLSFiles
from tether.server.serve_config import ServeConfig, ServiceConfig, service_config
from tether.server.service import TetherService
from tether.shared.cli_support import CommandError, Refusal, address_in_use
from tether.shared.weights import ONNX_PRECISIONS

log = logging.getLogger("tether.server")


def check_ports(cfg: ServeConfig) -> None:
    """Refuse a port out of range or taken before the models load (seconds); the binds check again (a race)."""
    for flag, number in (("--port", cfg.port), ("--metrics-port", cfg.metrics_port)):
        if not 0 <= number <= 65535:
            raise ValueError(f"{flag} is a port from 0 to 65535, got {number}")
        if address_in_use(cfg.host, number):
            raise CommandError(
                Refusal.ADDRESS_IN_USE,
                f"{flag} {number}: {cfg.host}:{number} is in use by another "
                "process (a tether-server already running?): stop it, or pick another port",
            )
    if cfg.metrics_port and cfg.metrics_port == cfg.port:
        raise ValueError(f"--metrics-port and --port are both {cfg.port}: give each its own port")
    if cfg.http_port > 0 and address_in_use(cfg.http_host, cfg.http_port):
        raise CommandError(
            Refusal.ADDRESS_IN_USE,
            f"--http-port {cfg.http_port}: {cfg.http_host}:{cfg.http_port} is "
            "in use by another process: stop it, or pick another port",
        )


def start_metrics(engine: Engine, host_name: str, number: int) -> None:
    """Prometheus metrics over HTTP on host_name:number, or one CommandError when it cannot listen there."""
    try:
        serve_metrics(engine.metrics, host_name, number)
    except OSError as e:
        reason = Refusal.ADDRESS_IN_USE if e.errno == errno.EADDRINUSE else Refusal.CANNOT_LISTEN
        raise CommandError(
            reason, f"--metrics-port {number}: cannot listen on {host_name}:{number}: {e.strerror or e}"
        ) from None


def start_http_api(engine: Engine, model_id: str, config) -> tuple[object, int]:
    """The OpenAI-compatible HTTP API (tether.server.http_api), or one CommandError when it cannot listen."""
    try:
        return start_http(engine, model_id, config)
    except OSError as e:
        reason = Refusal.ADDRESS_IN_USE if e.errno == errno.EADDRINUSE else Refusal.CANNOT_LISTEN
        raise CommandError(
            reason, f"--http-port {config.port}: cannot listen on {config.host}:{config.port}: {e.strerror or e}"
        ) from None


def _http_config(cfg: ServeConfig, config: ServiceConfig):
    from tether.shared.openai_app import HttpConfig

    return HttpConfig(
        host=cfg.http_host,
        port=cfg.http_port,
        api_keys=config.api_keys,
        max_streams=cfg.http_max_streams,
        max_n=cfg.http_max_n,
        grace_s=cfg.grace_s,
        tls_cert=cfg.tls_cert,
        tls_key=cfg.tls_key,
        tls_client_ca=cfg.tls_client_ca,
    )


def warm(cfg: ServeConfig) -> int:
    """`tether-server warm`: build the engine, run serve's kernel warm-up into the cache directory, exit."""
    t_start = time.perf_counter()
    configure_logging(cfg.log_format, cfg.log_level)
    device = pick_device(cfg.device)
    backend = attention_backend(device, cfg.attention)
    if backend != "triton":
        raise ValueError(
            f"nothing to warm on {device}: the {backend} attention backend compiles no kernels "
            "(the Triton kernels need a CUDA device)"
        )
    torch.set_grad_enabled(False)
    engine = Engine.build(cfg)
    try:
        state = engine.warm_up()
    finally:
        engine.close()
    print(f"warmed {engine.kernel_dir} in {time.perf_counter() - t_start:.1f} s ({state})", flush=True)
    return 0


def serve(cfg: ServeConfig, ready: threading.Event | None = None) -> int:
    t_start = time.perf_counter()
    configure_logging(cfg.log_format, cfg.log_level)
    device = pick_device(cfg.device)
    if bool(cfg.tls_cert) != bool(cfg.tls_key) or (cfg.tls_client_ca and not cfg.tls_cert):
        raise ValueError("TLS needs both --tls-cert and --tls-key (and --tls-client-ca only with them)")
    plan = LaunchPlan.of(cfg)
    if cfg.prefill_chunk < 1:
        raise ValueError(f"--prefill-chunk must be at least 1, got {cfg.prefill_chunk}")
    if cfg.tp > 1 and device.startswith("cuda") and torch.cuda.device_count() < cfg.tp:
        raise ValueError(f"--tp {cfg.tp} needs {cfg.tp} GPUs, this host has {torch.cuda.device_count()}")
    whole, cfg = cfg, engine_share(cfg, 0)  # this process is engine 0: its share of the pool and the limits
    service_config(cfg)  # its limits checked before anything loads
    precisions = [p for p in cfg.onnx_precisions.split(",") if p]
    if not set(precisions) <= set(ONNX_PRECISIONS):
        raise ValueError(f"--onnx-precisions takes {', '.join(ONNX_PRECISIONS)}, got {cfg.onnx_precisions!r}")
    if precisions and cfg.drafter == "none":
        raise ValueError("--onnx-precisions exports the drafter's client part: it needs a drafter, not --drafter none")
    if not -1 <= cfg.http_port <= 65535 or cfg.http_max_streams < 1 or cfg.http_max_n < 1:
        raise ValueError(
            "--http-port is -1 (off), 0 (any free port) or a port; --http-max-streams and --http-max-n at least 1"
        )
    check_ports(cfg)
    if plan.engines > 1:
        use_cache(cfg)  # before the engine processes start: they inherit Triton's cache directory
    workers = start_engines(plan, whole)  # they load and warm up while this one does
    try:
        return _serve(cfg, plan, precisions, workers, t_start, ready)
    finally:
        if workers is not None:
            workers.stop()


def _serve(
    cfg: ServeConfig,
    plan: LaunchPlan,
    precisions: list[str],
    workers: EngineWorkers | None,
    t_start: float,
    ready: threading.Event | None,
) -> int:
    """serve, once its flags are checked: `cfg` is this engine's share of the command line's (engine 0's)."""
    torch.set_grad_enabled(False)
    engine = Engine.build(cfg, engine_index=0 if plan.engines > 1 else None)
    config = engine.config
    service = TetherService(engine)
    for precision in precisions:
        t0 = time.perf_counter()
        engine.exporter.part(precision)
        log.info("ONNX client part (%s) ready in %.1f s", precision, time.perf_counter() - t0)
    cache_state = engine.warm_up()
    engine.settle()
    tls = TLSFiles(cfg.tls_cert, cfg.tls_key, cfg.tls_client_ca) if cfg.tls_cert else None
    engines = workers.wait_ready() if workers is not None else []

    def give_back() -> None:
        """What start-up took, when a port was taken since serve checked it."""
        engine.close()

    server = None
    try:
        server, port = listen(
            service,
            f"{cfg.host}:{cfg.port}",
            plan,
            tls=tls,
            engine_sockets=engines,
            log_format=cfg.log_format,
            log_level=cfg.log_level,
        )
        if cfg.metrics_port:
            start_metrics(engine, cfg.host, cfg.metrics_port)
    except CommandError:
        if server is not None:
            server.stop(None)  # the front ends, if any, already took calls
        give_back()
        raise
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    server.start()
    notes = plan.notes()
    print(f"listening on {cfg.host}:{port}" + (f" ({', '.join(notes)})" if notes else ""), flush=True)
    http = None
    if cfg.http_port >= 0:
        try:
            http, http_port = start_http_api(engine, config.model_id, _http_config(cfg, config))
        except CommandError:
            server.stop(None).wait(10)
            give_back()
            raise
        print(f"http listening on {cfg.http_host}:{http_port}", flush=True)
    ready_s = time.perf_counter() - t_start
    log.info(
        "ready in %.1f s (%s)",
        ready_s,
        cache_state,
        extra={"event": "ready", "ready_s": round(ready_s, 2), "kernel_cache": cache_state},
    )
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
    engine.record_shapes()
    engine.close()
    print("stopped", flush=True)
    if cfg.tp > 1:
        # A handler stuck in a collective would block the interpreter's exit (it joins the gRPC worker threads).
        os._exit(0)
    return 0
