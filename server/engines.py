"""Engine processes beside the serving one: `tether-server serve --engines E --frontends N`.

Why: one engine process's host work (its event loop and its batcher, under one GIL) bounds rounds/s long before
the GPU does; on the H200 a second process on the same GPU nearly doubled rounds/s at 128 clients (BENCHMARKS.md,
"The request path on the H200"). So serve can run E engines, each with its own models, KV pool, session table and
batcher on the same device, behind the same front ends: the front ends route each call (tether.server.frontend,
class Router) and every engine puts its index in the ids of the sessions it holds (tether.shared.ids), so no table is
shared.

Contract:
- `engine_share(cfg, k)`: engine k's part of a ServeConfig. The KV pool (--kv-pool-mb) and the session limits
  (--max-sessions, --max-sessions-per-key, rounded up) are split evenly: each engine holds its own sessions.
  Engine k serves its Prometheus metrics on --metrics-port + k. The OpenAI HTTP API and the ONNX exports named by
  --onnx-precisions stay with engine 0 (the serving process), as do GetModelInfo and FetchWeights.
- `EngineWorkers(cfg)` starts engines 1 .. E-1 at once (`python -m tether.server.engines`), each given its share
  on stdin; they load the models and warm up while the serving process does the same. `wait_ready()` returns
  their sockets, private to this user (a 0700 directory), once every one listens, or raises OSError naming the one
  that failed. `stop()` ends them (after the front ends have stopped: their calls are over) and removes the
  directory. A worker also ends when the serving process's end of its stdin closes, so none outlives a crash.
- An engine that dies alone is not restarted: its calls end UNAVAILABLE and its sessions are lost, which clients
  recover from as from any eviction (Resync with the history builds the session on a live engine); the others
  serve on, and the serving process logs the death as an error (event `engine_exit`). The front ends' health
  says so (tether.server.engine_health: still SERVING, `tether.v1.Tether.capacity` NOT_SERVING), and a front end
  started after the death links to the live engines alone (its dead socket refuses: tether.server.frontend).

    tether-server serve --engines 3 --frontends 2 --kv-pool-mb 6144    # 2 GiB of KV per engine
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import math
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from tether.server.engine_core import Engine
from tether.server.logs import configure_logging
from tether.server.metrics import serve_metrics
from tether.server.rpc_server import event_loop
from tether.server.serve_config import ServeConfig
from tether.server.service import TetherService

log = logging.getLogger("tether.server")

READY_TIMEOUT_S = 900.0  # a cold start compiles every kernel (minutes on a GPU) before an engine listens
STOP_TIMEOUT_S = 30.0  # for an engine to release its sessions and exit once told to stop


def engine_share(cfg, index: int):
    """Engine `index`'s ServeConfig: its even share of the KV pool and session limits, its metrics port; the
    HTTP API and ONNX exports only on engine 0. With one engine, `cfg` itself."""
    n = cfg.engines
    if n == 1:
        return cfg
    return dataclasses.replace(
        cfg,
        kv_pool_mb=cfg.kv_pool_mb // n,
        max_sessions=math.ceil(cfg.max_sessions / n),
        max_sessions_per_key=math.ceil(cfg.max_sessions_per_key / n),
        max_model_calls_per_caller=math.ceil(cfg.max_model_calls_per_caller / n),
        metrics_port=cfg.metrics_port + index if cfg.metrics_port else 0,
        http_port=cfg.http_port if index == 0 else -1,
        onnx_precisions=cfg.onnx_precisions if index == 0 else "",
    )


class EngineWorkers:
    """Engines 1 .. E-1 of a serving process (engine 0)."""

    def __init__(self, cfg):
        self.dir = Path(tempfile.mkdtemp(prefix="tether-engines-"))  # mode 0700: this user's alone
        self.sockets = [str(self.dir / f"engine-{k}.sock") for k in range(1, cfg.engines)]
        self.procs: list[subprocess.Popen] = []
        self.stopping = False
        try:
            for k, path in enumerate(self.sockets, start=1):
                cmd = [sys.executable, "-m", "tether.server.engines", "--index", str(k), "--socket", path]
                proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, close_fds=True)
                self.procs.append(proc)
                proc.stdin.write(json.dumps(dataclasses.asdict(engine_share(cfg, k))) + "\n")
                proc.stdin.flush()
        except BaseException:
            self.stop()
            raise

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> list[str]:
        """The workers' sockets, once each has said it listens; OSError if one exits or stays silent."""
        deadline = time.monotonic() + timeout
        for k, proc in enumerate(self.procs, start=1):
            left = deadline - time.monotonic()
            ready, _, _ = select.select([proc.stdout], [], [], max(0.0, left))
            line = proc.stdout.readline().strip() if ready else ""
            if line != "ready":
                status = proc.poll()
                why = f"exited with status {status}" if status is not None else f"not ready in {timeout:.0f} s"
                raise OSError(f"engine {k} {why} (its log is above)")
        for k, proc in enumerate(self.procs, start=1):
            threading.Thread(target=self._watch, args=(k, proc), name=f"tether-engine-{k}-watch", daemon=True).start()
        return self.sockets

    def _watch(self, k: int, proc: subprocess.Popen) -> None:
        status = proc.wait()
        if not self.stopping:
            log.error(
                "engine %d exited with status %s; its sessions are lost (clients rebuild them by resync) and "
                "the other engines serve on",
                k,
                status,
                extra={"event": "engine_exit"},
            )

    def stop(self) -> None:
        self.stopping = True
        for proc in self.procs:
            if proc.stdin and not proc.stdin.closed:
                try:
                    proc.stdin.close()  # EOF: the worker stops
                except OSError:
                    pass
        for proc in self.procs:
            try:
                proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                log.warning("engine process %d did not stop; killing it", proc.pid)
                proc.kill()
                proc.wait()
            if proc.stdout:
                proc.stdout.close()
        shutil.rmtree(self.dir, ignore_errors=True)


class EngineSocket:
    """A worker engine's socket, which every front end links to. Calls run as they do in the serving process
    (tether.server.frontend_host.FrontendConnection); the front ends' configuration and supervision are engine 0's."""

    def __init__(self, service, loop: asyncio.AbstractEventLoop, path: str):
        self.service, self.loop, self.path = service, loop, path
        self.connections: dict = {}  # FrontendConnection by front-end pid, once it said HELLO
        self._server: asyncio.AbstractServer | None = None

    def frontend_config(self) -> dict:
        return {}  # the front ends take their configuration from engine 0

    def hello(self, conn, info: dict) -> None:
        conn.pid = int(info.get("pid", 0))
        self.connections[conn.pid] = conn

    def lost(self, conn) -> None:
        if self.connections.get(conn.pid) is conn:
            del self.connections[conn.pid]

    async def start(self) -> None:
        from tether.server.frontend_host import FrontendConnection

        self._server = await self.loop.create_unix_server(lambda: FrontendConnection(self), self.path)
        os.chmod(self.path, 0o600)

    async def stop(self) -> None:
        for conn in list(self.connections.values()):
            conn.transport.close()
        if self._server is not None:
            self._server.close()


def run_worker(cfg, index: int, path: str) -> int:
    """Engine `index`: load, warm up, listen on `path`, say "ready" on stdout, serve until stdin ends."""
    configure_logging(cfg.log_format, cfg.log_level)
    torch.set_grad_enabled(False)
    engine = Engine.build(cfg, engine_index=index)
    engine.warm_up()
    engine.settle()
    service = TetherService(engine)
    if cfg.metrics_port:
        serve_metrics(engine.metrics, cfg.host, cfg.metrics_port)
    loop = event_loop()
    listener = EngineSocket(service, loop, path)
    asyncio.run_coroutine_threadsafe(listener.start(), loop).result()
    housekeeping = asyncio.run_coroutine_threadsafe(service.housekeeping(), loop)
    print("ready", flush=True)
    log.info("engine %d ready", index, extra={"event": "engine_ready"})
    sys.stdin.readline()  # EOF: the serving process stops us, or is gone
    housekeeping.cancel()
    asyncio.run_coroutine_threadsafe(listener.stop(), loop).result()
    service.stop_work()

    async def release() -> None:
        await asyncio.sleep(0)  # claims released by finished work (call_soon_threadsafe) run first
        service.release_all()

    asyncio.run_coroutine_threadsafe(release(), loop).result()
    engine.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="an engine process of tether-server serve --engines E (started by serve)")
    ap.add_argument("--index", type=int, required=True, help="this engine's index, 1 .. E-1")
    ap.add_argument("--socket", required=True, help="the Unix socket to listen on for the front ends")
    args = ap.parse_args(argv)
    for sig in (signal.SIGINT, signal.SIGTERM):  # the serving process decides how calls end (it got the signal too)
        signal.signal(sig, signal.SIG_IGN)
    cfg = ServeConfig(**json.loads(sys.stdin.readline()))
    rc = run_worker(cfg, args.index, args.socket)
    logging.shutdown()
    os._exit(rc)  # gRPC's and the loop's threads are not torn down (as the front ends do)


if __name__ == "__main__":
    raise SystemExit(main())
