"""The synthetic clients of bench/server.py: one client process's worth, over grpc.aio.

Contract: bench/server.py starts each client process as `bench/server.py --worker ADDRESS ...` (its own arguments
passed along as JSON), and that runs `client_process` here. It opens its clients, warms them up, prints
`{"ready": n}`, waits for "go" on stdin, runs the timed part and prints one JSON line of numbers, which the bench
process adds up (bench/server.py's module docstring says what each mode does and what is timed).
- `RoundClient`: one Session stream of random draft chains, one round at a time (`--rate` paces it). A session the
  server evicted (REASON_SESSION_EVICTED / REASON_UNKNOWN_SESSION) is rebuilt as tether.client does: Resync with its
  full verified history, then a new stream attaches and rounds go on; REASON_CAPACITY is retried after the server's
  advice. run() counts both ("evicted", "resyncs", "capacity_retries") instead of the client dying.
- `TraceClient`: the same stream replaying recorded drafts (bench/traces.py), a new session when a trace runs out.
- `generate_stream` / `generate_until`: the server-only baseline, Generate streams (greedy, ignore_eos: each runs to
  its length).

    python bench/server.py --device cpu --clients 1 8 --rounds 20   # the bench process starts these
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import resource
import sys
import time

import grpc

from tether.client.refusals import LOST, Refusal
from tether.v1 import tether_pb2 as pb
from tether.v1 import tether_pb2_grpc

MAX_MESSAGE = 64 << 20
LOSSLESS = pb.CODEC_FP16_SHUFFLE_ZSTD  # tether.client.session's default codec ("lossless")
# Greedy, through end-of-text: every Generate stream is --tokens long, as the sessions' rounds are.
FIXED_LENGTH = pb.SamplingParams(ignore_eos=True)


class Refused(RuntimeError):
    """A message or call the server refused, with its typed reason and retry advice (`refusal`)."""

    def __init__(self, refusal: Refusal, round_no: int = 0):
        super().__init__(f"server error on round {round_no}: {pb.ErrorReason.Name(refusal.reason)}: {refusal.message}")
        self.refusal = refusal


class RoundClient:
    """One Session stream: open with a random prompt, then chains of random drafts, one round at a time."""

    def __init__(self, stub, args: argparse.Namespace, vocab: int, fp: str, seed: int):
        self.stub, self.args, self.vocab, self.fp = stub, args, vocab, fp
        self.rng = random.Random(seed)
        self.call = None
        self.session_id, self.resume_token, self.root, self.round = "", "", 0, 0
        self.history: list[int] = []  # the verified tokens (prompt first): what a resync rebuilds the session from
        self.prompt_len = 0
        self.evicted = self.resyncs = self.retries = 0  # over the client's life; run() reports its own part

    async def _send(self, msg: pb.ClientMessage) -> pb.ServerMessage:
        await asyncio.wait_for(self.call.write(msg), self.args.rpc_timeout)
        reply = await asyncio.wait_for(self.call.read(), self.args.rpc_timeout)
        if reply is grpc.aio.EOF:
            raise RuntimeError("the server ended the stream")
        if reply.WhichOneof("body") == "error":
            raise Refused(Refusal.of_inline(reply.error), reply.error.round)
        return reply

    async def _past_capacity(self, send):
        """`send()`, again after the server's retry advice while it answers REASON_CAPACITY (full for now)."""
        while True:
            try:
                return await send()
            except Refused as e:
                if e.refusal.reason != pb.REASON_CAPACITY:
                    raise
                self.retries += 1
                await asyncio.sleep(e.refusal.retry_after_s or 0.05)

    async def _resync_call(self, req: pb.ResyncRequest) -> pb.ResyncReply:
        try:
            return await self.stub.Resync(req, timeout=self.args.rpc_timeout)
        except grpc.aio.AioRpcError as e:
            raise Refused(Refusal.of_rpc_error(e)) from None

    async def resync(self) -> None:
        """Rebuild the lost session from its verified history, the root absorbed (the Resync RPC, as tether.client
        does after an eviction), and attach a new stream: rounds go on from the target's next token."""
        while True:
            req = pb.ResyncRequest(session_id=self.session_id, resume_token=self.resume_token,
                                   verified_length=len(self.history), offline_tokens=[self.root],
                                   history=self.history, prompt_length=self.prompt_len, delta_codec=LOSSLESS,
                                   model_fingerprint=self.fp)  # fmt: skip
            reply = await self._past_capacity(lambda req=req: self._resync_call(req))
            self.history.append(self.root)
            if reply.verified_length != len(self.history):
                raise RuntimeError(f"resync left {reply.verified_length} positions verified, not {len(self.history)}")
            self.session_id, self.resume_token = reply.session_id, reply.resume_token
            self.call.cancel()  # the evicted session's stream
            self.call = self.stub.Session(timeout=self.args.timeout)
            attach = pb.AttachSession(session_id=self.session_id, resume_token=self.resume_token)
            try:
                attached = (await self._send(pb.ClientMessage(attach=attach))).attached
            except Refused as e:
                if e.refusal.reason not in LOST:
                    raise
                self.evicted += 1  # evicted again before it attached: rebuild it from where it now stands
                self.root = reply.target_token
                continue
            self.root, self.round = attached.root, attached.last_round
            self.resyncs += 1
            return

    def prompt(self) -> tuple[list[int], int]:
        """The next session's prompt and max_new_tokens."""
        a = self.args
        return [self.rng.randrange(self.vocab) for _ in range(a.prompt_len)], (a.warmup_rounds + a.rounds) * (a.k + 1)

    def drafts(self) -> list[int]:
        """The next round's draft tokens (after self.root)."""
        return [self.rng.randrange(self.vocab) for _ in range(self.args.k)]

    def verdict(self, root: int, v: pb.Verdict, out: dict, counted: bool) -> None:
        """What a replay follows and checks of each verdict (nothing here); `counted`: it arrived in the window."""

    def exhausted(self) -> bool:
        """Whether this session has no round left to send (its --warmup-rounds + --rounds were sent, all its
        max_new_tokens may be spent; a trace ran out): the next round opens a new one."""
        return self.round >= self.args.warmup_rounds + self.args.rounds

    async def open(self) -> None:
        self.call = self.stub.Session(timeout=self.args.timeout)
        prompt, max_new = self.prompt()
        req = pb.OpenSession(prompt=prompt, max_new_tokens=max_new, model_fingerprint=self.fp, delta_codec=LOSSLESS)
        reply = await self._past_capacity(lambda: self._send(pb.ClientMessage(open=req)))
        for _ in range(reply.opened.delta_parts):  # a long prompt's delta comes in parts
            await asyncio.wait_for(self.call.read(), self.args.rpc_timeout)
        self.session_id, self.root, self.round = reply.opened.session_id, reply.opened.first_token, 0
        self.resume_token, self.history, self.prompt_len = reply.opened.resume_token, list(prompt), len(prompt)

    async def run(self, n: int | None = None, until: float = 0.0, rate: float = 0.0) -> dict:
        """n rounds, or (n None) rounds until `until` (time.perf_counter), paced to `rate` tokens/s when set: a
        round goes when the tokens gained so far are due at that rate (a client behind its budget catches up
        back to back). Counts (rounds, scored and gained tokens, trace matches) cover the verdicts that arrived
        by `until`; lat_s has every round's latency (write to verdict); evicted / resyncs / capacity_retries what it
        met (a round refused for an evicted session is sent again after the resync, one refused for capacity after
        the retry advice: its latency includes the wait)."""
        out = {"lat_s": [], "rounds": 0, "scored": 0, "gained": 0, "matched": 0, "recorded": 0, "reopens": 0}
        before = self.counts()
        t0 = time.perf_counter()
        budget = 0  # tokens gained, due at t0 + budget / rate
        if n is None and not until:
            raise ValueError("run() needs a number of rounds or an end")
        while n is None or len(out["lat_s"]) < n:
            if rate > 0:
                due = t0 + budget / rate
                if until and due >= until:
                    break
                if (wait := due - time.perf_counter()) > 0:
                    await asyncio.sleep(wait)
            if until and time.perf_counter() >= until:
                break
            if self.exhausted():
                await self.close()
                await self.open()
                out["reopens"] += 1
            self.round += 1
            root, drafts = self.root, self.drafts()
            msg = pb.ClientMessage(round=pb.DraftRound(round=self.round, root=root, tokens=drafts))
            t1 = time.perf_counter()
            try:
                v = (await self._past_capacity(lambda msg=msg: self._send(msg))).verdict
            except Refused as e:
                if e.refusal.reason not in LOST:
                    raise
                self.evicted += 1
                await self.resync()
                continue
            if rtt_s := self.args.rtt_ms / 1e3:  # the verdict's way back, as a link would take
                await asyncio.sleep(rtt_s)
            t2 = time.perf_counter()
            self.history += [root, *drafts[: v.accepted]]  # what the verdict verified (the bonus is the next root)
            out["lat_s"].append(t2 - t1)
            self.root = v.bonus
            budget += v.accepted + 1
            if not until or t2 <= until:
                out["rounds"] += 1
                out["scored"] += len(drafts) + 1
                out["gained"] += v.accepted + 1
            self.verdict(root, v, out, not until or t2 <= until)
        return out | {name: count - before[name] for name, count in self.counts().items()}

    def counts(self) -> dict[str, int]:
        """What the server's evictions cost this client so far: rounds refused, resyncs, retries at capacity."""
        return {"evicted": self.evicted, "resyncs": self.resyncs, "capacity_retries": self.retries}

    async def close(self) -> None:
        if self.call is None:
            return
        try:
            await asyncio.wait_for(self.call.done_writing(), self.args.rpc_timeout)
            if self.session_id:
                await self.stub.Close(pb.CloseRequest(session_id=self.session_id), timeout=self.args.rpc_timeout)
        except (grpc.RpcError, TimeoutError):
            pass
        self.call.cancel()
        self.call, self.session_id = None, ""


class TraceClient(RoundClient):
    """Replays recorded drafts (bench/traces.py): a session on trace i's prompt, then for round r the drafts
    recorded for round r, after the root the server actually decided (the last verdict's bonus). With the
    recording's target, device and dtype the verdicts are the recorded ones; elsewhere they may drift, and
    round r still sends round r's drafts. A trace that runs out: a new session on the next trace."""

    def __init__(self, stub, args: argparse.Namespace, vocab: int, fp: str, traces: list[dict], index: int):
        super().__init__(stub, args, vocab, fp, index)
        self.traces, self.index, self.pos = traces, index - 1, 0

    def prompt(self) -> tuple[list[int], int]:
        self.index, self.pos = (self.index + 1) % len(self.traces), 0
        t = self.traces[self.index]
        return list(t["prompt"]), 1 + sum(len(r["drafts"]) + 1 for r in t["rounds"])

    def exhausted(self) -> bool:
        return self.pos >= len(self.traces[self.index]["rounds"])

    def drafts(self) -> list[int]:
        return list(self.traces[self.index]["rounds"][self.pos]["drafts"])

    def verdict(self, root: int, v: pb.Verdict, out: dict, counted: bool) -> None:
        rec = self.traces[self.index]["rounds"][self.pos]
        self.pos += 1
        if counted:
            out["recorded"] += rec["accepted"] + 1
            out["matched"] += root == rec["root"] and v.accepted == rec["accepted"] and v.bonus == rec["bonus"]


async def generate_stream(stub, args: argparse.Namespace, prompt: list[int], fp: str, tokens: int) -> dict:
    req = pb.OpenSession(prompt=prompt, max_new_tokens=tokens, model_fingerprint=fp, sampling=FIXED_LENGTH)
    t0 = time.perf_counter()
    first = last = None
    n = 0
    async for msg in stub.Generate(req, timeout=args.timeout):  # bounded: the call's deadline
        last = time.perf_counter()
        first = first or last
        n += len(msg.tokens)
    if first is None:
        raise RuntimeError("a Generate stream sent no token")
    return {"tokens": n, "ttft_s": first - t0, "stream_s": last - first}


async def generate_until(stub, args: argparse.Namespace, prompts, fp: str, until: float) -> dict:
    """Generate streams of --tokens, one after another, until `until`: the tokens received by then, the gaps
    between a stream's messages and each stream's time to first token. `prompts()` gives each stream's prompt. A
    stream refused for capacity (REASON_CAPACITY: the KV pool full, as 128 streams fill the CPU's) is tried again
    after the server's advice and counted (`capacity_retries`), not the end of every client of the process: a load
    that died would leave the rest of bench/link.py's loaded cells idle.
    The client's own window (`window_s`, `window_tokens`) starts at its first token: a Session client opens and
    warms up before the window, so the first stream's open and prefill are not counted against this one either
    (every later stream's are)."""
    out = {"tokens": 0, "gaps_s": [], "ttft_s": [], "streams": 0, "window_s": 0.0, "window_tokens": 0,
           "capacity_retries": 0}  # fmt: skip
    while time.perf_counter() < until:
        if rtt_s := args.rtt_ms / 1e3:  # the open's way out and the first chunk's back
            await asyncio.sleep(rtt_s)
        req = pb.OpenSession(prompt=prompts(), max_new_tokens=args.tokens, model_fingerprint=fp, sampling=FIXED_LENGTH)
        call = stub.Generate(req, timeout=args.timeout)
        t0 = last = time.perf_counter()
        out["streams"] += 1
        try:
            while (left := until - time.perf_counter()) > 0:
                msg = await asyncio.wait_for(call.read(), left)
                if msg is grpc.aio.EOF:
                    break
                t = time.perf_counter()
                out["tokens"] += len(msg.tokens)
                if out["window_s"]:
                    out["window_tokens"] += len(msg.tokens)
                else:
                    out["window_s"] = until - t
                (out["gaps_s"] if last > t0 else out["ttft_s"]).append(t - last)
                last = t
        except TimeoutError:
            pass
        except grpc.aio.AioRpcError as e:  # full for now (the KV pool, streams): again after the server's advice
            refusal = Refusal.of_rpc_error(e)
            if refusal.reason != pb.REASON_CAPACITY:
                raise
            out["capacity_retries"] += 1
            await asyncio.sleep(min(refusal.retry_after_s or 0.05, max(until - time.perf_counter(), 0.0)))
        finally:
            call.cancel()
    return out


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def emit(obj: dict) -> None:
    print(json.dumps(obj), flush=True)


async def await_go() -> None:
    line = await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    if line.strip() != "go":  # EOF: the bench process went away
        raise SystemExit(1)


def open_channels(address: str, n: int) -> list[grpc.aio.Channel]:
    """n grpc.aio channels to `address`, each on a TCP connection of its own, as n separate clients would be: grpc's
    global subchannel pool would otherwise carry every channel of this process over one connection, which the
    server's SO_REUSEPORT then hands to a single front end (and HTTP/2 multiplexes all their streams)."""
    opts = [("grpc.max_receive_message_length", MAX_MESSAGE), ("grpc.max_send_message_length", MAX_MESSAGE),
            ("grpc.use_local_subchannel_pool", 1)]  # fmt: skip
    return [grpc.aio.insecure_channel(address, options=opts) for _ in range(n)]


async def client_process(
    args: argparse.Namespace, n: int, seed: int, first: int = 0, recorded: dict | None = None
) -> None:
    """Open n clients (numbers first .. first + n - 1 of all processes' clients), warm up, say "ready", wait for
    "go" on stdin, run the timed part, print its numbers. `recorded`: the --traces file as bench/traces.py loads
    it (trace mode, and Generate's prompts when given)."""
    chans = open_channels(args.worker, n if args.channels <= 0 else min(args.channels, n))
    stubs = [tether_pb2_grpc.TetherStub(ch) for ch in chans]
    clients: list[RoundClient] = []
    recorded = recorded or {}
    traces = recorded.get("traces", [])
    try:
        info = await stubs[0].GetModelInfo(pb.GetModelInfoRequest(), timeout=args.rpc_timeout)
        vocab, fp = json.loads(info.model_config_json)["vocab_size"], info.model_fingerprint
        if recorded.get("target_fingerprint") and recorded["target_fingerprint"] != fp:
            raise SystemExit(f"{args.traces} was recorded with target {recorded['target_fingerprint'][:12]}; the "
                             f"server serves {fp[:12]}")  # fmt: skip
        prompt_len = max((len(t["prompt"]) for t in traces), default=args.prompt_len)
        k = max((len(r["drafts"]) for t in traces for r in t["rounds"]), default=args.k)
        if prompt_len > info.max_prompt_tokens or k > info.max_draft_tokens:
            raise SystemExit(f"the server takes prompts of {info.max_prompt_tokens} and rounds of "
                             f"{info.max_draft_tokens} tokens at most")  # fmt: skip
        room = json.loads(info.model_config_json)["max_seq_len"] - prompt_len
        if args.mode == "random" and (args.warmup_rounds + args.rounds) * (k + 1) > room:
            raise SystemExit(f"{args.warmup_rounds} + {args.rounds} rounds of {k + 1} tokens after a {prompt_len}-"
                             f"token prompt exceed the model's {room + prompt_len} positions: at most "
                             f"{room // (k + 1) - args.warmup_rounds} rounds")  # fmt: skip
        if args.mode == "generate":
            rng = random.Random(seed)

            def prompts(i: int):
                def next_prompt() -> list[int]:
                    nonlocal i
                    i += 1
                    if traces:
                        return list(traces[(i - 1) % len(traces)]["prompt"])
                    return [rng.randrange(vocab) for _ in range(args.prompt_len)]

                return next_prompt

            await generate_stream(stubs[0], args, prompts(first)(), fp, 8)  # the first stream's one-time costs
            emit({"ready": n})
            await await_go()
            t0, c0 = time.perf_counter(), cpu_s()
            if args.duration > 0:
                until = t0 + args.duration
                streams = await asyncio.gather(*(generate_until(stubs[i % len(stubs)], args, prompts(first + i), fp,
                                                                until) for i in range(n)))  # fmt: skip
            else:
                streams = await asyncio.gather(*(generate_stream(stubs[i % len(stubs)], args, prompts(first + i)(), fp,
                                                                 args.tokens) for i in range(n)))  # fmt: skip
            emit({"wall_s": time.perf_counter() - t0, "cpu_s": cpu_s() - c0, "streams": streams})
            return
        if args.mode == "trace":
            clients = [TraceClient(stubs[i % len(stubs)], args, vocab, fp, traces, first + i) for i in range(n)]
        else:
            clients = [RoundClient(stubs[i % len(stubs)], args, vocab, fp, seed + i) for i in range(n)]
        await asyncio.gather(*(c.open() for c in clients))
        await asyncio.gather(*(c.run(args.warmup_rounds) for c in clients))
        emit({"ready": n})
        await await_go()
        t0, c0 = time.perf_counter(), cpu_s()
        if args.duration > 0:
            until = t0 + args.duration
            results = await asyncio.gather(*(c.run(None, until, args.rate) for c in clients))
        else:
            results = await asyncio.gather(*(c.run(args.rounds, 0.0, args.rate) for c in clients))
        emit({"wall_s": time.perf_counter() - t0, "cpu_s": cpu_s() - c0, "clients": results})
    finally:
        await asyncio.gather(*(c.close() for c in clients), return_exceptions=True)
        for ch in chans:
            await ch.close()
