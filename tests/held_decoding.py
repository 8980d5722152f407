"""Generations held in flight: a test's streams stop after their first chunk until it lets them go on."""

import asyncio
import contextlib
import threading


class Gate:
    """Replaces an engine's decoding.decode (what Generate and the HTTP API decode with): each generation yields its
    first chunk, then waits at the gate until `open` (or until `count` generations have reached it), so the test knows
    they are in flight."""

    def __init__(self, engine, count: int = 0):
        self.engine, self.count = engine, count
        self.inner = engine.decoding.decode
        self.reached = threading.Semaphore(0)
        self.waiting = 0
        self.gate = asyncio.Event()

    def open(self) -> None:
        asyncio.run_coroutine_threadsafe(self._open(), self.service_loop).result()

    async def _open(self) -> None:
        self.gate.set()

    def __enter__(self):
        from tether.server.rpc_server import event_loop

        self.service_loop = event_loop()
        self.engine.decoding.decode = self.decode
        return self

    def __exit__(self, *exc):
        del self.engine.decoding.decode
        self.open()

    async def decode(self, *args, **kwargs):
        async with contextlib.aclosing(self.inner(*args, **kwargs)) as chunks:
            first = True
            async for chunk in chunks:
                yield chunk
                if first:
                    first = False
                    self.waiting += 1
                    if self.count and self.waiting >= self.count:
                        self.gate.set()
                    self.reached.release()
                    await self.gate.wait()
