"""One Generate call (the server decoding alone) read on a thread, so the session can wait for its next chunk with a
deadline and tell a stalled link from a slow one.

Contract:
- `GenerationStream(stub, request, metadata)`: starts the call at once (`started_at`, time.monotonic()); a reader
  thread queues each GeneratedTokens with its arrival time, then None when the server ends the generation (its
  length, a stop id, the context), or the typed error the call failed with (tether.client.transport.rpc_error:
  LinkDown, ServerBusy, ServerError).
- `receive(timeout)`: the next chunk (`arrived_at` is then its arrival), None at the end, or raises that error;
  nothing within `timeout` s is LinkDown(STALLED). `close()` cancels the call: the server ends the generation and
  frees its KV; chunks not yet received are dropped, never emitted.

    stream = GenerationStream(stub, pb.OpenSession(prompt=ids, ...), metadata)
    chunk = stream.receive(5.0)

Tests: tests/e2e/test_adaptive_modes.py (a stream cut and stalled mid-generation).
"""

from __future__ import annotations

import queue
import threading
import time

import grpc

from tether.client.outage import Cause
from tether.client.transport import LinkDown, rpc_error
from tether.v1 import tether_pb2 as pb


class GenerationStream:
    """A Generate call and the thread reading it; see the module docstring."""

    def __init__(self, stub, request: pb.OpenSession, metadata: tuple):
        self.inbox: queue.Queue = queue.Queue()
        self.arrived_at = 0.0  # time.monotonic() when the chunk last received arrived
        self.chunks = 0  # chunks received so far
        self.started_at = time.monotonic()
        self.call = stub.Generate(request, metadata=metadata)
        threading.Thread(target=self._read, daemon=True, name="tether-generate").start()

    def _read(self) -> None:
        try:
            for msg in self.call:
                self.inbox.put((time.monotonic(), msg))
            self.inbox.put((time.monotonic(), None))
        except grpc.RpcError as e:
            self.inbox.put((time.monotonic(), rpc_error(e)))

    def receive(self, timeout: float) -> pb.GeneratedTokens | None:
        try:
            self.arrived_at, msg = self.inbox.get(timeout=max(0.0, timeout))
        except queue.Empty:
            raise LinkDown(f"no tokens within {timeout:.1f} s", cause=Cause.STALLED, waited_s=timeout) from None
        if isinstance(msg, Exception):
            raise msg
        self.chunks += msg is not None
        return msg

    def close(self) -> None:
        self.call.cancel()
