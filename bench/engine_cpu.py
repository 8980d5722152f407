"""The engine's CPU time, by thread, for bench/server.py's in-process server (issue #44: engine CPU per round).

The engine is the process that holds the models: its gRPC event loop (thread "tether-grpc"), the batcher
("tether-batcher"), the model threads ("tether-model_N"), gRPC core's own threads (HTTP/2, polling) and torch's
intra-op worker threads, all in the bench's process (the clients run in processes of their own). The bench's main
thread only starts the clients and reads their lines: it is not counted. With --frontends, the front-end
processes (gRPC, the messages' routing) are not the engine: their CPU is reported beside it.

`sample(frontend_pids)` reads, from Linux /proc, each thread's CPU seconds so far by role (a thread that ended
before the sample is not listed; the process total from getrusage still counts it), the process total and the
models' own compute (tether.server.compute_meter: the target's step or forward and the drafter's server part on
the threads that called them, plus every intra-op thread, which only runs inside a forward). `per_round(after,
before, rounds, cpu_device)` turns two samples into microseconds per round: `engine_cpu_us_per_round` (all of it)
and `engine_host_cpu_us_per_round`, which on a CPU device leaves the models' compute out, the number that stands
for a GPU server's host work (on CUDA the step's compute is on the GPU, and what its call costs the host, launches
or a graph replay, is host work, so nothing is left out).
"""

from __future__ import annotations

import os
import resource
import threading

ROLES = {"tether-grpc": "event loop", "tether-batcher": "batcher", "MainThread": "bench main"}
CLK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _role(python_name: str | None, comm: str, process_comm: str) -> str:
    if python_name is not None:
        if python_name.startswith("tether-model"):
            return "model threads"
        return ROLES.get(python_name, "other python threads")
    # A native thread takes its creator's comm unless it names itself: gRPC core's threads do, torch's OpenMP
    # workers keep the process's.
    return "torch intra-op" if comm == process_comm else "grpc core and other native"


def _stat_cpu(path: str) -> tuple[str, float] | None:
    try:
        with open(path) as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return stat[stat.index("(") + 1 : stat.rindex(")")], (int(fields[11]) + int(fields[12])) / CLK


def process_cpu_s(pid: int) -> float:
    """CPU time of another process of ours (Linux /proc; 0 elsewhere or once it has gone)."""
    got = _stat_cpu(f"/proc/{pid}/stat")
    return 0.0 if got is None else got[1]


def sample(frontend_pids: list[int]) -> dict:
    from tether.server.compute_meter import MODEL_COMPUTE

    r = resource.getrusage(resource.RUSAGE_SELF)
    names = {t.native_id: t.name for t in threading.enumerate()}
    me = _stat_cpu("/proc/self/stat")
    threads: dict[str, float] = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        tids = []
    for tid in tids:
        got = _stat_cpu(f"/proc/self/task/{tid}/stat")
        if got is not None and me is not None:
            role = _role(names.get(int(tid)), got[0], me[0])
            threads[role] = threads.get(role, 0.0) + got[1]
    if frontend_pids:
        threads["front ends"] = sum(map(process_cpu_s, frontend_pids))
    return {"process_s": r.ru_utime + r.ru_stime, "threads_s": threads, "compute_s": MODEL_COMPUTE.seconds}


def per_round(after: dict, before: dict, rounds: int, cpu_device: bool) -> dict:
    if not rounds:
        return {}
    d = {k: v - before["threads_s"].get(k, 0.0) for k, v in after["threads_s"].items()}
    total = after["process_s"] - before["process_s"] - d.get("bench main", 0.0)
    compute = after["compute_s"] - before["compute_s"] + d.get("torch intra-op", 0.0) if cpu_device else 0.0
    us = 1e6 / rounds
    by_thread = {k: us * v for k, v in sorted(d.items()) if k not in ("bench main", "front ends")}
    return {"engine_cpu_us_per_round": us * total, "engine_host_cpu_us_per_round": us * (total - compute),
            "engine_compute_cpu_us_per_round": us * compute if cpu_device else None,
            "engine_cpu_us_per_round_by_thread": by_thread,
            "frontends_cpu_us_per_round": us * d["front ends"] if "front ends" in d else None}  # fmt: skip
