"""How `serve`'s processes start: one plan from the command line's ServeConfig, one place that starts them.

Contract:
- `LaunchPlan.of(cfg)` checks how the flags combine (--tp, --engines, --frontends, the KV pool each engine shares) and
  holds what runs: `tp` ranks of one engine (rank 0 in this process, the others started by its Engine.build, since
  they only follow its steps: tether.server.tp_serve), `engines` engine processes on the device (this process is
  engine 0; `start_engines` starts the others, `python -m tether.server.engines`, each building its Engine the same
  way: tether.server.engine_core.Engine.build), and `frontends` front-end processes for gRPC (0: gRPC in this
  process). `notes()` says so for the `listening on` line.
- `start_engines(plan, cfg)` starts engines 1 .. E-1 (None with one engine): they load and warm up while this
  process does. `listen(service, address, plan, ...)` starts gRPC: grpc.aio in this process
  (tether.server.rpc_server.make_server), or the plan's front ends (tether.server.frontend_host.start_frontends),
  which also route to `engine_sockets`; either way a handle with start / stop / wait_for_termination and the port.

    plan = LaunchPlan.of(cfg)
    workers = start_engines(plan, cfg)
    handle, port = listen(service, "127.0.0.1:0", plan, engine_sockets=workers.wait_ready() if workers else ())
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tether.server.engines import EngineWorkers
from tether.server.frontend_host import start_frontends
from tether.server.rpc_server import Servable, TLSFiles, check_free, make_server
from tether.server.serve_config import ServeConfig
from tether.shared.cli_support import CommandError, Refusal
from tether.shared.ids import MAX_ENGINES


@dataclass(frozen=True)
class LaunchPlan:
    tp: int = 1  # tensor-parallel ranks of the one engine (one process per GPU)
    engines: int = 1  # engine processes on the device, each with its own models, share of the pool and sessions
    frontends: int = 0  # gRPC front-end processes sharing the port; 0 = gRPC in the engine's own process

    @classmethod
    def of(cls, cfg: ServeConfig) -> LaunchPlan:
        """The plan `cfg`'s flags describe, or a ValueError saying which combination cannot run."""
        if cfg.tp < 1:
            raise ValueError(f"--tp must be at least 1, got {cfg.tp}")
        if cfg.frontends < 0:
            raise ValueError(f"--frontends is 0 (gRPC in this process) or more, got {cfg.frontends}")
        if not 1 <= cfg.engines <= MAX_ENGINES:
            raise ValueError(f"--engines is 1 to {MAX_ENGINES}, got {cfg.engines}")
        if cfg.engines > 1 and (cfg.frontends < 1 or cfg.tp > 1 or 0 < cfg.kv_pool_mb < cfg.engines):
            raise ValueError(
                "--engines E > 1 needs --frontends N >= 1 (they route the calls), --tp 1, and "
                "--kv-pool-mb 0 (auto) or at least E MB (each engine takes an even share)"
            )
        return cls(tp=cfg.tp, engines=cfg.engines, frontends=cfg.frontends)

    def notes(self) -> list[str]:
        """What runs besides this process, for the `listening on` line."""
        notes = [f"tensor-parallel over {self.tp} ranks"] if self.tp > 1 else []
        notes += [f"{self.frontends} front-end processes"] if self.frontends else []
        return notes + ([f"{self.engines} engine processes"] if self.engines > 1 else [])


def start_engines(plan: LaunchPlan, cfg: ServeConfig) -> EngineWorkers | None:
    """Engines 1 .. E-1 of the plan, started now (they inherit Triton's cache directory: set it first)."""
    return EngineWorkers(cfg) if plan.engines > 1 else None


def listen(
    service: Servable,
    address: str,
    plan: LaunchPlan,
    *,
    tls: TLSFiles | None = None,
    engine_sockets: Sequence[str] = (),
    log_format: str = "text",
    log_level: str = "warning",
):
    """gRPC for `service` on `address` as the plan says: (handle, port), or a CommandError when it cannot listen.
    The front ends, if any, take calls as soon as this returns."""
    if engine_sockets and not plan.frontends:
        raise ValueError("more engines than this process need front ends to route their calls")
    if not plan.frontends:
        return make_server(service, address, tls=tls)
    check_free(address)  # the front ends bind with SO_REUSEPORT, which would join a listener that has it too
    try:
        return start_frontends(
            service,
            address,
            plan.frontends,
            tls=tls,
            engines=engine_sockets,
            log_format=log_format,
            log_level=log_level,
        )
    except OSError as e:  # a front end could not bind, or died before it said so
        raise CommandError(Refusal.CANNOT_LISTEN, str(e)) from None
