"""Work whose caller has gone never reaches the model, and a caller's queued model work is bounded
(tether.server.model_work, the batcher's take, SequenceVerifier.open's stop between chunks).

Each test holds the model where it wants it with a gate (a wrapped prefill or batch step that counts its calls and
waits on a threading.Event the test sets), cancels calls while their work waits, then lets the model go on and counts
what ran. Every wait is a bounded poll on something observable; nothing asserts a duration.
"""

import asyncio
import threading

import grpc
import pytest
from test_frontends import until
from test_service import FP, VOCAB, Client, open_msg
from tiny_models import tiny_moa_drafter, tiny_target

from tether.client.refusals import Refusal
from tether.server import batcher as batcher_module
from tether.server.auth import peer_host
from tether.server.engine_core import Engine
from tether.server.launch import LaunchPlan, listen
from tether.server.serve_config import ServiceConfig
from tether.server.service import TetherService
from tether.shared.tokenizer import Tokenizer
from tether.v1 import tether_pb2 as pb
from tether.v1 import tether_pb2_grpc

FAIL_S = 20.0  # how long a poll waits before the test fails (what it waits for takes milliseconds when it works)


class Gate:
    """`fn` wrapped: every call is recorded (what `record` makes of its arguments), and call number `hold` waits,
    inside, until `release` is set; `holding` is set once it waits."""

    def __init__(self, fn, hold: int, record=lambda *a, **kw: a[0]):
        self.fn, self.hold, self.record = fn, hold, record
        self.calls: list = []
        self.holding, self.release = threading.Event(), threading.Event()

    def __call__(self, *args, **kw):
        self.calls.append(self.record(*args, **kw))
        if len(self.calls) == self.hold:
            self.holding.set()
            assert self.release.wait(FAIL_S * 3), "the test never released the gate"
        return self.fn(*args, **kw)


@pytest.fixture(scope="module")
def models():
    target = tiny_target(vocab_size=VOCAB)
    tok = Tokenizer.train(texts=["def f(x):\n    return x\n"] * 20, vocab_size=260)
    return target, tiny_moa_drafter(target), tok


@pytest.fixture
def serve(models):
    """A service with one model thread on loopback, made with the test's config; stopped after."""
    made = []

    def make(frontends: int = 0, **config):
        target, drafter, tok = models
        config = {"max_prompt_tokens": 64, "max_sessions": 8, "model_threads": 1} | config
        service = TetherService(Engine(target, drafter, tok, ServiceConfig(**config), model_fingerprint=FP))
        server, port = listen(service, "127.0.0.1:0", LaunchPlan(frontends=frontends))
        server.start()
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        made.append((server, channel))
        return service, tether_pb2_grpc.TetherStub(channel)

    yield make
    for server, channel in made:
        channel.close()
        server.stop(grace=None)


def rebuild(history: list[int]) -> pb.ResyncRequest:
    """A Resync for a session the server does not hold: a rebuild, a prefill of the whole history."""
    return pb.ResyncRequest(verified_length=len(history), offline_tokens=[1], history=history, model_fingerprint=FP)


def test_rounds_whose_callers_went_away_are_dropped_before_the_step_and_free_their_session(serve, monkeypatch):
    service, stub = serve()
    gate = Gate(batcher_module.verify_batch, hold=1, record=lambda target, items, **kw: [v for v, _ in items])
    monkeypatch.setattr(batcher_module, "verify_batch", gate)
    clients = [Client(stub) for _ in range(3)]
    opened = [c.send(open_msg([1, 2, 3, 4, 5])).opened for c in clients]
    verifiers = [service.engine.sessions[o.session_id].verifier for o in opened]
    for c, o in zip(clients, opened, strict=True):  # A's round is taken into a step, held there; B's and C's queue
        c.outbox.put(pb.ClientMessage(round=pb.DraftRound(round=1, root=o.first_token, tokens=[1, 2])))
        if c is clients[0]:
            assert gate.holding.wait(FAIL_S)
    until(lambda: service.engine.batcher.inbox.qsize() == 2, "B's and C's rounds queued", FAIL_S)
    clients[1].replies.cancel()  # B goes away while its round waits for the step in flight
    b = service.engine.sessions[opened[1].session_id]
    until(lambda: b.busy == 0, "B's session released while the step is still held", FAIL_S)
    gate.release.set()
    assert clients[0].replies.next().verdict.round == 1 and clients[2].replies.next().verdict.round == 1
    assert gate.calls == [[verifiers[0]], [verifiers[2]]]  # B's round never reached the model
    assert b.verifier.length == 5  # and its session stands where it stood, for an attach
    for c in clients:
        c.close()


def test_opens_and_rebuilds_cancelled_while_queued_never_prefill_and_give_their_sessions_back_at_once(
    serve, monkeypatch
):
    service, stub = serve()
    target = service.engine.target
    gate = Gate(target.prefill, hold=1, record=lambda ids, *a, **kw: ids.shape[1])
    monkeypatch.setattr(target, "prefill", gate)
    first, second = Client(stub), Client(stub)
    first.outbox.put(open_msg([1, 2, 3]))  # holds the one model thread, inside its prefill
    assert gate.holding.wait(FAIL_S)
    second.outbox.put(open_msg([4, 5, 6, 0]))  # queued behind it
    rebuilds = [stub.Resync.future(rebuild([3, 1, 4, 1, 5, 2, 6])) for _ in range(3)]
    until(lambda: len(service.engine.sessions) == 5, "an open and three rebuilds queued", FAIL_S)
    second.replies.cancel()
    for call in rebuilds:
        call.cancel()
    until(lambda: len(service.engine.sessions) == 1, "the cancelled calls' sessions retired at once", FAIL_S)
    gate.release.set()
    assert first.replies.next().opened.session_id in service.engine.sessions
    assert gate.calls == [3]  # one prefill: the first open's; nothing queued behind it ever ran
    first.close()
    (session,) = service.engine.sessions.values()
    stub.Close(pb.CloseRequest(session_id=session.id), timeout=FAIL_S)
    assert service.engine.pool.used_blocks == 0 and service.engine.table.blocks_held() == 0


def test_a_long_rebuild_stops_between_prefill_chunks_once_its_caller_has_gone(serve, monkeypatch):
    service, stub = serve(prefill_chunk=4)
    target = service.engine.target
    gate = Gate(target.prefill, hold=2, record=lambda ids, *a, **kw: ids.shape[1])
    monkeypatch.setattr(target, "prefill", gate)
    call = stub.Resync.future(rebuild([(3 * i + 1) % VOCAB for i in range(32)]))  # 8 chunks of 4
    assert gate.holding.wait(FAIL_S)  # in its second chunk
    call.cancel()
    # The cancel reaches the server over the wire: release the chunk only once the server has seen the caller go.
    until(lambda: service.engine.work.told_to_stop() == 1, "the server told the rebuild its caller has gone", FAIL_S)
    gate.release.set()
    until(
        lambda: not service.engine.sessions and service.engine.pool.used_blocks == 0,
        "the rebuild's session retired",
        FAIL_S,
    )
    assert gate.calls == [4, 4]  # the chunk in flight finished; none after it started


def test_a_session_whose_open_answer_never_went_out_is_retired_and_one_answered_stays(serve):
    """The stream ends inside the yield of its Opened (gRPC never took the message): the client cannot know the id,
    so the session and its KV go back at once. Once the answer has gone out, a stream that ends leaves it held."""
    service, _ = serve()

    async def open_then(answered: bool) -> str:
        asked = asyncio.Event()

        async def messages():
            yield open_msg([2, 4, 6, 1])
            asked.set()
            await asyncio.Event().wait()  # the client says nothing more

        handler = service.Session(messages(), None)
        sid = (await anext(handler)).opened.session_id
        assert sid in service.engine.sessions
        if answered:  # gRPC asks for the next message: the Opened went out
            reading = asyncio.ensure_future(anext(handler))
            await asked.wait()
            reading.cancel()  # the client goes away
            with pytest.raises(asyncio.CancelledError):
                await reading
        else:
            await handler.aclose()  # the call ended while its answer was being sent
        return sid

    gone = asyncio.run(open_then(answered=False))
    assert gone not in service.engine.sessions and service.engine.pool.used_blocks == 0
    held = asyncio.run(open_then(answered=True))
    assert held in service.engine.sessions and service.engine.pool.used_blocks > 0


@pytest.mark.parametrize("frontends", [0, 1])
def test_a_caller_over_its_queued_model_calls_is_refused_with_retry_advice(serve, monkeypatch, frontends):
    """Counted per host (no API keys here), in the engine, whether a front end carried the calls or not."""
    service, stub = serve(frontends, max_model_calls_per_caller=2)
    target = service.engine.target
    gate = Gate(target.prefill, hold=1, record=lambda ids, *a, **kw: ids.shape[1])
    monkeypatch.setattr(target, "prefill", gate)
    history = [3, 1, 4, 1, 5]
    waiting = [stub.Resync.future(rebuild(history)) for _ in range(2)]  # one in the model thread, one queued
    assert gate.holding.wait(FAIL_S)
    until(lambda: len(service.engine.sessions) == 2, "both rebuilds handed to the model thread's queue", FAIL_S)
    assert service.engine.work.queued("host ipv4:127.0.0.1") == 2
    with pytest.raises(grpc.RpcError) as e:
        stub.Resync(rebuild(history), timeout=FAIL_S)
    refusal = Refusal.of_rpc_error(e.value)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and refusal.reason == pb.REASON_CAPACITY
    assert refusal.retry_after_s > 0
    assert len(service.engine.sessions) == 2  # the refused call left nothing behind
    gate.release.set()
    assert all(w.result(timeout=FAIL_S).rebuilt for w in waiting)  # the caller's queue drained: it is served again
    assert stub.Resync(rebuild(history), timeout=FAIL_S).rebuilt


def test_queued_work_counts_per_host_not_per_connection():
    assert peer_host("ipv4:127.0.0.1:41234") == "ipv4:127.0.0.1"
    assert peer_host("ipv6:[::1]:5000") == "ipv6:[::1]"
    assert peer_host("unix:/tmp/x.sock") == "unix:/tmp/x.sock"


@pytest.mark.parametrize("keys", [frozenset(), frozenset({"k1", "k2"})], ids=["no keys", "keys"])
def test_each_http_client_counts_its_own_queued_work_like_a_grpc_caller(keys):
    """The HTTP API's requests run with the caller set as gRPC calls do: its key's identity, else its host; never
    one pool shared by every HTTP client."""
    from tether.server.auth import CALLER, PEER, http_callers, identity, work_owner

    seen = []

    async def inner(scope, receive, send):
        seen.append(work_owner())

    app = http_callers(inner, keys)

    async def request(host: str, key: str | None) -> None:
        headers = [(b"authorization", f"Bearer {key}".encode())] if key else []
        await app({"type": "http", "client": (host, 5000), "headers": headers}, None, None)

    async def requests() -> None:  # each in a task of its own, as uvicorn runs them
        for host, key in [("10.0.0.7", None), ("10.0.0.8", None), ("10.0.0.7", "k2"), ("10.0.0.7", "wrong")]:
            await asyncio.create_task(request(host, key))

    asyncio.run(requests())
    if keys:
        assert seen == ["host http:10.0.0.7", "host http:10.0.0.8", identity("k2"), "host http:10.0.0.7"]
    else:
        assert seen == ["host http:10.0.0.7", "host http:10.0.0.8", "host http:10.0.0.7", "host http:10.0.0.7"]
    assert (CALLER.get(), PEER.get()) == ("", "")  # set for the request alone
