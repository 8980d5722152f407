"""The server's Python heap: what start-up built is frozen out of the garbage collector's way, and every collection's
pause is timed.

Why: a server holds a large heap that lives as long as the process (the models' modules and parameters, the
tokenizer, compiled kernels and their launchers, captured graphs and their buffers). Python's cyclic collector walks
all of it in each full (generation 2) collection, holding the GIL: every thread stops, the batcher's step and the
event loop's replies with it, for as long as the walk takes. Under load the allocations of thousands of rounds a
second trigger such collections every few seconds, each one a stall of every round in flight. `settle()` (once
start-up is done, before the port opens) collects once and moves every surviving object into the permanent
generation (`gc.freeze`), so later collections walk only what serving allocates; the collector stays on, so
reference cycles made while serving are still reclaimed.

Contract:
- `settle() -> int`: one full collection, then freeze, and young collections every YOUNG_THRESHOLD allocations;
  returns the objects frozen. Idempotent in effect (objects frozen stay frozen; a second call freezes what came
  since). `release()` unfreezes and restores the thresholds, at shutdown.
- `GCPauses(histogram=None)`: `install()` adds a `gc.callbacks` hook timing each collection (start to stop, on
  whatever thread triggered it), observed into `histogram` labelled by generation (ServiceMetrics.gc_pause) and
  totalled in `count`, `total_s`, `max_s` (what bench/server.py reports over its timed window:
  `snapshot(reset_max=True)` starts a window's max); `remove()` takes it out. The hook runs inside the collector:
  it only reads the clock and adds numbers.

    settle(); pauses = GCPauses(service.metrics.gc_pause).install()   # what `tether-server serve` does
    pauses.snapshot()                                                # {"count": ..., "total_s": ..., "max_s": ...}

Tests: tests/server/test_heap.py.
"""

from __future__ import annotations

import gc
import threading
import time

from prometheus_client import Histogram

# A young collection every 10,000 net allocations, not CPython's 700: serving allocates thousands of short-lived
# objects a second, and every tenth young collection is followed by an older one, every hundredth by a full one.
# At 1,024 sessions on a 2-core CPU a window of 4,096 rounds held 140 collections (205-315 ms of pauses); at
# 10,000, one (14-56 ms). What waits longer is only cyclic garbage, at most this many objects of it.
YOUNG_THRESHOLD = 10_000

_thresholds_before: tuple[int, ...] | None = None  # what settle() replaced, put back by release()


def settle(young_threshold: int = YOUNG_THRESHOLD) -> int:
    """Collect everything start-up left unreachable, then exempt what survives from every later collection, and
    collect the young generation every `young_threshold` net allocations."""
    global _thresholds_before
    gc.collect()
    gc.freeze()
    if _thresholds_before is None:
        _thresholds_before = gc.get_threshold()
    gc.set_threshold(young_threshold, *_thresholds_before[1:])
    return gc.get_freeze_count()


def release() -> None:
    """Hand the frozen heap back to the collector, at shutdown (frozen objects are never collected, so without it
    extension types freed only by a collection, nanobind's in Triton, would be reported leaked at exit), and put
    the collector's thresholds back as settle() found them."""
    global _thresholds_before
    gc.unfreeze()
    if _thresholds_before is not None:
        gc.set_threshold(*_thresholds_before)
        _thresholds_before = None


class GCPauses:
    """Times the cyclic collector's pauses through gc.callbacks (see the module docstring)."""

    def __init__(self, histogram: Histogram | None = None):
        self.histogram = histogram  # labelled by "generation"
        self.count = 0
        self.total_s = 0.0
        self.max_s = 0.0
        self._started: dict[int, float] = {}  # thread id -> when its collection began (one at a time per thread)
        self._lock = threading.Lock()  # snapshot() reads the three totals together

    def __call__(self, phase: str, info: dict) -> None:
        me = threading.get_ident()
        if phase == "start":
            self._started[me] = time.perf_counter()
            return
        began = self._started.pop(me, None)
        if began is None:  # installed during a collection
            return
        pause = time.perf_counter() - began
        with self._lock:
            self.count += 1
            self.total_s += pause
            self.max_s = max(self.max_s, pause)
        if self.histogram is not None:
            self.histogram.labels(generation=str(info.get("generation", ""))).observe(pause)

    def install(self) -> GCPauses:
        if self not in gc.callbacks:
            gc.callbacks.append(self)
        return self

    def remove(self) -> None:
        if self in gc.callbacks:
            gc.callbacks.remove(self)

    def snapshot(self, reset_max: bool = False) -> dict[str, float]:
        """The totals since install(); `max_s` since install() or the last snapshot that reset it (a window's)."""
        with self._lock:
            out = {"count": self.count, "total_s": self.total_s, "max_s": self.max_s}
            if reset_max:
                self.max_s = 0.0
            return out
