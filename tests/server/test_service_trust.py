"""The server against hostile and careless clients: it gives back everything it takes, validates everything before
use, logs nothing a stranger sent, hides one key's sessions from another, frees what idle clients hold, and stays
responsive with a thousand idle streams open. Loopback only; every loop bounded; faults driven by calls and a fake
clock, never by the wall clock."""

import asyncio
import dataclasses
import json
import logging
import queue
import random
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from test_service import FP, VOCAB, Client, open_msg, run_session
from tiny_models import tiny_moa_drafter, tiny_target

from tether.client.refusals import Refusal
from tether.server.auth import identity
from tether.server.engine_core import Engine
from tether.server.logs import configure_logging
from tether.server.rpc_server import make_server
from tether.server.serve_config import ServiceConfig
from tether.server.service import TetherService
from tether.shared.tokenizer import Tokenizer
from tether.v1 import tether_pb2 as pb
from tether.v1 import tether_pb2_grpc

KEYS = {"a": "key-a", "b": "key-b"}


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def models():
    target = tiny_target(vocab_size=VOCAB)
    drafter = tiny_moa_drafter(target)
    tok = Tokenizer.train(texts=["def f(x):\n    return x\n"] * 20, vocab_size=260)
    return target, drafter, tok


class Served:
    """A service on loopback with its own config, a fake clock and a stub per API key."""

    def __init__(self, models, **config):
        target, drafter, tok = models
        config.setdefault("max_prompt_tokens", 64)
        self.service = TetherService(Engine(target, drafter, tok, ServiceConfig(**config), model_fingerprint=FP))
        self.clock = self.service.engine.table.clock = FakeClock()
        self.server, self.port = make_server(self.service, "127.0.0.1:0")
        self.server.start()
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        self.stub = tether_pb2_grpc.TetherStub(self.channel)

    def meta(self, key: str | None):
        return (("authorization", f"Bearer {KEYS[key]}"),) if key else None

    def held(self) -> int:
        """Blocks the sessions and streams own: what the pool must have in use."""
        return sum(len(s.verifier.cache.blocks) for s in self.service.engine.sessions.values())

    def close(self):
        self.channel.close()
        self.server.stop(None)


@pytest.fixture
def served(models, request):
    s = Served(models, **getattr(request, "param", {}))
    yield s
    s.close()


def refusal(call) -> Refusal:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return Refusal.of_rpc_error(e.value)


def resync_req(**kw) -> pb.ResyncRequest:
    kw.setdefault("model_fingerprint", FP)
    return pb.ResyncRequest(**kw)


# ---- 5. every block given back --------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1])
def test_blocks_in_use_equal_the_live_sessions_under_random_valid_and_invalid_calls(models, seed):
    """Hundreds of random Open / Round / Resync (held, rebuilt, refused after the rebuild's allocation would have
    begun) / attach / Close calls and evictions (the session limit, KV memory, leases) from two keys: after every
    call the pool's blocks in use equal the sum over live sessions, and zero once all are closed. A small pool and
    session limit make evictions and refusals common."""
    target, _, _ = models
    block = 4 * 2 * target.cfg.n_layers * target.cfg.n_kv_heads * target.cfg.head_dim * 4
    s = Served(models, api_keys=frozenset(KEYS.values()), max_sessions=5, max_sessions_per_key=4,
               kv_pool_bytes=40 * block, kv_block_size=4, session_lease_s=50.0)  # fmt: skip
    rng = random.Random(seed)
    known: list[tuple[str, str, str, list[int], int]] = []  # (key, session id, resume token, history, root)
    outcomes: dict[str, int] = {}
    try:
        for step in range(300):
            key = rng.choice("ab")
            meta = s.meta(key)
            op = rng.choice(["open", "open", "round", "resync", "resync_lost", "resync_bad", "attach", "close",
                             "expire", "generate"])  # fmt: skip
            prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 20))]
            try:
                if op == "open" or (op in ("round", "attach") and not known):
                    bad = rng.random() < 0.3
                    msg = open_msg(prompt, delta_codec=9) if bad else open_msg(prompt)
                    c = Client(s.stub, metadata=meta)
                    reply = c.send(msg)
                    if reply.WhichOneof("body") == "opened":
                        o = reply.opened
                        for _ in range(o.delta_parts):
                            next(c.replies)
                        known.append((key, o.session_id, o.resume_token, prompt, o.first_token))
                        if rng.random() < 0.5:  # a round on the same stream, sometimes with a bad q
                            q = [pb.SparseDistribution(ids=[VOCAB + 3], probs=[1.0])] if rng.random() < 0.3 else []
                            r = pb.DraftRound(round=1, root=o.first_token, tokens=[1] if q else [1, 2], q=q)
                            c.send(pb.ClientMessage(round=r))
                    c.close()
                elif op in ("round", "attach"):
                    k, sid, token, _, root = rng.choice(known)
                    c = Client(s.stub, metadata=s.meta(k))
                    att = c.send(pb.ClientMessage(attach=pb.AttachSession(session_id=sid, resume_token=token)))
                    if op == "round" and att.WhichOneof("body") == "attached":
                        r = pb.DraftRound(round=att.attached.last_round + 1, root=att.attached.root, tokens=[1, 2, 3])
                        c.send(pb.ClientMessage(round=r))
                    c.close()
                elif op.startswith("resync"):
                    k, sid, token, history, root = rng.choice(known) if known else (key, "0" * 32, "0" * 32, [1], 1)
                    k = key if op == "resync_bad" else k  # sometimes another key's session
                    bad = {} if op != "resync_bad" else rng.choice(
                        [{"delta_codec": 9}, {"sampling": pb.SamplingParams(temperature=float("nan"))},
                         {"sampling": pb.SamplingParams(temperature=-1.0)}, {"offline_tokens": [VOCAB + 1]},
                         {"verified_length": len(history) + 5}]
                    )  # fmt: skip
                    req = dict(session_id=sid, resume_token=token, verified_length=len(history),
                               offline_tokens=[root, 1, 2], history=[] if op == "resync" else history)  # fmt: skip
                    req |= bad
                    reply = s.stub.Resync(resync_req(**req), metadata=s.meta(k))
                    known.append((k, reply.session_id, reply.resume_token, history, reply.target_token))
                elif op == "close" and known:
                    k, sid, *_ = known.pop(rng.randrange(len(known)))
                    s.stub.Close(pb.CloseRequest(session_id=sid), metadata=s.meta(k))
                elif op == "expire":
                    s.clock.now += rng.choice([1.0, 30.0, 60.0])
                elif op == "generate":
                    list(s.stub.Generate(pb.OpenSession(prompt=prompt, max_new_tokens=3, model_fingerprint=FP),
                                         metadata=meta))  # fmt: skip
                outcomes["ok"] = outcomes.get("ok", 0) + 1
            except grpc.RpcError as e:
                name = Refusal.of_rpc_error(e).reason_name
                outcomes[name] = outcomes.get(name, 0) + 1
            assert s.service.engine.pool.used_blocks == s.held(), f"step {step} ({op}) leaked"
        assert outcomes.get("ok", 0) > 50 and len(outcomes) >= 4, outcomes
        evictions = s.service.engine.metrics.registry.get_sample_value
        assert sum(evictions("tether_evictions_total", {"reason": r}) or 0 for r in ("sessions", "memory", "lease"))
        for k, sid, *_ in known:
            try:
                s.stub.Close(pb.CloseRequest(session_id=sid), metadata=s.meta(k))
            except grpc.RpcError:
                pass  # evicted or closed before
        assert not s.service.engine.sessions and s.service.engine.pool.used_blocks == 0
    finally:
        s.close()


# ---- 6. validation everywhere -----------------------------------------------------------------------------------


def test_resync_generate_and_rounds_validate_as_open_does(served):
    s, stub = served, served.stub
    out, sid, token, verified, root = run_session(stub, tiny_moa_drafter(s.service.engine.target), [1, 2, 3], 6)
    good = dict(session_id=sid, resume_token=token, verified_length=verified, offline_tokens=[root])
    for sampling in (pb.SamplingParams(temperature=float("nan")), pb.SamplingParams(temperature=-1.0),
                     pb.SamplingParams(temperature=0.5, top_p=float("nan")), pb.SamplingParams(top_p=2.0)):  # fmt: skip
        r = refusal(lambda sampling=sampling: stub.Resync(resync_req(**good, sampling=sampling)))
        assert (r.code, r.reason) == (grpc.StatusCode.INVALID_ARGUMENT, pb.REASON_INVALID_REQUEST)
        req = pb.OpenSession(prompt=[1, 2], sampling=sampling, model_fingerprint=FP)
        r = refusal(lambda req=req: list(stub.Generate(req)))
        assert (r.code, r.reason) == (grpc.StatusCode.INVALID_ARGUMENT, pb.REASON_INVALID_REQUEST)
    for bad in ({"resume_token": "é" * 32}, {"resume_token": "x"}, {"session_id": "../" * 11 + "ab"},
                {"session_id": "A" * 32}, {"offline_tokens": [VOCAB]}):  # fmt: skip
        r = refusal(lambda bad=bad: stub.Resync(resync_req(**(good | bad))))
        assert r.code == grpc.StatusCode.INVALID_ARGUMENT, bad
    c = Client(stub)
    assert (
        c.send(pb.ClientMessage(attach=pb.AttachSession(session_id=sid, resume_token="é" * 32))).error.code
        == (grpc.StatusCode.INVALID_ARGUMENT.value[0])
    )
    att = c.send(pb.ClientMessage(attach=pb.AttachSession(session_id=sid, resume_token=token))).attached
    n = att.last_round + 1
    rnd = pb.DraftRound(round=n, root=att.root, tokens=[1], q=[pb.SparseDistribution(ids=[VOCAB + 5], probs=[1.0])])
    err = c.send(pb.ClientMessage(round=rnd)).error
    assert (err.code, err.reason) == (grpc.StatusCode.INVALID_ARGUMENT.value[0], pb.REASON_INVALID_REQUEST)
    rnd = pb.DraftRound(round=n, root=att.root, tokens=[1], q=[pb.SparseDistribution(ids=[1], probs=[float("nan")])])
    assert c.send(pb.ClientMessage(round=rnd)).error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    ok = c.send(pb.ClientMessage(round=pb.DraftRound(round=n, root=att.root, tokens=[1])))
    assert ok.WhichOneof("body") == "verdict"  # the session and its stream go on
    c.close()


# ---- 7. nothing a stranger sends reaches the log ---------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_unauthenticated_calls_log_nothing_they_sent_and_no_field_forges_a_line(models, capfd, fmt):
    s = Served(models, api_keys=frozenset(KEYS.values()))
    configure_logging(fmt)
    forged = "\n2026-01-01 00:00:00 info    session opened  event=open session=forged"
    try:
        huge = "f" * (1 << 20) + forged
        for _ in range(25):
            r = refusal(lambda: s.stub.Resync(resync_req(session_id=huge, offline_tokens=[1])))
            assert r.reason == pb.REASON_UNAUTHENTICATED
            r = refusal(lambda: s.stub.Close(pb.CloseRequest(session_id=huge)))
            assert r.reason == pb.REASON_UNAUTHENTICATED
        r = refusal(lambda: s.stub.Resync(resync_req(session_id=forged, offline_tokens=[1]), metadata=s.meta("a")))
        assert r.reason == pb.REASON_INVALID_REQUEST
        c = Client(s.stub, metadata=s.meta("a"))
        c.send(pb.ClientMessage(open=pb.OpenSession(prompt=[1, 2], request_id=forged, model_fingerprint=FP)))
        c.close()
    finally:
        logging.getLogger("tether").handlers.clear()
        s.close()
    err = capfd.readouterr().err
    assert len(err) < 50_000, f"{len(err)} bytes of log for 50 refused calls"
    assert "fff" not in err and "forged" not in err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert lines and not any(ln.startswith("2026-01-01") for ln in lines)
    if fmt == "json":
        assert all(json.loads(ln) for ln in lines if ln.startswith("{"))


# ---- 8. one key's sessions do not exist for another --------------------------------------------------------------


def test_another_keys_session_looks_like_no_session_and_its_id_cannot_be_taken(models):
    s = Served(models, api_keys=frozenset(KEYS.values()))
    try:
        out, sid, token, verified, root = run_session(s.stub, tiny_moa_drafter(s.service.engine.target), [1, 2, 3], 6,
                                                      metadata=s.meta("a"))  # fmt: skip
        history = ([1, 2, 3] + out)[:verified]
        mine = dict(session_id=sid, resume_token=token, verified_length=verified, offline_tokens=[root])
        theirs = refusal(lambda: s.stub.Resync(resync_req(**mine), metadata=s.meta("b")))
        nobody = refusal(lambda: s.stub.Resync(resync_req(**(mine | {"session_id": "0" * 32})), metadata=s.meta("b")))
        assert (theirs.code, theirs.reason, theirs.message) == (nobody.code, nobody.reason, nobody.message)
        assert refusal(lambda: s.stub.Close(pb.CloseRequest(session_id=sid), metadata=s.meta("b"))).code == (
            grpc.StatusCode.NOT_FOUND
        )
        # With the history, b gets a session of its own under a new id; a's is untouched.
        rebuilt = s.stub.Resync(resync_req(**mine, history=history), metadata=s.meta("b"))
        assert rebuilt.rebuilt and rebuilt.session_id != sid
        assert s.service.engine.sessions[sid].owner != s.service.engine.sessions[rebuilt.session_id].owner
        assert s.stub.Resync(resync_req(**mine), metadata=s.meta("a")).session_id == sid
        # A lost session is rebuilt under a new id too: its old id stays dead for every key.
        s.stub.Close(pb.CloseRequest(session_id=sid), metadata=s.meta("a"))
        again = s.stub.Resync(resync_req(**mine, history=history), metadata=s.meta("a"))
        assert again.session_id not in (sid, rebuilt.session_id) and sid not in s.service.engine.sessions
    finally:
        s.close()


# ---- 9. leases end a dead client's hold --------------------------------------------------------------------------


def test_sessions_of_clients_that_died_expire_and_give_back_quota_and_kv(models):
    s = Served(models, api_keys=frozenset(KEYS.values()), max_sessions_per_key=3, session_lease_s=60.0)
    try:
        dead = []
        for prompt in ([1, 2, 3], [2, 3, 4], [3, 4, 5]):  # three clients that die without Close
            c = Client(s.stub, metadata=s.meta("a"))
            dead.append(c.send(open_msg(prompt)).opened)
            c.close()
        c = Client(s.stub, metadata=s.meta("a"))
        err = c.send(open_msg([1, 2])).error
        assert err.reason == pb.REASON_KEY_QUOTA and 50_000 <= err.retry_after_ms <= 60_000
        assert c.send(open_msg([1, 2])).error.reason == pb.REASON_KEY_QUOTA  # still locked out before the lease ends
        other = Client(s.stub, metadata=s.meta("b"))
        assert other.send(open_msg([1, 2])).WhichOneof("body") == "opened"  # other keys never were
        other.close()
        held = s.service.engine.pool.used_blocks
        s.clock.now += 60.0
        assert c.send(open_msg([1, 2])).WhichOneof("body") == "opened"
        c.close()
        assert s.service.engine.pool.used_blocks < held and all(
            o.session_id not in s.service.engine.sessions for o in dead
        )
        lost = Client(s.stub, metadata=s.meta("a"))
        err = lost.send(pb.ClientMessage(attach=pb.AttachSession(session_id=dead[0].session_id,
                                                                 resume_token=dead[0].resume_token))).error  # fmt: skip
        assert err.code == grpc.StatusCode.NOT_FOUND.value[0]  # its client would resync with the history
        lost.close()
        assert s.service.engine.metrics.registry.get_sample_value("tether_evictions_total", {"reason": "lease"}) >= 3
    finally:
        s.close()


# ---- 11. slowloris ------------------------------------------------------------------------------------------------


def hold_idle_streams(served: Served, n: int, probe):
    """Open n Session streams that never send a message, wait until the server holds them all, then probe. Runs
    on the server's own event loop: grpc.aio shares one completion queue per process, and a second loop in the
    same process would be handed events after it closed."""
    coro = _hold_idle_streams(served.port, n, served, probe)
    return asyncio.run_coroutine_threadsafe(coro, served.server.loop).result(timeout=300)


async def _hold_idle_streams(port: int, n: int, served: Served, probe):
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{port}") for _ in range(4)]
    try:
        stubs = [tether_pb2_grpc.TetherStub(ch) for ch in channels]
        calls = [stubs[i % len(stubs)].Session() for i in range(n)]  # held open by this list
        auth = served.server.auth
        for _ in range(600):  # bounded: 60 s at most
            if auth.streams >= len(calls):
                break
            await asyncio.sleep(0.1)
        assert auth.streams == n, f"the server holds {auth.streams} of {n} streams"
        return await probe(channels[0])
    finally:
        for ch in channels:
            await ch.close()


def test_a_thousand_idle_streams_leave_health_and_model_info_answering(served):
    async def probe(channel):
        health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        info = await tether_pb2_grpc.TetherStub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
        return health.status, info.model_fingerprint

    status, fp = hold_idle_streams(served, 1000, probe)
    assert status == health_pb2.HealthCheckResponse.SERVING and fp == FP
    out, *_ = run_session(served.stub, tiny_moa_drafter(served.service.engine.target), [1, 2, 3], 6)
    assert len(out) >= 6  # and a real client still gets its rounds verified


@pytest.mark.parametrize("served", [{"stream_idle_s": 1.0, "max_streams": 8}], indirect=True)
def test_idle_streams_are_closed_and_streams_past_the_cap_are_refused_as_retryable(served):
    # The Open is queued before the stream starts, so a busy machine cannot make the stream look idle before it.
    outbox: queue.Queue = queue.Queue()
    outbox.put(open_msg([1, 2, 3]))
    replies = served.stub.Session(iter(outbox.get, None))
    opened = next(replies).opened
    with pytest.raises(grpc.RpcError) as e:
        next(replies)  # nothing more is sent: the server closes the stream once its idle limit passes
    r = Refusal.of_rpc_error(e.value)
    assert (r.code, r.reason) == (grpc.StatusCode.DEADLINE_EXCEEDED, pb.REASON_STREAM_IDLE)
    assert opened.session_id in served.service.engine.sessions  # the session stays held: the client can attach again

    async def ninth(channel):
        call = tether_pb2_grpc.TetherStub(channel).Session()
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await call.read()
        return Refusal.of_rpc_error(e.value)

    served.service.engine.config = dataclasses.replace(served.service.config, stream_idle_s=600.0)
    r = hold_idle_streams(served, 8, ninth)
    assert (r.code, r.reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED, pb.REASON_CAPACITY) and r.retry_after_s > 0


def test_a_key_past_its_calls_in_flight_is_refused_as_retryable_and_other_keys_are_not(models):
    s = Served(models, api_keys=frozenset(KEYS.values()), max_calls_per_key=2)
    try:
        held = [Client(s.stub, metadata=s.meta("a")) for _ in range(2)]
        for c in held:
            assert c.send(open_msg([1, 2])).WhichOneof("body") == "opened"  # two streams in flight for key a
        r = refusal(lambda: s.stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=s.meta("a")))
        assert (r.code, r.reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED, pb.REASON_CAPACITY) and r.retry_after_s > 0
        assert s.stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=s.meta("b")).model_fingerprint == FP
        held[0].close()
        me = identity(KEYS["a"])
        for _ in range(200):  # bounded: until the server has seen that stream end
            if s.server.auth.calls[me] < 2:
                break
            time.sleep(0.05)
        assert s.stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=s.meta("a")).model_fingerprint == FP
    finally:
        for c in held:
            c.close()
        s.close()


def test_a_late_round_from_a_stream_attached_before_a_resync_is_refused(served):
    """Round numbers restart after a resync. A stream from before it (a reconnect race) sending "round 1" with the
    new root must not be verified and recorded as the new numbering's round 1: the client's own round 1 on its new
    stream would be answered with that record."""
    stub = served.stub
    old = Client(stub)
    opened = old.send(open_msg([1, 2, 3])).opened
    reply = stub.Resync(resync_req(session_id=opened.session_id, resume_token=opened.resume_token, verified_length=3,
                                   offline_tokens=[opened.first_token]))  # fmt: skip
    late = old.send(pb.ClientMessage(round=pb.DraftRound(round=1, root=reply.target_token, tokens=[5, 5])))
    assert late.error.reason == pb.REASON_OUT_OF_ORDER
    new = Client(stub)
    att = new.send(pb.ClientMessage(attach=pb.AttachSession(session_id=opened.session_id,
                                                             resume_token=opened.resume_token))).attached  # fmt: skip
    assert att.last_round == 0 and att.verified_length == 4
    v = new.send(pb.ClientMessage(round=pb.DraftRound(round=1, root=att.root, tokens=[1]))).verdict
    assert v.round == 1 and list(v.delta.tokens)[0] == att.root
    old.close()
    new.close()
