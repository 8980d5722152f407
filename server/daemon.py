"""`tether-server serve`: load the target and drafter, serve `tether.v1.Tether` until SIGTERM or Ctrl-C.

Contract: prints one line `listening on HOST:PORT` once the port is bound (port 0 picks a free one), serves
until SIGTERM/SIGINT, then stops taking new calls and gives the ones in flight `grace_s` seconds to finish.
Defaults serve deploy/models on 127.0.0.1:50051.

    tether-server serve --port 50051 --max-sessions 64
    tether-server serve --tp 2          # a tensor-parallel target over 2 GPUs (tether.server.tp_serve)
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from tether.server.batcher import warm_up
from tether.server.generate import default_model_dir, load, pick_device
from tether.server.logs import configure_logging
from tether.server.metrics import serve_metrics
from tether.server.rpc_server import TLSFiles, make_server
from tether.server.service import ServiceConfig, TetherService
from tether.server.tp import apply_tp
from tether.server.tp_serve import TPTarget, join_rank0, start_followers
from tether.shared.checkpoint import fingerprint
from tether.shared.drafter import load_drafter
from tether.shared.model import Transformer
from tether.shared.weights import client_part_tensors

log = logging.getLogger("tether.server")


@dataclass(frozen=True)
class ServeConfig:
    model: str = str(default_model_dir())  # target model directory
    drafter: str = str(default_model_dir("drafter"))  # drafter directory trained for that target
    host: str = "127.0.0.1"  # address to listen on
    port: int = 50051  # port to listen on (0 = any free port)
    device: str = ""  # "cpu" / "cuda"; empty = cuda when present
    dtype: str = ""  # "float32" / "bfloat16" / "float16"; empty = bfloat16 on CUDA, float32 on CPU
    attention: str = "auto"  # "auto" (Triton MoDA kernels on CUDA, reference elsewhere), "triton", "reference", "sdpa"
    max_sessions: int = 256  # sessions held at once (the least recently used idle one is evicted past it)
    max_sessions_per_key: int = 64  # sessions one API key may hold at once
    session_lease_s: float = 300.0  # a session idle this long expires: its quota and KV memory go back
    stream_idle_s: float = 120.0  # a Session stream that sends nothing this long is closed (its session stays)
    max_streams: int = 4096  # Session and Generate streams open at once, over all callers
    api_keys: str = ""  # file with one API key per line ('#' comments); empty = no authentication
    metrics_port: int = 0  # Prometheus metrics over HTTP on host:metrics_port; 0 = off
    tls_cert: str = ""  # PEM certificate: serve over TLS (with tls_key)
    tls_key: str = ""  # PEM private key of tls_cert
    tls_client_ca: str = ""  # PEM CA bundle: require client certificates signed by it (mTLS)
    grace_s: float = 5.0  # seconds in-flight calls get to finish on shutdown
    kv_pool_mb: int = 256  # memory of the paged KV pool all sessions share (least recently used evicted past it)
    kv_block_size: int = 16  # positions per KV block
    prefill_chunk: int = 2048  # prompt / resync-history positions per prefill forward (bounds attention memory)
    tp: int = 1  # tensor-parallel ranks: one process per GPU, rank 0 speaks gRPC (gloo ranks on CPU)
    log_format: str = "text"  # "json": one JSON object per line with session ids (for log pipelines); "text"
    log_level: str = "info"  # debug / info / warning / error


def read_api_keys(path: str) -> frozenset[str]:
    if not path:
        return frozenset()
    keys = [ln.strip() for ln in Path(path).read_text().splitlines()]
    keys = frozenset(k for k in keys if k and not k.startswith("#"))
    if not keys:
        raise ValueError(f"{path} holds no API keys")
    return keys


def serve(cfg: ServeConfig, ready: threading.Event | None = None) -> int:
    configure_logging(cfg.log_format, cfg.log_level)
    device = pick_device(cfg.device)
    if bool(cfg.tls_cert) != bool(cfg.tls_key) or (cfg.tls_client_ca and not cfg.tls_cert):
        raise ValueError("TLS needs both --tls-cert and --tls-key (and --tls-client-ca only with them)")
    if cfg.tp < 1:
        raise ValueError(f"--tp must be at least 1, got {cfg.tp}")
    if cfg.prefill_chunk < 1:
        raise ValueError(f"--prefill-chunk must be at least 1, got {cfg.prefill_chunk}")
    if cfg.tp > 1 and device.startswith("cuda") and torch.cuda.device_count() < cfg.tp:
        raise ValueError(f"--tp {cfg.tp} needs {cfg.tp} GPUs, this host has {torch.cuda.device_count()}")
    followers, tp_target = [], None
    if cfg.tp > 1:
        kind = "cuda" if device.startswith("cuda") else "cpu"
        followers, port = start_followers(cfg.tp, cfg.model, kind, cfg.dtype, cfg.kv_pool_mb << 20,
                                          cfg.kv_block_size, cfg.attention)  # fmt: skip
        cmd_group = join_rank0(cfg.tp, port, kind)
        device = "cuda:0" if kind == "cuda" else "cpu"
    target, tokenizer = load(cfg.model, device, cfg.dtype, cfg.attention)
    model_fp = fingerprint(cfg.model)
    drafter = load_drafter(cfg.drafter, target, target_fingerprint=model_fp)
    torch.set_grad_enabled(False)
    for name in ("max_sessions", "max_sessions_per_key", "max_streams", "session_lease_s", "stream_idle_s"):
        if not getattr(cfg, name) > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(cfg, name)}")
    config = ServiceConfig(max_sessions=cfg.max_sessions, api_keys=read_api_keys(cfg.api_keys),
                           max_sessions_per_key=cfg.max_sessions_per_key, session_lease_s=cfg.session_lease_s,
                           stream_idle_s=cfg.stream_idle_s, max_streams=cfg.max_streams,
                           kv_pool_bytes=cfg.kv_pool_mb << 20, kv_block_size=cfg.kv_block_size,
                           prefill_chunk=cfg.prefill_chunk)  # fmt: skip
    extra = {}
    if cfg.tp > 1:
        # The client part ships whole weights: take them before this rank keeps only its shard.
        extra["client_weights"] = {k: v.detach().cpu().clone() for k, v in client_part_tensors(target, drafter).items()}
        tp_target = TPTarget(apply_tp(target, 0, cfg.tp), cmd_group)
        extra["pool"] = tp_target.make_pool(config.kv_pool_bytes, config.kv_block_size)
        target = tp_target
    service = TetherService(target, drafter, tokenizer, config, model_fingerprint=model_fp, **extra)
    if isinstance(target, Transformer) and target.backend == "triton":
        t0 = time.perf_counter()
        warm_up(target, service.pool)
        log.info("attention kernels compiled and tuned in %.1f s", time.perf_counter() - t0)
    tls = TLSFiles(cfg.tls_cert, cfg.tls_key, cfg.tls_client_ca) if cfg.tls_cert else None
    server, port = make_server(service, f"{cfg.host}:{cfg.port}", tls=tls)
    if cfg.metrics_port:
        serve_metrics(service.metrics, cfg.host, cfg.metrics_port)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    server.start()
    print(f"listening on {cfg.host}:{port}" + (f" (tensor-parallel over {cfg.tp} ranks)" if cfg.tp > 1 else ""),
          flush=True)  # fmt: skip
    if ready is not None:
        ready.set()
    # Wake up now and then: a signal the kernel hands to another thread (gloo's, gRPC's) only sets a flag that
    # the main thread acts on when it runs, and a plain wait() would sleep through it.
    while not stop.wait(0.5):
        pass
    if not server.stop(grace=cfg.grace_s).wait(cfg.grace_s + 10):
        log.warning("calls still running %.0f s after the grace period; exiting anyway", cfg.grace_s + 10)
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
