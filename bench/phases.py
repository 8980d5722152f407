"""Where a batched step's time goes: bench/server.py's in-process server with each phase of a round timed.

The request path's throughput under load is bounded by the batcher's thread, whose steps run back to back
(BENCHMARKS.md, "Where a round's host time goes"). This bench runs bench/server.py (its arguments after
`--`, one `--clients` count, an in-process server) with the functions a step passes through wrapped: each call's wall
time and the calling thread's CPU time (time.thread_time) are added up per (thread, phase). Wall minus CPU is time
the thread was blocked: waiting for the GIL, for the GPU, or in C code that let the GIL go (CUDA's synchronisations
spin by default, so a wait for the GPU may count as CPU instead). Phases nest (verify_batch
holds stage), so rows do not add up to the whole. The wrapping costs ~3.7 us a call on a 2-core VM (the thread's
CPU clock is read through a system call), ~200 calls in a step of 64 rounds: a few percent of a step on a GPU.

Prints bench/server.py's own table, then one row per (thread, phase) with calls, wall and CPU per step (divided by
the batcher's steps) and per call; with `--frontends N`, also a round's time in the engine hop by hop (class Hops)
beside the clients' round trip; then one JSON line with all of it. A session's open (its prefill and prompt delta,
on the model threads) is timed too: in trace mode with `--rate` and `--duration` (what bench/capacity.py runs),
clients open a session per trace, and those rows say what that churn costs beside the batcher.

    python bench/phases.py -- --device cuda --clients 128 --rounds 250 --client-procs 4 --kv-pool-mb 4096
    python bench/phases.py -- --device cuda --clients 128 --rounds 250 --client-procs 4 --kv-pool-mb 4096 \
        --frontends 4
    python bench/phases.py -- --device cuda --mode trace --traces traces.json --clients 288 --rate 20 --duration 10
"""

from __future__ import annotations

import argparse
import collections
import importlib
import importlib.util
import json
import statistics
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.table import Table

BATCHER = "tether-batcher"  # the batcher's thread (tether.server.batcher.RoundBatcher)
# (module, attribute): what a round passes through on the batcher's thread, outermost first; then a session's open.
PHASES = [
    ("tether.server.batcher", "RoundBatcher._batch"),
    ("tether.server.rounds", "verify_batch"),
    ("tether.server.rounds", "step_batch"),
    ("tether.server.step", "StepRunner.forward"),
    ("tether.server.step", "_Graph.stage"),
    ("tether.server.step", "StepRunner._replay"),
    ("tether.server.rounds", "every_token_delta"),
    ("tether.server.step", "StepRunner.server_part"),
    ("tether.server.rounds", "_to_host"),
    ("tether.shared.acceptance", "unpack_verdicts"),
    ("tether.server.rounds", "slice_deltas"),
    ("tether.server.rounds", "_commit"),
    ("tether.server.batcher", "_finish"),
    ("tether.server.stream_rounds", "StreamRounds._verdict_reply"),
    ("tether.server.stream_rounds", "verdict_frames_of"),  # a step's replies through front ends: deltas unencoded
    ("tether.server.engine_core", "Engine.encode_delta"),
    ("tether.shared.wire", "encode_bf16_bundle"),
    # Not on the batcher: a session's open on the model threads (its prefill, then its prompt's delta encoded), which
    # clients that end their sessions often pay again and again under the same GIL.
    ("tether.server.verifier", "SequenceVerifier.open"),
    ("tether.server.engine_core", "Engine.delta_parts"),
]


class Phases:
    """Per (thread name, phase): [calls, wall s, thread CPU s]. Each thread adds to its own keys only."""

    def __init__(self):
        self.totals: dict[tuple[str, str], list] = defaultdict(lambda: [0, 0.0, 0.0])
        self._undo: list[Callable[[], None]] = []

    def wrap(self, fn: Callable, phase: str) -> Callable:
        totals = self.totals

        def timed(*args, **kwargs):
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                row = totals[threading.current_thread().name, phase]
                row[0] += 1
                row[1] += time.perf_counter() - t0
                row[2] += time.thread_time() - c0

        timed.__wrapped__ = fn
        return timed

    def install(self, phases: list[tuple[str, str]] = PHASES) -> None:
        """Wrap each phase where it is defined and wherever a tether module imported it by name. A phase that no
        longer exists is an error: the bench must not report on code that moved."""
        for module_name, attr in phases:
            module = importlib.import_module(module_name)
            if "." in attr:  # a method: wrapped on its class
                owner_name, name = attr.split(".")
                owners = [getattr(module, owner_name)]
                real = getattr(owners[0], name)
            else:
                name, real = attr, getattr(module, attr)
                owners = [
                    m
                    for k, m in list(sys.modules.items())
                    if k.startswith("tether.") and getattr(m, name, None) is real
                ]
            timed = self.wrap(real, attr)
            for owner in owners:
                setattr(owner, name, timed)
                self._undo.append(lambda o=owner, n=name, r=real: setattr(o, n, r))

    def uninstall(self) -> None:
        while self._undo:
            self._undo.pop()()

    def steps(self) -> int:
        """The batched steps timed: the batcher's verify_batch calls."""
        return self.totals.get((BATCHER, "verify_batch"), [0])[0]

    def rows(self) -> list[dict]:
        """One dict per (thread, phase) that ran, per step (the batcher's rows) and per call."""
        steps = self.steps()
        out = []
        for (thread, phase), (n, wall, cpu) in self.totals.items():
            per_step = thread == BATCHER and steps > 0
            out.append({"thread": thread, "phase": phase, "calls": n, "wall_s": wall, "cpu_s": cpu,
                        "wall_ms_per_step": 1e3 * wall / steps if per_step else None,
                        "cpu_ms_per_step": 1e3 * cpu / steps if per_step else None,
                        "wall_us_per_call": 1e6 * wall / n, "cpu_us_per_call": 1e6 * cpu / n})  # fmt: skip
        order = {p: i for i, (_, p) in enumerate(PHASES)}
        return sorted(out, key=lambda r: (r["thread"] != BATCHER, r["thread"], order.get(r["phase"], len(order))))


class Hops:
    """With front ends, a round's time in the engine, in three hops: from its REQUEST frame's arrival on the event
    loop to the round's start (straight from the frame, tether.server.call_inbox, or through the stream's handler
    when it was busy), the round itself (the session's claim and checks, the wait for the batcher and its step, up to
    its verdict recorded on the loop), and from there to the reply's frame being queued for the front end. What the
    client's round trip holds beyond their sum is outside the engine (the front end, gRPC, the client process).
    Keyed by the call's inbox: a stream's messages are taken in order. `taken` counts the rounds started straight
    from their frames. The clients' warm-up rounds are counted too (bench/server.py's p50 leaves them out)."""

    def __init__(self):
        self.arrived: dict = defaultdict(collections.deque)  # inbox -> arrival times of rounds not yet started
        self.inbox_of: dict = {}  # StreamRounds -> its call's inbox
        self.spans: dict = {}  # inbox -> (arrival, start, end) of its last round
        self.samples: list[tuple[float, float, float]] = []  # (pre, round, post) seconds, one per verdict
        self.taken = 0
        self._undo: list[Callable[[], None]] = []

    def install(self) -> None:
        from google.protobuf.message import DecodeError

        from tether.server import call_inbox, frontend_host, stream_rounds
        from tether.server.frontend_wire import VerdictFrame
        from tether.v1 import tether_pb2 as pb

        hops, clock = self, time.perf_counter
        Inbox, Rounds = call_inbox.CallInbox, stream_rounds.StreamRounds
        real_offer, real_take, real_run = Inbox.offer, Rounds.take, Rounds.run
        real_record, real_send = Rounds._record, frontend_host.EngineCall._send

        def offer(inbox, payload):
            if payload is not None and _is_round(payload):
                hops.arrived[inbox].append(clock())
            return real_offer(inbox, payload)

        def _is_round(payload: bytes) -> bool:
            """A Session stream's round (any other call's request, a Close's say, is no ClientMessage)."""
            try:
                return pb.ClientMessage.FromString(payload).WhichOneof("body") == "round"
            except DecodeError:
                return False

        def started(rounds, inbox, t0):
            hops.inbox_of[rounds] = inbox
            if hops.arrived[inbox]:
                hops.spans[inbox] = (hops.arrived[inbox].popleft(), t0, None)

        def take(rounds, req, answer):
            t0 = clock()
            ok = real_take(rounds, req, answer)
            if ok:
                hops.taken += 1
                started(rounds, answer.__self__, t0)
            return ok

        async def run(rounds, req):
            started(rounds, call_inbox.CALL_INBOX.get(), clock())
            return await real_run(rounds, req)

        def record(rounds, *args):
            real_record(rounds, *args)
            inbox = hops.inbox_of.get(rounds)
            if (span := hops.spans.get(inbox)) is not None:
                hops.spans[inbox] = (span[0], span[1], clock())

        def send(call, message):
            real_send(call, message)
            span = hops.spans.pop(call.inbox, None)
            verdict = isinstance(message, VerdictFrame) or (
                isinstance(message, pb.ServerMessage) and message.WhichOneof("body") == "verdict"
            )
            if span is not None and span[2] is not None and verdict:
                arrival, start, end = span
                hops.samples.append((start - arrival, end - start, clock() - end))

        for owner, name, fn, real in ((Inbox, "offer", offer, real_offer), (Rounds, "take", take, real_take),
                                      (Rounds, "run", run, real_run), (Rounds, "_record", record, real_record),
                                      (frontend_host.EngineCall, "_send", send, real_send)):  # fmt: skip
            setattr(owner, name, fn)
            self._undo.append(lambda o=owner, n=name, r=real: setattr(o, n, r))

    def uninstall(self) -> None:
        while self._undo:
            self._undo.pop()()

    def rows(self) -> list[dict]:
        """Per hop and for their sum: rounds, mean and p50 in ms."""
        if not self.samples:
            return []
        cols = list(zip(*self.samples, strict=True)) + [[sum(x) for x in self.samples]]
        names = ("arrival -> round starts", "round (claim, batcher)", "verdict -> reply queued", "in the engine")
        return [{"hop": n, "rounds": len(c), "mean_ms": 1e3 * statistics.fmean(c), "p50_ms": 1e3 * statistics.median(c)}
                for n, c in zip(names, cols, strict=True)]  # fmt: skip


def hops_table(rows: list[dict], client_p50_ms: float | None) -> Table:
    where = f"; the clients' p50 round trip {client_p50_ms:.1f} ms" if client_p50_ms is not None else ""
    t = Table(title=f"A round's time in the engine, with front ends{where}")
    for col in ("hop", "rounds", "mean ms", "p50 ms"):
        t.add_column(col, justify="left" if col == "hop" else "right")
    for r in rows:
        t.add_row(r["hop"], str(r["rounds"]), f"{r['mean_ms']:.2f}", f"{r['p50_ms']:.2f}")
    return t


def table(rows: list[dict], steps: int) -> Table:
    f = lambda x, spec: "-" if x is None else format(x, spec)
    t = Table(title=f"Phases of the server's rounds, {steps} batched steps (wall / thread CPU)")
    for col in ("thread", "phase", "calls", "wall ms / step", "CPU ms / step", "wall us / call", "CPU us / call"):
        t.add_column(col, justify="left" if col in ("thread", "phase") else "right")
    for r in rows:
        t.add_row(
            r["thread"],
            r["phase"],
            str(r["calls"]),
            f(r["wall_ms_per_step"], ".3f"),
            f(r["cpu_ms_per_step"], ".3f"),
            f(r["wall_us_per_call"], ".1f"),
            f(r["cpu_us_per_call"], ".1f"),
        )
    return t


def load_server_bench():
    path = Path(__file__).resolve().parent / "server.py"
    spec = importlib.util.spec_from_file_location("bench_server", path)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.parent))  # bench/server.py imports its siblings (traces)
    spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 usage="%(prog)s [-h] -- BENCH_SERVER_ARGS")  # fmt: skip
    ap.add_argument("server_args", nargs=argparse.REMAINDER, help="bench/server.py's arguments, after --")
    args = ap.parse_args(argv)
    server_args = args.server_args[1:] if args.server_args[:1] == ["--"] else args.server_args
    bench = load_server_bench()
    parsed = bench.parser().parse_args(server_args)
    if parsed.target or len(parsed.clients) != 1:
        raise SystemExit("phases times an in-process server (no --target) at one --clients count")
    phases, hops = Phases(), Hops()
    phases.install()
    if parsed.frontends:
        hops.install()
    try:
        record = bench.main(server_args)
    finally:
        phases.uninstall()
        hops.uninstall()
    rows = phases.rows()
    steps = phases.steps()
    console = Console(width=160)
    console.print(table(rows, steps))
    hop_rows = hops.rows()
    if hop_rows:
        console.print(hops_table(hop_rows, record["rows"][0].get("p50_ms")))
    out = {"bench": "phases", "steps": steps, "phases": rows, "hops": hop_rows, "taken_from_frames": hops.taken,
           "server": record}  # fmt: skip
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
