"""`tether-server serve`: load the target and drafter, serve `tether.v1.Tether` until SIGTERM or Ctrl-C.

Contract: prints one line `listening on HOST:PORT` once the port is bound (port 0 picks a free one), serves
until SIGTERM/SIGINT, then stops taking new calls and gives the ones in flight `grace_s` seconds to finish.
Defaults serve deploy/models on 127.0.0.1:50051.

    tether-server serve --port 50051 --max-sessions 64
"""

from __future__ import annotations

import signal
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from tether.server.generate import default_model_dir, load, pick_device
from tether.server.metrics import serve_metrics
from tether.server.service import ServiceConfig, TetherService, TLSFiles, make_server
from tether.shared.checkpoint import fingerprint
from tether.shared.drafter import load_drafter


@dataclass(frozen=True)
class ServeConfig:
    model: str = str(default_model_dir())  # target model directory
    drafter: str = str(default_model_dir("drafter"))  # drafter directory trained for that target
    host: str = "127.0.0.1"  # address to listen on
    port: int = 50051  # port to listen on (0 = any free port)
    device: str = ""  # "cpu" / "cuda"; empty = cuda when present
    max_sessions: int = 256  # sessions held at once (the least recently used is evicted past it)
    api_keys: str = ""  # file with one API key per line ('#' comments); empty = no authentication
    metrics_port: int = 0  # Prometheus metrics over HTTP on host:metrics_port; 0 = off
    tls_cert: str = ""  # PEM certificate: serve over TLS (with tls_key)
    tls_key: str = ""  # PEM private key of tls_cert
    tls_client_ca: str = ""  # PEM CA bundle: require client certificates signed by it (mTLS)
    grace_s: float = 5.0  # seconds in-flight calls get to finish on shutdown
    kv_pool_mb: int = 256  # memory of the paged KV pool all sessions share (least recently used evicted past it)
    kv_block_size: int = 16  # positions per KV block


def read_api_keys(path: str) -> frozenset[str]:
    if not path:
        return frozenset()
    keys = [ln.strip() for ln in Path(path).read_text().splitlines()]
    keys = frozenset(k for k in keys if k and not k.startswith("#"))
    if not keys:
        raise ValueError(f"{path} holds no API keys")
    return keys


def serve(cfg: ServeConfig, ready: threading.Event | None = None) -> int:
    device = pick_device(cfg.device)
    target, tokenizer = load(cfg.model, device)
    model_fp = fingerprint(cfg.model)
    drafter = load_drafter(cfg.drafter, target, target_fingerprint=model_fp)
    torch.set_grad_enabled(False)
    config = ServiceConfig(max_sessions=cfg.max_sessions, api_keys=read_api_keys(cfg.api_keys),
                           kv_pool_bytes=cfg.kv_pool_mb << 20, kv_block_size=cfg.kv_block_size)  # fmt: skip
    service = TetherService(target, drafter, tokenizer, config, model_fingerprint=model_fp)
    if bool(cfg.tls_cert) != bool(cfg.tls_key) or (cfg.tls_client_ca and not cfg.tls_cert):
        raise ValueError("TLS needs both --tls-cert and --tls-key (and --tls-client-ca only with them)")
    tls = TLSFiles(cfg.tls_cert, cfg.tls_key, cfg.tls_client_ca) if cfg.tls_cert else None
    server, port = make_server(service, f"{cfg.host}:{cfg.port}", tls=tls)
    if cfg.metrics_port:
        serve_metrics(service.metrics, cfg.host, cfg.metrics_port)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    server.start()
    print(f"listening on {cfg.host}:{port}", flush=True)
    if ready is not None:
        ready.set()
    stop.wait()
    server.stop(grace=cfg.grace_s).wait()
    print("stopped", flush=True)
    return 0
