"""What a front end's grpc.health.v1 says about the engines behind it (`serve --frontends N [--engines E]`).

Why: with E engines, one that dies takes its share of the sessions and of the capacity with it while the others
serve on (tether.server.engines). A load balancer should keep sending calls to a server that can still serve them,
and a scheduler or an operator should see that it serves with less than it had.

Contract (`EngineHealth(health, links)`, on the front end's event loop; a link is anything with `alive`):
- "" and "tether.v1.Tether": SERVING while at least one engine is alive, NOT_SERVING when none is. These are what a
  load balancer or a Kubernetes probe asks: a server that lost an engine still answers every call (sessions of the
  dead engine come back by a Resync with their history on a live one), so it stays in rotation.
- "tether.v1.Tether.capacity": SERVING while every engine is alive, NOT_SERVING once one is lost: the server serves
  with less than its configured capacity (a signal to alert on, or to weight traffic away from it; the serving
  process has also logged `engine_exit`). Engines are not restarted, so it stays NOT_SERVING until `serve` is.
- "tether.v1.Tether.engine.K": SERVING while engine K (its index in session ids) is alive.
- When the front end stops, every name is NOT_SERVING (grpc's graceful shutdown; later changes are ignored). The
  front ends stop with the first engine (the serving process), so its death shows as no answer at all, which a
  load balancer takes for unhealthy too.
A front end started after an engine died starts with that engine lost. Without front ends (one process, one
engine) tether.server.rpc_server answers "" and "tether.v1.Tether" alone.

    capacity = EngineHealth(health, links)
    await capacity.publish()          # once the front end listens
    link.on_lost = capacity.changed   # and whenever an engine's link closes
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from grpc_health.v1 import health_pb2
from grpc_health.v1._async import HealthServicer

from tether.server.rpc_server import SERVICE_NAME

CAPACITY_NAME = f"{SERVICE_NAME}.capacity"
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


def engine_name(k: int) -> str:
    """The health name of engine k."""
    return f"{SERVICE_NAME}.engine.{k}"


def statuses(alive: Sequence[bool]) -> dict[str, int]:
    """Every health name's status for engines whose liveness is `alive` (by index)."""
    serving = SERVING if any(alive) else NOT_SERVING
    out = {"": serving, SERVICE_NAME: serving, CAPACITY_NAME: SERVING if all(alive) else NOT_SERVING}
    return out | {engine_name(k): SERVING if up else NOT_SERVING for k, up in enumerate(alive)}


class EngineHealth:
    def __init__(self, health: HealthServicer, links: Sequence):
        self.health, self.links = health, links
        self._publishing: asyncio.Task | None = None  # held, so the task is not collected midway
        self._lock = asyncio.Lock()  # one publication at a time: the last reads the latest liveness

    async def publish(self) -> None:
        """Set every name from the links' liveness now."""
        async with self._lock:
            for name, status in statuses([link.alive for link in self.links]).items():
                await self.health.set(name, status)

    def changed(self) -> None:
        """An engine's link closed (called on the loop, from the link's connection_lost)."""
        self._publishing = asyncio.ensure_future(self.publish())
