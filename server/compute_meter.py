"""CPU time the calling threads spend inside the models' own compute (the target's step or forward, the drafter's
server part), summed over the process: what bench/server.py subtracts from the engine's CPU time on a CPU device,
where the forward is itself CPU work, to leave the host work a GPU server pays around it.

Contract: `with MODEL_COMPUTE.measure(): ...` adds the block's time.thread_time to `MODEL_COMPUTE.seconds`.
Only the calling thread is counted: torch's intra-op worker threads are the bench's to add (bench/engine_cpu.py).
On CUDA the block is the step's launches or graph replay, not the kernels' time; it is host work there.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator


class ComputeMeter:
    def __init__(self) -> None:
        self.seconds = 0.0  # thread CPU seconds inside measure(), all threads together
        self._lock = threading.Lock()  # the batcher and the model threads both add to it

    @contextlib.contextmanager
    def measure(self) -> Iterator[None]:
        t0 = time.thread_time()
        try:
            yield
        finally:
            spent = time.thread_time() - t0
            with self._lock:
                self.seconds += spent


MODEL_COMPUTE = ComputeMeter()
