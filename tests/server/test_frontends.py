"""The gRPC server with front-end processes (`launch.listen` with `LaunchPlan(frontends=N)`): gRPC in N processes, the
service's handlers in this one, every tether.v1.Tether call carried between them as frames over a Unix socket.

What the hop must not change: rounds, refusals (status, details, typed reason), weight downloads and the caller's
identity are what the in-process server gives for the same service; health and reflection are answered; flow
control lets a stream of many more messages than its window through, both ways. What the processes add: a front end
killed is replaced on the same port while the engine keeps its sessions; the engine drops a peer that sends garbage
and goes on; the keys travel only over the private socket; stop ends every process, removes the socket's directory
and gives back all KV. The framing itself (tether.server.frontend_wire) is tested on its own at the end.

Every wait is a bounded poll on something observable (BOUND_S is only a safety net); nothing asserts a duration.
"""

import asyncio
import hashlib
import json
import math
import os
import queue
import signal
import socket
import stat
import struct
import threading
import time
from types import SimpleNamespace

import grpc
import numpy as np
import pytest
from test_service import FP, VOCAB, Client, open_msg, plain, run_session, to_delta
from tiny_models import tiny_moa_drafter, tiny_target

from tether.client.refusals import Refusal
from tether.server import frontend_wire as wire
from tether.server.engine_core import Engine
from tether.server.launch import LaunchPlan, listen
from tether.server.rpc_server import make_server
from tether.server.serve_config import ServiceConfig
from tether.server.service import TetherService
from tether.shared.drafter_config import ArrayDelta
from tether.shared.tokenizer import Tokenizer
from tether.shared.wire import Codec, encode_bf16_bundle
from tether.v1 import tether_pb2 as pb
from tether.v1 import tether_pb2_grpc

BOUND_S = 60.0  # a safety net for waits that end on an observable condition
KEY_A, KEY_B = [("authorization", "Bearer key-a")], [("authorization", "Bearer key-b")]


def until(condition, what: str, bound_s: float = BOUND_S):
    """Poll `condition` every 50 ms until it returns something true (returned); fail after `bound_s`."""
    deadline = time.monotonic() + bound_s
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {bound_s:g} s")
        time.sleep(0.05)
    return value


def service_for(target, drafter, tok, **config) -> TetherService:
    config = {"max_prompt_tokens": 64, "max_sessions": 8} | config
    return TetherService(Engine(target, drafter, tok, ServiceConfig(**config), model_fingerprint=FP))


@pytest.fixture(scope="module")
def models():
    target = tiny_target(vocab_size=VOCAB)
    drafter = tiny_moa_drafter(target)
    tok = Tokenizer.train(texts=["def f(x):\n    return x\n"] * 20, vocab_size=260)
    return target, drafter, tok


@pytest.fixture(scope="module")
def fronted(models):
    """One service served twice: through two front ends (`stub`) and in this process (`direct`, the reference)."""
    target, drafter, tok = models
    service = service_for(target, drafter, tok)
    handles = []
    try:
        handle, port = listen(service, "127.0.0.1:0", LaunchPlan(frontends=2))
        handles.append(handle)
        handle.start()
        direct, direct_port = make_server(service, "127.0.0.1:0")
        handles.append(direct)
        direct.start()
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch, grpc.insecure_channel(f"127.0.0.1:{direct_port}") as dc:
            stub, direct_stub = tether_pb2_grpc.TetherStub(ch), tether_pb2_grpc.TetherStub(dc)
            yield SimpleNamespace(target=target, drafter=drafter, service=service, handle=handle, port=port,
                                  stub=stub, direct=direct_stub)  # fmt: skip
    finally:
        try:
            for h in handles:
                h.stop(None)
        finally:
            service.engine.close()


@pytest.fixture(scope="module")
def keyed(models):
    """A service with two API keys, through one front end."""
    target, drafter, tok = models
    service = service_for(target, drafter, tok, api_keys=frozenset({"key-a", "key-b"}))
    handle = None
    try:
        handle, port = listen(service, "127.0.0.1:0", LaunchPlan(frontends=1))
        handle.start()
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield SimpleNamespace(service=service, handle=handle, stub=tether_pb2_grpc.TetherStub(channel))
    finally:
        try:
            if handle is not None:
                handle.stop(None)
        finally:
            service.engine.close()


class Stream(Client):
    """test_service's Client with a deadline on the stream, so that a server that never answers fails the test."""

    def __init__(self, stub, metadata=None):
        self.outbox: queue.Queue = queue.Queue()
        self.replies = stub.Session(iter(self.outbox.get, None), metadata=metadata, timeout=BOUND_S)


def engine_calls(handle) -> int:
    """Calls the engine is running for front ends (its EngineCall tasks), counted on its event loop."""

    async def count() -> int:
        return sum(t.get_coro().__qualname__ == "EngineCall.run" for t in asyncio.all_tasks())

    return asyncio.run_coroutine_threadsafe(count(), handle.loop).result(timeout=BOUND_S)


def replaced(fronted, gone: set[int]) -> None:
    """Wait until two front ends other than `gone` are linked to the engine and answer on the port, and the module's
    channel is back."""

    def up():
        pids = set(fronted.handle.pids())
        linked = len(pids) == 2 and not pids & gone and set(fronted.handle.host.connections) == pids
        return linked and fresh_info(fronted.port)

    assert until(up, "two new front ends answering on the port").model_fingerprint == FP
    info = fronted.stub.GetModelInfo(pb.GetModelInfoRequest(), wait_for_ready=True, timeout=BOUND_S)
    assert info.model_fingerprint == FP


def fresh_info(port: int) -> pb.ModelInfo | None:
    """GetModelInfo over a new channel; None while nothing answers on the port."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            return tether_pb2_grpc.TetherStub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=BOUND_S / 4)
        except grpc.RpcError:
            return None


def refusal(call) -> tuple:
    """What a refused call says: status, details, typed reason and retry advice."""
    with pytest.raises(grpc.RpcError) as e:
        call()
    r = Refusal.of_rpc_error(e.value)
    return e.value.code(), e.value.details(), r.reason, r.retry_after_s


# ---- calls through the front ends -------------------------------------------------------------------------------


def test_session_rounds_through_front_ends_equal_plain_greedy_and_repeats_are_idempotent(fronted):
    prompt = [1, 2, 3, 4, 5, 6, 0, 1]
    out, sid, *_ = run_session(fronted.stub, fronted.drafter, prompt, 30, repeat_every=2)
    assert out == plain(fronted.target, prompt, len(out))
    assert sid in fronted.service.engine.sessions  # the engine holds it after the stream ended


@pytest.mark.parametrize("codec", [pb.CODEC_RAW, pb.CODEC_FP16_SHUFFLE_ZSTD, pb.CODEC_INT8_ZSTD])
def test_verdicts_encoded_by_a_front_end_are_the_engines_own_bytes_and_their_delta_bytes_are_counted(fronted, codec):
    """The same rounds, chains and trees, on two sessions of one prompt: through a front end (its delta encoded
    there, from the engine's VERDICT frame) and in process (encoded by the engine). Every reply is the same bytes;
    the engine's kv_delta metric counts the bytes the front end made; the last round sent again on a direct stream,
    after the front end's stream ended, is answered with the very reply the front end sent."""
    prompt = [2, 6, 1, 5, 2, 3]
    metric = fronted.service.engine.metrics.kv_delta_bytes
    before = metric._value.get()
    hop, direct = Stream(fronted.stub), Stream(fronted.direct)
    opened = [c.send(open_msg(prompt, delta_codec=codec)).opened for c in (hop, direct)]
    assert opened[0].delta == opened[1].delta
    sent = len(opened[0].delta.payload) + len(opened[1].delta.payload)
    root, drafter = opened[0].first_token, fronted.drafter
    drafter.begin(to_delta(opened[0].delta))
    for rnd in range(1, 7):
        drafts, _, _ = drafter.draft(root, 4)
        parents = [0, 0, 1, 1] if rnd % 2 else []  # odd rounds: a tree (two branches of two)
        msg = pb.ClientMessage(round=pb.DraftRound(round=rnd, root=root, tokens=drafts, parents=parents))
        replies = [c.send(msg) for c in (hop, direct)]
        assert replies[0].SerializeToString() == replies[1].SerializeToString()
        v = replies[0].verdict
        assert v.HasField("delta") and len(v.path) == (v.accepted if parents else 0)
        sent += 2 * len(v.delta.payload)
        drafter.commit(to_delta(v.delta))
        root = v.bonus
    hop.close()
    direct.close()
    until(lambda: metric._value.get() == before + sent, "the front end's delta bytes counted by the engine")

    again = Stream(fronted.direct)
    attach = pb.AttachSession(session_id=opened[0].session_id, resume_token=opened[0].resume_token)
    assert again.send(pb.ClientMessage(attach=attach)).attached.last_round == 6
    assert again.send(msg).SerializeToString() == replies[0].SerializeToString()
    again.close()


def test_model_info_and_refusals_keep_status_details_and_reason_across_the_hop(fronted):
    stub, direct = fronted.stub, fronted.direct
    info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=BOUND_S)
    same = direct.GetModelInfo(pb.GetModelInfoRequest(), timeout=BOUND_S)  # decode_step_s is answered per call
    assert info.SerializeToString() == same.SerializeToString()

    # Call-level aborts: the google.rpc.Status details (the typed reason) travel as trailing metadata.
    unknown = pb.ResyncRequest(session_id="0" * 32, resume_token="0" * 32, verified_length=3, offline_tokens=[1],
                               model_fingerprint=FP)  # fmt: skip
    calls = [
        lambda s: s.Resync(unknown, timeout=BOUND_S),  # no history for a session nobody holds
        lambda s: s.Close(pb.CloseRequest(session_id="0" * 32), timeout=BOUND_S),
        lambda s: s.Close(pb.CloseRequest(session_id="nope"), timeout=BOUND_S),
        lambda s: list(s.FetchWeights(pb.FetchWeightsRequest(model_fingerprint="0" * 64), timeout=BOUND_S)),
        lambda s: list(s.Generate(pb.OpenSession(prompt=[1, 99], model_fingerprint=FP), timeout=BOUND_S)),
    ]
    through = [refusal(lambda c=c: c(stub)) for c in calls]
    assert through == [refusal(lambda c=c: c(direct)) for c in calls]
    S = grpc.StatusCode
    assert [(code, reason) for code, _, reason, _ in through] == [
        (S.FAILED_PRECONDITION, pb.REASON_HISTORY_REQUIRED),
        (S.NOT_FOUND, pb.REASON_UNKNOWN_SESSION),
        (S.INVALID_ARGUMENT, pb.REASON_INVALID_REQUEST),
        (S.FAILED_PRECONDITION, pb.REASON_MODEL_MISMATCH),
        (S.INVALID_ARGUMENT, pb.REASON_INVALID_REQUEST),
    ]

    # Inline errors on a Session stream: the same messages as in process, and the stream goes on.
    def inline_errors(s) -> list[pb.ServerMessage]:
        client = Stream(s)
        try:
            got = [
                client.send(pb.ClientMessage(round=pb.DraftRound(round=1, root=0))),  # before open
                client.send(open_msg([1, 99])),  # a token out of the vocabulary
                client.send(open_msg([1] * 65)),  # over max_prompt_tokens
            ]
            opened = client.send(open_msg([1, 2, 3])).opened
            got.append(client.send(pb.ClientMessage(round=pb.DraftRound(round=2, root=opened.first_token))))
            return got
        finally:
            client.close()

    errors = inline_errors(stub)
    assert all(m.WhichOneof("body") == "error" for m in errors)
    assert errors == inline_errors(direct)
    assert [(m.error.code, m.error.reason) for m in errors] == [
        (S.FAILED_PRECONDITION.value[0], pb.REASON_OUT_OF_ORDER),
        (S.INVALID_ARGUMENT.value[0], pb.REASON_INVALID_REQUEST),
        (S.RESOURCE_EXHAUSTED.value[0], pb.REASON_TOO_LONG),
        (S.FAILED_PRECONDITION.value[0], pb.REASON_OUT_OF_ORDER),
    ]
    assert errors[-1].error.round == 2


def download(stub) -> tuple[list[bytes], dict[str, str]]:
    """A whole FetchWeights in 2000-byte chunks: the messages as sent, and each tensor's sha256 of what came."""
    req = pb.FetchWeightsRequest(model_fingerprint=FP, max_chunk_bytes=2000)
    messages = list(stub.FetchWeights(req, timeout=BOUND_S))
    parts: dict[str, list[tuple[int, bytes]]] = {}
    for m in messages[1:]:
        parts.setdefault(m.chunk.tensor, []).append((m.chunk.offset, m.chunk.data))
    digests = {name: hashlib.sha256(b"".join(d for _, d in sorted(p))).hexdigest() for name, p in parts.items()}
    return [m.SerializeToString() for m in messages], digests


def test_a_weight_download_of_many_windows_arrives_whole_and_identical(fronted):
    """Far more replies than the window: the engine goes on only as the front end gives credit back."""
    through, digests = download(fronted.stub)
    assert len(through) > 4 * wire.WINDOW
    direct, direct_digests = download(fronted.direct)
    assert digests == direct_digests
    assert through == direct  # the same messages in the same order
    manifest = pb.WeightChunk.FromString(through[0]).manifest.tensors
    assert digests == {e.name: e.sha256 for e in manifest}  # every tensor whole


def test_a_client_streaming_many_windows_ahead_gets_every_reply(fronted):
    """Requests flow control: a client sends a round again and again without reading (as after reconnects); the
    front end may carry only WINDOW of them ahead of the engine's credit, and every one is answered the same."""
    prompt = [2, 4, 6, 1, 3]
    client = Stream(fronted.stub)
    try:
        opened = client.send(open_msg(prompt)).opened
        first = client.send(pb.ClientMessage(round=pb.DraftRound(round=1, root=opened.first_token, tokens=[0, 1])))
        assert first.WhichOneof("body") == "verdict"
        again = pb.ClientMessage(round=pb.DraftRound(round=1, root=opened.first_token, tokens=[0, 1]))
        n = 4 * wire.WINDOW
        for _ in range(n):
            client.outbox.put(again)
        replies = [next(client.replies) for _ in range(n)]
    finally:
        client.close()
    assert list(client.replies) == [] and client.replies.code() == grpc.StatusCode.OK  # the half-close reached it
    assert all(r == first for r in replies)
    v = first.verdict
    assert [opened.first_token, *[0, 1][: v.accepted], v.bonus] == plain(fronted.target, prompt, v.accepted + 2)


def test_generate_streams_plain_decoding_and_a_client_going_away_cancels_it_in_the_engine(fronted):
    """The front end tells the engine when its client goes away: the handler is cancelled and the KV given back.
    The long generation cancelled here would otherwise stop on credit after WINDOW unread replies and hold its KV."""
    target, service, stub = fronted.target, fronted.service, fronted.stub
    prompt = [2, 6, 1, 3]
    held = service.engine.pool.used_blocks
    req = pb.OpenSession(prompt=prompt, max_new_tokens=40, model_fingerprint=FP)
    assert [t for m in stub.Generate(req, timeout=BOUND_S) for t in m.tokens] == plain(target, prompt, 40)
    assert service.engine.pool.used_blocks == held
    long = pb.OpenSession(prompt=prompt, max_new_tokens=1024, model_fingerprint=FP)  # 1 + 64 replies of 16 tokens
    stream = stub.Generate(long, timeout=BOUND_S)
    assert list(next(stream).tokens) == plain(target, prompt, 1)
    stream.cancel()
    until(lambda: engine_calls(fronted.handle) == 0 and service.engine.pool.used_blocks == held,
          "the engine's handler cancelled and its KV given back")  # fmt: skip


def test_health_and_reflection_are_answered_by_the_front_ends(fronted):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{fronted.port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for name in ("", "tether.v1.Tether"):
            status = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=BOUND_S).status
            assert status == health_pb2.HealthCheckResponse.SERVING
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        asks = [reflection_pb2.ServerReflectionRequest(list_services=""),
                reflection_pb2.ServerReflectionRequest(file_containing_symbol="tether.v1.Tether")]  # fmt: skip
        listed, described = stub.ServerReflectionInfo(iter(asks), timeout=BOUND_S)
    assert {"tether.v1.Tether", "grpc.health.v1.Health"} <= {s.name for s in listed.list_services_response.service}
    assert described.file_descriptor_response.file_descriptor_proto  # grpcurl can describe the service


# ---- API keys ----------------------------------------------------------------------------------------------------


def test_api_keys_are_checked_by_the_front_end_and_the_caller_reaches_the_engine(keyed):
    stub = keyed.stub
    for meta in (None, [("authorization", "Bearer wrong")]):
        with pytest.raises(grpc.RpcError) as e:
            stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=meta, timeout=BOUND_S)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    anonymous = Stream(stub)
    with pytest.raises(grpc.RpcError) as e:
        anonymous.send(open_msg([1, 2, 3]))
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    anonymous.close()
    assert not keyed.service.engine.sessions  # refused before the engine saw it

    client = Stream(stub, metadata=KEY_A)
    opened = client.send(open_msg([1, 2, 3])).opened
    client.close()
    assert opened.session_id in keyed.service.engine.sessions
    with pytest.raises(grpc.RpcError) as e:
        stub.Close(pb.CloseRequest(session_id=opened.session_id), metadata=KEY_B, timeout=BOUND_S)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND  # key-b's view: key-a's session does not exist
    assert Refusal.of_rpc_error(e.value).reason == pb.REASON_UNKNOWN_SESSION
    assert opened.session_id in keyed.service.engine.sessions
    stub.Close(pb.CloseRequest(session_id=opened.session_id), metadata=KEY_A, timeout=BOUND_S)
    assert opened.session_id not in keyed.service.engine.sessions


# ---- the processes -----------------------------------------------------------------------------------------------


def test_front_ends_killed_are_replaced_on_the_port_and_a_held_session_is_attached_again(fronted):
    target, drafter, handle = fronted.target, fronted.drafter, fronted.handle
    prompt = [3, 1, 4, 1, 5]
    with grpc.insecure_channel(f"127.0.0.1:{fronted.port}") as channel:
        client = Stream(tether_pb2_grpc.TetherStub(channel))
        opened = client.send(open_msg(prompt)).opened
        drafter.begin(to_delta(opened.delta))
        out, root = [opened.first_token], opened.first_token
        for rnd in (1, 2):
            drafts, _, _ = drafter.draft(root, 3)
            sent = pb.ClientMessage(round=pb.DraftRound(round=rnd, root=root, tokens=drafts))
            v = client.send(sent).verdict
            drafter.commit(to_delta(v.delta))
            out += drafts[: v.accepted] + [v.bonus]
            root = v.bonus
        last = (sent, v)

        killed = set(handle.pids())
        assert len(killed) == 2 and engine_calls(handle) >= 1  # this stream's, at least
        for pid in killed:  # the channel's front end is one of them, which one is the kernel's choice
            os.kill(pid, signal.SIGKILL)
        with pytest.raises(grpc.RpcError) as e:
            next(client.replies)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        client.close()

    replaced(fronted, killed)
    until(lambda: engine_calls(handle) == 0, "the dead front ends' calls cancelled in the engine")
    assert opened.session_id in fronted.service.engine.sessions  # the engine kept it through the drop

    with grpc.insecure_channel(f"127.0.0.1:{fronted.port}") as channel:
        client = Stream(tether_pb2_grpc.TetherStub(channel))
        attach = pb.AttachSession(session_id=opened.session_id, resume_token=opened.resume_token)
        attached = client.send(pb.ClientMessage(attach=attach)).attached
        assert (attached.verified_length, attached.root, attached.last_round) == (
            len(prompt) + len(out) - 1, root, 2)  # fmt: skip
        assert client.send(last[0]).verdict == last[1]  # round 2 sent again: its verdict, not a second run
        for rnd in (3, 4, 5):
            drafts, _, _ = drafter.draft(root, 3)
            v = client.send(pb.ClientMessage(round=pb.DraftRound(round=rnd, root=root, tokens=drafts))).verdict
            drafter.commit(to_delta(v.delta))
            out += drafts[: v.accepted] + [v.bonus]
            root = v.bonus
        client.close()
    assert out == plain(target, prompt, len(out))


def test_front_ends_end_their_calls_and_exit_when_the_engines_socket_closes(fronted):
    """As when the engine crashes: a front end never outlives its link. Its calls end UNAVAILABLE (retry), it exits
    on its own, and (the engine being alive here) it is started again."""
    host = fronted.handle.host
    with grpc.insecure_channel(f"127.0.0.1:{fronted.port}") as channel:
        client = Stream(tether_pb2_grpc.TetherStub(channel))
        assert client.send(open_msg([1, 2, 3])).WhichOneof("body") == "opened"
        procs = [p for p in host.procs if p.poll() is None]
        assert len(procs) == 2 and set(host.connections) == {p.pid for p in procs}
        for conn in list(host.connections.values()):
            fronted.handle.loop.call_soon_threadsafe(conn.transport.close)
        with pytest.raises(grpc.RpcError) as e:
            next(client.replies)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        client.close()
    until(lambda: all(p.poll() is not None for p in procs), "the front ends exited")
    assert [p.returncode for p in procs] == [0, 0]  # on their own, not killed
    replaced(fronted, {p.pid for p in procs})


def read_frame(sock: socket.socket) -> tuple[int, wire.Kind, bytes]:
    def exactly(n: int) -> bytes:
        data = b""
        while len(data) < n:
            more = sock.recv(n - len(data))
            assert more, "the engine closed the socket mid-frame"
            data += more
        return data

    call, kind, size = wire.HEADER.unpack(exactly(wire.HEADER.size))
    return call, wire.Kind(kind), exactly(size)


def engine_config(socket_path: str) -> dict:
    """What the engine sends a new peer on its socket before anything else."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(BOUND_S)
        sock.connect(socket_path)
        call, kind, payload = read_frame(sock)
    assert (call, kind) == (0, wire.Kind.CONFIG)
    return json.loads(payload)


def test_the_engine_drops_a_peer_sending_garbage_and_serves_on(fronted):
    handle = fronted.handle
    host = handle.host
    assert stat.S_IMODE(os.stat(host.dir).st_mode) == 0o700  # the socket's directory is this user's alone
    pids, linked = set(handle.pids()), set(host.connections)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(BOUND_S)  # recv waits at most this long; the assertion is on what it returns
        sock.connect(host.socket)
        assert read_frame(sock)[:2] == (0, wire.Kind.CONFIG)
        sock.sendall(struct.pack("<IBI", 0, 99, 0))  # a frame of no kind the protocol has
        assert sock.recv(1) == b""  # closed by the engine
    assert set(handle.pids()) == pids and set(host.connections) == linked
    assert fresh_info(fronted.port).model_fingerprint == FP


def test_config_splits_the_stream_limit_and_carries_keys_only_where_there_are_some(fronted, keyed):
    config = engine_config(fronted.handle.host.socket)
    assert config["address"] == f"127.0.0.1:{fronted.port}"  # a front end started again joins the same port
    assert config["max_streams"] == math.ceil(fronted.service.config.max_streams / 2)
    assert config["api_keys"] == []
    config = engine_config(keyed.handle.host.socket)
    assert config["max_streams"] == keyed.service.config.max_streams  # one front end: all of it
    assert sorted(config["api_keys"]) == ["key-a", "key-b"]


def test_stop_ends_the_streams_and_the_processes_and_gives_back_all_kv(models):
    target, drafter, tok = models
    service = service_for(target, drafter, tok)
    handle, port = listen(service, "127.0.0.1:0", LaunchPlan(frontends=2))
    try:
        handle.start()
        try:
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                client = Stream(tether_pb2_grpc.TetherStub(channel))
                opened = client.send(open_msg([1, 2, 3, 4])).opened
                assert service.engine.pool.used_blocks > 0 and opened.session_id in service.engine.sessions
                handle.stop(grace=None).wait()
                with pytest.raises(grpc.RpcError) as e:
                    next(client.replies)
                assert e.value.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE)
                client.close()
        finally:
            handle.stop(None)
        assert all(p.returncode is not None for p in handle.host.procs)
        assert [p.returncode for p in handle.host.procs] == [0, 0]  # they stopped on STOP, nobody killed them
        assert not os.path.exists(handle.host.dir)
        assert service.engine.pool.free_blocks == service.engine.pool.num_blocks and not service.engine.sessions
    finally:
        service.engine.close()


def test_stop_while_a_front_end_is_started_again_stops_that_one_too(models, monkeypatch):
    """A front end killed, its replacement caught before it says HELLO (it is spawned stopped), then the server
    stopped: the replacement, let go once stop has begun, must be told to stop as well and exit on its own."""
    target, drafter, tok = models
    service = service_for(target, drafter, tok)
    handle, _ = listen(service, "127.0.0.1:0", LaunchPlan(frontends=2))
    try:
        host = handle.host
        spawn = host._spawn

        def spawn_stopped():
            proc = spawn()
            os.kill(proc.pid, signal.SIGSTOP)  # long before it can have connected: it must start Python first
            return proc

        monkeypatch.setattr(host, "_spawn", spawn_stopped)
        first = set(handle.pids())
        victim = min(first)
        os.kill(victim, signal.SIGKILL)
        new = until(lambda: set(handle.pids()) - first, "a front end started again")
        stopper = threading.Thread(target=handle.stop, args=(None,))
        try:
            stopper.start()
            until(lambda: host.stopping, "stop begun")
        finally:
            for pid in new:
                os.kill(pid, signal.SIGCONT)
            stopper.join(timeout=BOUND_S)
        assert not stopper.is_alive()
        assert {p.pid: p.returncode for p in host.procs} == {pid: 0 for pid in (first - {victim}) | new}
    finally:
        try:
            handle.stop(None)  # a no-op once stopped; otherwise what a failure left running goes
        finally:
            service.engine.close()


# ---- the frames --------------------------------------------------------------------------------------------------


def test_framer_yields_the_same_frames_however_the_bytes_arrive():
    frames = [(0, wire.Kind.CONFIG, b'{"a":1}'), (7, wire.Kind.REQUEST, bytes(range(256)) * 3),
              (7, wire.Kind.HALF_CLOSE, b""), (2**32 - 1, wire.Kind.CREDIT, wire.credit(8))]  # fmt: skip
    stream = b"".join(wire.HEADER.pack(c, k, len(p)) + p for c, k, p in frames)
    whole = list(wire.Framer().feed(stream))
    framer = wire.Framer()
    bytewise = [f for i in range(len(stream)) for f in framer.feed(stream[i : i + 1])]
    assert whole == bytewise == frames
    assert not framer.buf  # nothing left over


def test_framer_refuses_oversize_frames_and_unknown_kinds():
    framer = wire.Framer(max_frame=10)
    assert list(framer.feed(wire.HEADER.pack(1, wire.Kind.REPLY, 10) + bytes(10))) == [(1, wire.Kind.REPLY, bytes(10))]
    with pytest.raises(wire.FrameError):
        list(framer.feed(wire.HEADER.pack(1, wire.Kind.REPLY, 11)))  # refused on the header, before the body
    with pytest.raises(wire.FrameError):
        list(wire.Framer().feed(struct.pack("<IBI", 0, 99, 0)))
    with pytest.raises(wire.FrameError):
        wire.read_credit(b"\x01\x00")
    for bad in (b"\xff", b"[1]", b"{"):
        with pytest.raises(wire.FrameError):
            wire.load(bad)


def test_metadata_round_trips_binary_and_text_values():
    metadata = (("grpc-status-details-bin", bytes(range(256))), ("retry-note", "soon"))
    rows = wire.dump_metadata(metadata)
    assert json.loads(json.dumps(rows)) == rows  # JSON-clean: bytes went as base64
    assert wire.load_metadata(rows) == metadata
    assert wire.dump_metadata(None) == []


def test_credit_is_a_window_taken_one_by_one_and_given_back_in_halves():
    consumed = wire.Consumed()
    given = [consumed.one() for _ in range(2 * wire.WINDOW)]
    half = wire.WINDOW // 2
    assert given == ([0] * (half - 1) + [half]) * 4

    async def window() -> tuple[int, bool, bool]:
        c = wire.Credit()
        taken = 0
        while c.n > 0:
            await c.take()
            taken += 1
        blocked = asyncio.ensure_future(c.take())
        await asyncio.sleep(0)
        waiting = not blocked.done()
        c.add(half)
        await asyncio.wait_for(blocked, BOUND_S)
        return taken, waiting, c.n == half - 1

    assert asyncio.run(window()) == (wire.WINDOW, True, True)


def test_outbox_writes_a_loops_frames_in_one_write():
    class Transport:
        def __init__(self):
            self.writes, self.closing = [], False

        def write(self, data: bytes) -> None:
            self.writes.append(data)

        def is_closing(self) -> bool:
            return self.closing

    async def run() -> list[bytes]:
        t = Transport()
        outbox = wire.Outbox(t, asyncio.get_running_loop())
        outbox.send(3, wire.Kind.REPLY, b"x")
        outbox.send(3, wire.Kind.END)
        outbox.send(4, wire.Kind.CREDIT, wire.credit(8))
        assert t.writes == []  # nothing until the loop's iteration ends
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        t.closing = True
        outbox.send(5, wire.Kind.END)  # a closing transport is written no more
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        return t.writes

    writes = asyncio.run(run())
    assert len(writes) == 1
    assert list(wire.Framer().feed(writes[0])) == [(3, wire.Kind.REPLY, b"x"), (3, wire.Kind.END, b""),
                                                   (4, wire.Kind.CREDIT, wire.credit(8))]  # fmt: skip


def test_a_verdict_frame_becomes_the_reply_the_engine_would_have_made_for_every_codec():
    """verdict_message(verdict_frame(...)) is the ServerMessage built around the engine's own encoder's bytes, for
    strided rows of a step's delta block (as the batcher slices them) and a tree's path; a frame that is not one is
    a FrameError, not a reply."""
    rng = np.random.default_rng(5)

    def bf16_bits(*shape):
        return (rng.standard_normal(shape, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)

    block = {"lsa": bf16_bits(12, 40), "tli_k": bf16_bits(2, 12, 3, 8)}  # [rows * T, dim], [N, rows * T, Hkv, D]
    delta = ArrayDelta(start=17, tokens=[5, 9, 2], tensors={"lsa": block["lsa"][4:7], "tli_k": block["tli_k"][:, 4:7]})
    for codec in (Codec.RAW, Codec.FP16_SHUFFLE_ZSTD, Codec.INT8_ZSTD):
        for path in ((), (1, 3)):
            frame = wire.verdict_frame(4, 2, 11, path, delta, codec)
            message, n = wire.verdict_message(frame.payload)
            payload = encode_bf16_bundle(delta.tensors, codec)
            kv = pb.KVDelta(start=17, tokens=[5, 9, 2], payload=payload)
            expected = pb.ServerMessage(verdict=pb.Verdict(round=4, accepted=2, bonus=11, delta=kv, path=path))
            assert message == expected.SerializeToString() and n == len(payload)
    good = wire.verdict_frame(4, 2, 11, (), delta, Codec.FP16_SHUFFLE_ZSTD).payload
    head = wire.VERDICT_HEAD.size + 4 * 3
    encoded = encode_bf16_bundle(delta.tensors, Codec.FP16_SHUFFLE_ZSTD)
    bad = [
        good[:5],  # truncated head
        good[: head + 3],  # truncated bundle
        good[:-1],  # one byte short
        good[:16] + b"\x63" + good[17:],  # codec 99
        good[:head] + encoded,  # a delta already encoded: not the frame's form
    ]
    for payload in bad:
        with pytest.raises(wire.FrameError):
            wire.verdict_message(payload)
    with pytest.raises(wire.FrameError):  # a delta over the bound
        wire.verdict_message(good, max_nbytes=100)


def test_a_verdict_frames_layout_is_checked_before_its_bits_are_read():
    """The delta's layout (names and shapes) is the front end's only guide to the bits after it: a layout that
    names a tensor twice, declares no tensors, or more or fewer bits than the frame holds is a FrameError; the
    engine refuses to frame anything but bfloat16 bits."""
    delta = ArrayDelta(start=3, tokens=[1, 2], tensors={"lsa": np.arange(16, dtype=np.uint16).reshape(2, 8)})
    good = wire.verdict_frame(1, 1, 4, (), delta, Codec.RAW).payload
    at = wire.VERDICT_HEAD.size + 4 * 2  # the layout: count u8, then (name length u8, ndim u8, name, dims u32)
    entry = struct.pack("<BB", 3, 2) + b"lsa" + struct.pack("<2I", 2, 8)
    bits = good[at + 1 + len(entry) :]
    assert good[at:] == b"\x01" + entry + bits and len(bits) == 32
    for layout, tail in [
        (b"\x02" + entry + entry, bits + bits),  # one name twice
        (b"\x00", b""),  # no tensors
        (b"\x01" + entry, bits + b"\x00\x00"),  # more bits than declared
        (b"\x01" + struct.pack("<BB", 3, 2) + b"lsa" + struct.pack("<2I", 2, 1 << 30), bits),  # a huge shape
    ]:
        with pytest.raises(wire.FrameError):
            wire.verdict_message(good[:at] + layout + tail)
    as_float = ArrayDelta(start=3, tokens=[1, 2], tensors={"lsa": np.zeros((2, 8), np.float32)})
    with pytest.raises(struct.error):
        wire.verdict_frame(1, 1, 4, (), as_float, Codec.RAW)


def test_a_front_end_encodes_verdicts_reports_their_bytes_once_a_loop_iteration_and_fails_a_bad_one_alone():
    """The front end's side of VERDICT, in process: two verdicts in one event-loop iteration cost the engine one
    DELTA_BYTES frame with their sum; a frame that does not parse ends that call INTERNAL."""
    from tether.server import frontend

    class Transport:
        def __init__(self):
            self.writes = []

        def write(self, data: bytes) -> None:
            self.writes.append(data)

        def is_closing(self) -> bool:
            return False

    class Aborted(Exception):
        pass

    class Context:
        async def abort(self, code, details="", metadata=()):
            raise Aborted(code)

    delta = ArrayDelta(start=3, tokens=[1, 2], tensors={"lsa": np.arange(16, dtype=np.uint16).reshape(2, 8)})
    frame = wire.verdict_frame(1, 1, 4, (), delta, Codec.FP16_SHUFFLE_ZSTD).payload
    expected = wire.verdict_message(frame)

    async def run():
        link = frontend.EngineLink(asyncio.get_running_loop())
        transport = Transport()
        link.connection_made(transport)
        call = link.open("Session", "")
        for payload in (frame, frame, b"not a verdict"):
            call.on_frame(wire.Kind.VERDICT, payload)
        replies = [await call.next(Context()), await call.next(Context())]
        with pytest.raises(Aborted) as e:
            await call.next(Context())
        for _ in range(3):
            await asyncio.sleep(0)
        return replies, e.value.args[0], call.id, list(wire.Framer().feed(b"".join(transport.writes)))

    replies, code, call_id, frames = asyncio.run(run())
    assert replies == [expected[0]] * 2 and code == grpc.StatusCode.INTERNAL
    assert [(c, k) for c, k, _ in frames] == [(call_id, wire.Kind.CALL), (0, wire.Kind.DELTA_BYTES)]
    assert wire.read_count(frames[1][2]) == 2 * expected[1]
