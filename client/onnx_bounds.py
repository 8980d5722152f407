"""Drafting under a memory and a time bound: what a graph from a server may cost the edge when it runs.

Why: a check of a graph's bytes (tether.client.onnx_graph_policy) cannot see shapes computed at run time: a graph
that passes it may still ask onnxruntime for gigabytes, or spend minutes in one call. So every session the
drafter builds allocates from one onnxruntime arena capped at `memory_bytes` (an allocation past it fails that
call instead of growing the process), and every call runs with its own RunOptions, which a watchdog thread
terminates once the call has run `run_timeout_s` (onnxruntime checks the flag between nodes and Loop iterations).
A call that fails either way, or any other way inside onnxruntime, raises DraftingStopped: a ServerDataError
(the graph came from the server), one line, its `bound` saying what stopped it (Bound.TIME: the watchdog;
Bound.FAILED: onnxruntime failed the call, an allocation past the cap among the reasons, which onnxruntime reports
in its message only).

Contract:
- `bound_session_options(opts, limits)`: makes `opts` (an ort.SessionOptions) allocate from the capped arena,
  registered in the process's onnxruntime environment on first use (the arena is the process's: its cap is the
  first caller's `limits.memory_bytes`, and covers all drafter sessions together), and keeps onnxruntime's own
  error log quiet (the failure reaches the caller as DraftingStopped).
- `BoundedSession(session, name, limits)`: the session's run / get_inputs / get_outputs / get_session_options, each
  run under both bounds.
- `RunLimits(memory_bytes=DEFAULT_MEMORY_BYTES, run_timeout_s=DEFAULT_RUN_TIMEOUT_S)`: frozen;
  `RunLimits.implied(description)` scales the memory bound to what a drafter's description implies (what
  tether.client.onnx_drafter uses unless told otherwise; 1 GiB for the shipped drafters).

    opts = ort.SessionOptions(); bound_session_options(opts, RunLimits())
    step = BoundedSession(ort.InferenceSession(graph, opts), "step", RunLimits())
    logits, *_ = step.run(None, feeds)     # DraftingStopped past a bound

Tests: tests/client/test_hostile_graphs.py (a run-time 4 GiB allocation, a Loop that would run for ever).
"""

from __future__ import annotations

import heapq
import itertools
import math
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

import onnxruntime as ort

from tether.client.errors import Problem, ServerDataError

DEFAULT_MEMORY_BYTES = 1 << 30  # the default drafter peaks at a few tens of MB (its weights are outside the arena)
DEFAULT_RUN_TIMEOUT_S = 60.0  # a draft step takes ~1 ms; the longest call, a prompt's rows, well under a second
ORT_FATAL_ONLY = 4  # onnxruntime's log severity: the failure is reported as DraftingStopped, not logged twice
_ARENA_EXTEND_SAME_AS_REQUESTED = 1  # grow the arena by what is asked, not to the next power of two


class Bound(StrEnum):
    TIME = "time"  # the watchdog terminated the call
    FAILED = "failed"  # onnxruntime failed it: an allocation past the arena's cap, or another error in the graph


class DraftingStopped(ServerDataError):
    """A graph call the client's bounds stopped, or one that failed inside onnxruntime; `bound` says which."""

    def __init__(self, bound: Bound, message: str):
        super().__init__(Problem.GRAPH, message)
        self.bound = bound


@dataclass(frozen=True)
class RunLimits:
    memory_bytes: int = DEFAULT_MEMORY_BYTES
    run_timeout_s: float = DEFAULT_RUN_TIMEOUT_S

    @classmethod
    def implied(cls, description: Mapping) -> RunLimits:
        """Limits for a drafter's description (onnx_drafter.json, checked): at least DEFAULT_MEMORY_BYTES, and room
        for the largest call its shapes allow, a full context's attention scores over itself (heads x max_seq_len^2
        fp32) a few times over, beside its matrices widened to fp32 and pre-packed once."""
        shapes, heads = description["shapes"], description["drafter_config"]["n_heads"]
        scores = heads * shapes["max_seq_len"] ** 2 * 4
        weights = sum(
            math.prod(shape)
            for g in description["graphs"].values()
            for shape in g.get("weights", {}).get("tensors", {}).values()
        )
        return cls(memory_bytes=max(DEFAULT_MEMORY_BYTES, 4 * scores + 8 * weights))


_arena_lock = threading.Lock()
_arena_bytes: list[int] = []  # the cap registered in this process, once


def _register_arena(memory_bytes: int) -> int:
    with _arena_lock:
        if not _arena_bytes:
            cfg = ort.OrtArenaCfg({"max_mem": memory_bytes, "arena_extend_strategy": _ARENA_EXTEND_SAME_AS_REQUESTED})
            info = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
            ort.create_and_register_allocator(info, cfg)
            _arena_bytes.append(memory_bytes)
        return _arena_bytes[0]


def arena_bytes() -> int | None:
    """The cap of the arena drafter sessions allocate from, once one is registered."""
    return _arena_bytes[0] if _arena_bytes else None


def bound_session_options(opts: ort.SessionOptions, limits: RunLimits) -> None:
    """See the module docstring."""
    _register_arena(limits.memory_bytes)
    opts.add_session_config_entry("session.use_env_allocators", "1")
    opts.log_severity_level = ORT_FATAL_ONLY


class _Watchdog:
    """One daemon thread that terminates the calls that outlive their deadline; it sleeps until the earliest one."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._runs: dict[int, tuple[float, ort.RunOptions]] = {}
        self._deadlines: list[tuple[float, int]] = []  # a heap; entries of finished calls are skipped
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None

    def watch(self, options: ort.RunOptions, timeout_s: float) -> int:
        key = next(self._ids)
        deadline = time.monotonic() + timeout_s
        with self._cond:
            self._runs[key] = (deadline, options)
            heapq.heappush(self._deadlines, (deadline, key))
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="onnx-watchdog", daemon=True)
                self._thread.start()
            if self._deadlines[0][1] == key:
                self._cond.notify()
        return key

    def done(self, key: int) -> None:
        with self._cond:
            self._runs.pop(key, None)

    def _loop(self) -> None:
        with self._cond:
            while True:
                while self._deadlines and self._deadlines[0][1] not in self._runs:
                    heapq.heappop(self._deadlines)
                if not self._deadlines:
                    self._cond.wait()
                    continue
                deadline, key = self._deadlines[0]
                left = deadline - time.monotonic()
                if left > 0:
                    self._cond.wait(left)
                    continue
                heapq.heappop(self._deadlines)
                self._runs.pop(key)[1].terminate = True


_watchdog = _Watchdog()


class BoundedSession:
    """An onnxruntime session whose every run is under the client's bounds (module docstring)."""

    def __init__(self, session: ort.InferenceSession, name: str, limits: RunLimits):
        self.session, self.name, self.limits = session, name, limits

    def get_inputs(self) -> list:
        return self.session.get_inputs()

    def get_outputs(self) -> list:
        return self.session.get_outputs()

    def get_session_options(self) -> ort.SessionOptions:
        return self.session.get_session_options()

    def run(self, output_names, feeds: dict) -> list:
        options = ort.RunOptions()
        options.log_severity_level = ORT_FATAL_ONLY
        key = _watchdog.watch(options, self.limits.run_timeout_s)
        try:
            return self.session.run(output_names, feeds, options)
        except Exception as e:  # onnxruntime raises its own types (Fail, RuntimeException, ...)
            raise self._stopped(options, e) from None
        finally:
            _watchdog.done(key)

    def _stopped(self, options: ort.RunOptions, e: Exception) -> DraftingStopped:
        if options.terminate:
            bound, what = Bound.TIME, f"ran past the client's {self.limits.run_timeout_s:g} s bound for one call"
        else:  # onnxruntime's message is for people: its tail names what failed (the bytes asked, for the arena)
            detail = " ".join(str(e).split())[-200:]
            cap = (arena_bytes() or 0) >> 20
            bound, what = Bound.FAILED, f"failed in onnxruntime (allocations capped at {cap} MiB): ...{detail}"
        return DraftingStopped(bound, f"the {self.name} graph {what}; drafting stopped")
