"""The gRPC service on loopback, driven by a test client that speaks the protocol directly."""

import gc
import queue
import weakref

import grpc
import pytest
import torch
from tiny_models import tiny_moa_drafter, tiny_target
from toy_models import toy_model_flags

from tether.client.refusals import Refusal
from tether.client.weight_cache import WeightCache
from tether.server.decode_pace import DecodePace
from tether.server.engine_core import Engine
from tether.server.rpc_server import make_server
from tether.server.serve_config import ServiceConfig
from tether.server.service import TetherService
from tether.shared.codecs import decode_many
from tether.shared.drafter import DraftDelta
from tether.shared.tokenizer import Tokenizer
from tether.shared.weights import TensorEntry, tensor_bytes
from tether.v1 import tether_pb2 as pb
from tether.v1 import tether_pb2_grpc

FP = "f" * 64
VOCAB = 7  # small, so random drafts are often right and acceptance paths run


@pytest.fixture(scope="module")
def served():
    target = tiny_target(vocab_size=VOCAB)
    drafter = tiny_moa_drafter(target)
    tok = Tokenizer.train(texts=["def f(x):\n    return x\n"] * 20, vocab_size=260)
    service = TetherService(Engine(target, drafter, tok, ServiceConfig(max_prompt_tokens=64, max_sessions=8),
                            model_fingerprint=FP))  # fmt: skip
    server, port = make_server(service, "127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield target, drafter, service, tether_pb2_grpc.TetherStub(channel)
    channel.close()
    server.stop(grace=None)


def to_delta(kv: pb.KVDelta) -> DraftDelta:
    return DraftDelta(start=kv.start, tokens=list(kv.tokens), tensors=decode_many(kv.payload))


def plain(target, prompt, n):
    return list(target.generate(torch.tensor([prompt]), n))


class Client:
    """A minimal protocol client: one Session stream, driven message by message."""

    def __init__(self, stub, metadata=None):
        self.outbox: queue.Queue = queue.Queue()
        self.replies = stub.Session(iter(self.outbox.get, None), metadata=metadata)

    def send(self, msg) -> pb.ServerMessage:
        self.outbox.put(msg)
        return next(self.replies)

    def close(self):
        self.outbox.put(None)


def open_msg(prompt, **kw):
    kw.setdefault("model_fingerprint", FP)
    return pb.ClientMessage(open=pb.OpenSession(prompt=prompt, max_new_tokens=64, **kw))


def run_session(stub, drafter, prompt, n, k=4, repeat_every=0, metadata=None, sampling=None):
    client = Client(stub, metadata)
    opened = client.send(open_msg(prompt, sampling=sampling)).opened
    drafter.begin(to_delta(opened.delta))
    out, root, rnd = [opened.first_token], opened.first_token, 0
    while len(out) < n:
        drafts, _, _ = drafter.draft(root, k)
        rnd += 1
        msg = pb.ClientMessage(round=pb.DraftRound(round=rnd, root=root, tokens=drafts))
        reply = client.send(msg)
        if repeat_every and rnd % repeat_every == 0:
            again = client.send(msg)  # the same round again, as after a reconnect
            assert again.SerializeToString() == reply.SerializeToString()
        v = reply.verdict
        drafter.commit(to_delta(v.delta))
        out += drafts[: v.accepted] + [v.bonus]
        root = v.bonus
    client.close()
    return out, opened.session_id, opened.resume_token, len(prompt) + len(out) - 1, root


def test_a_service_dropped_without_close_is_freed_and_ends_its_threads():
    """Its batcher's threads must not keep it (and its KV pool) alive: an embedding program that forgets close()
    gets the memory back once it lets the service go."""
    target = tiny_target(vocab_size=VOCAB)
    tok = Tokenizer.train(texts=["def f(x):\n    return x\n"] * 20, vocab_size=260)
    service = TetherService(
        Engine(target, tiny_moa_drafter(target), tok, ServiceConfig(max_sessions=2), model_fingerprint=FP)
    )
    threads = (service.engine.batcher.worker,)
    assert all(t.is_alive() for t in threads)
    ref = weakref.ref(service)
    del service
    gc.collect()
    assert ref() is None
    for t in threads:
        t.join(timeout=30)  # they end on their own once told to; the timeout only bounds a failure
        assert not t.is_alive()


def test_model_info(served):
    _, drafter, service, stub = served
    info = stub.GetModelInfo(pb.GetModelInfoRequest())
    assert info.model_fingerprint == FP and info.tli_layers == 1 and info.protocol_version == 1
    assert len(info.drafter_fingerprint) == 64 and pb.CODEC_INT8_ZSTD in info.codecs
    assert info.HasField("eos_id") and info.eos_id == service.engine.tokenizer.eos_id


def test_session_rounds_equal_plain_greedy_and_repeats_are_idempotent(served):
    target, drafter, _, stub = served
    prompt = [1, 2, 3, 4, 5, 6, 0, 1]
    out, *_ = run_session(stub, drafter, prompt, 30, repeat_every=2)
    assert out == plain(target, prompt, len(out))


def test_weight_download_resumed_halfway_has_identical_sha256(served, tmp_path):
    _, _, service, stub = served
    stream = stub.FetchWeights(pb.FetchWeightsRequest(model_fingerprint=FP, max_chunk_bytes=2000))
    manifest = [TensorEntry(e.name, e.dtype, tuple(e.shape), e.nbytes, e.sha256) for e in next(stream).manifest.tensors]
    by_name = {e.name: e for e in manifest}
    cache = WeightCache(tmp_path)
    for i, msg in enumerate(stream):
        cache.write(by_name[msg.chunk.tensor], msg.chunk.offset, msg.chunk.data)
        if i == 10:
            stream.cancel()  # the link drops
            break
    name, offset = cache.resume_point(manifest)
    req = pb.FetchWeightsRequest(model_fingerprint=FP, resume_tensor=name, resume_offset=offset)
    for msg in list(stub.FetchWeights(req))[1:]:
        cache.write(by_name[msg.chunk.tensor], msg.chunk.offset, msg.chunk.data)
    assert cache.resume_point(manifest) is None
    loaded = cache.load(manifest)
    for e in manifest:
        assert tensor_bytes(loaded[e.name]) == tensor_bytes(service.engine.weights[e.name])


def test_bad_inputs_get_their_status_and_service_goes_on(served):
    target, drafter, _, stub = served
    with pytest.raises(grpc.RpcError) as e:
        stub.Close(pb.CloseRequest(session_id="nope"))  # not an id this server hands out: refused before use
    assert Refusal.of_rpc_error(e.value).reason == pb.REASON_INVALID_REQUEST
    with pytest.raises(grpc.RpcError) as e:
        stub.Close(pb.CloseRequest(session_id="0" * 32))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    assert Refusal.of_rpc_error(e.value).reason == pb.REASON_UNKNOWN_SESSION
    with pytest.raises(grpc.RpcError) as e:
        list(stub.FetchWeights(pb.FetchWeightsRequest(model_fingerprint="0" * 64)))
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert Refusal.of_rpc_error(e.value).reason == pb.REASON_MODEL_MISMATCH
    client = Client(stub)
    errors = [
        client.send(pb.ClientMessage(round=pb.DraftRound(round=1, root=0))).error,  # before open
        client.send(open_msg([1, 99])).error,  # token out of range
        client.send(open_msg([1] * 65)).error,  # oversize prompt
        client.send(open_msg([1, 2], model_fingerprint="0" * 64)).error,  # another model
        client.send(open_msg([1, 2], delta_codec=42)).error,  # a codec from a newer protocol
    ]
    S = grpc.StatusCode
    expected = (S.FAILED_PRECONDITION, S.INVALID_ARGUMENT, S.RESOURCE_EXHAUSTED, S.FAILED_PRECONDITION,
                S.INVALID_ARGUMENT)  # fmt: skip
    assert [e.code for e in errors] == [s.value[0] for s in expected]
    assert [e.reason for e in errors] == [pb.REASON_OUT_OF_ORDER, pb.REASON_INVALID_REQUEST, pb.REASON_TOO_LONG,
                                          pb.REASON_MODEL_MISMATCH, pb.REASON_INVALID_REQUEST]  # fmt: skip
    opened = client.send(open_msg([1, 2, 3])).opened  # the same stream still opens a good session
    bad_round = client.send(pb.ClientMessage(round=pb.DraftRound(round=2, root=opened.first_token)))
    assert bad_round.error.code == grpc.StatusCode.FAILED_PRECONDITION.value[0] and bad_round.error.round == 2
    wrong_root = client.send(pb.ClientMessage(round=pb.DraftRound(round=1, root=(opened.first_token + 1) % VOCAB)))
    assert wrong_root.error.reason == pb.REASON_OUT_OF_ORDER
    client.close()
    out, *_ = run_session(stub, drafter, [3, 2, 1], 12)
    assert out == plain(target, [3, 2, 1], len(out))


def test_overlapping_rounds_are_verified_when_their_guess_held_and_refused_as_stale_otherwise(served):
    """A round sent before the verdict of the one before it (after_length) is verified where the session then
    stands as it assumed; otherwise it is refused with REASON_STALE_ROUND, nothing changes and the stream goes on."""
    target, _, service, stub = served
    assert stub.GetModelInfo(pb.GetModelInfoRequest()).overlapping_rounds
    prompt = [1, 2, 3, 4, 5, 6, 0, 1]
    g = plain(target, prompt, 10)
    n = len(prompt)
    client = Client(stub)
    opened = client.send(open_msg(prompt)).opened
    assert opened.first_token == g[0]

    def draft_round(number, root, tokens, after=0):
        return pb.ClientMessage(round=pb.DraftRound(round=number, root=root, tokens=tokens, after_length=after))

    # Round 2 goes out before round 1's verdict, on the guess that round 1 is accepted whole with bonus g[3].
    client.outbox.put(draft_round(1, g[0], g[1:3]))
    overlapped = draft_round(2, g[3], g[4:6], after=n + 3)
    client.outbox.put(overlapped)
    v1, v2 = next(client.replies).verdict, next(client.replies).verdict
    assert (v1.round, v1.accepted, v1.bonus) == (1, 2, g[3])
    assert v1.delta.start + len(v1.delta.tokens) == n + 3  # the length the client counts is the server's
    assert (v2.round, v2.accepted, v2.bonus, v2.delta.start) == (2, 2, g[6], n + 3)
    assert client.send(overlapped).verdict == v2  # sent again: the same answer, no second run
    # Guesses that did not hold: another root, another length. Refused, typed, and nothing moves.
    for wrong in (draft_round(3, (g[6] + 1) % VOCAB, g[7:8], after=n + 6), draft_round(3, g[6], g[7:8], after=n + 5)):
        e = client.send(wrong).error
        assert (e.reason, e.round, e.code) == (pb.REASON_STALE_ROUND, 3, grpc.StatusCode.FAILED_PRECONDITION.value[0])
    assert service.engine.metrics.registry.get_sample_value("tether_stale_rounds_total") >= 2
    v3 = client.send(draft_round(3, g[6], g[7:9])).verdict
    assert (v3.round, v3.accepted, v3.bonus, v3.delta.start) == (3, 2, g[9], n + 6)
    client.close()


@pytest.mark.parametrize("rewind", [False, True])
@pytest.mark.parametrize("lost", [False, True])
def test_resync_after_a_cut(served, rewind, lost):
    """The client drafts alone during a cut, then resyncs: keep absorbs its tokens, rewind truncates them at
    the first disagreement so the text equals plain greedy decoding; a lost session is rebuilt from history."""
    target, drafter, service, stub = served
    prompt = [4, 4, 1, 2, 5]
    out, sid, token, verified, root = run_session(stub, drafter, prompt, 10)
    offline = [root] + drafter.draft(root, 6)[0]  # generated while offline, root first
    history = (prompt + out)[:verified]
    if lost:
        stub.Close(pb.CloseRequest(session_id=sid))
    req = pb.ResyncRequest(session_id=sid, resume_token=token, verified_length=verified, offline_tokens=offline,
                           history=history if lost else [], model_fingerprint=FP, rewind=rewind)  # fmt: skip
    reply = stub.Resync(req)
    assert reply.rebuilt == lost
    assert (reply.session_id != sid) == lost  # a rebuilt session gets a new id from the server
    reference = plain(target, prompt, len(out) + len(offline) + 1)
    agreed = reference[len(out) - 1 :]  # the root onwards, as the target alone continues
    d = reply.first_disagreement
    assert offline[:d] == agreed[:d] and (d == len(offline) or offline[d] != agreed[d])
    kept = offline[:d] if rewind else offline
    assert reply.verified_length == verified + len(kept) and list(reply.delta.tokens) == kept
    if rewind:
        assert reply.target_token == agreed[d]  # continuing from here reproduces plain decoding
    else:
        full = torch.tensor([history + kept])
        assert reply.target_token == int(target(full)[0, -1].argmax())
    with pytest.raises(grpc.RpcError) as e:
        stub.Resync(pb.ResyncRequest(session_id=reply.session_id, resume_token="0" * 32, verified_length=verified,
                                     offline_tokens=offline, model_fingerprint=FP))  # fmt: skip
    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED


def test_a_resync_reply_over_the_message_limit_is_refused_and_a_smaller_piece_works(served):
    """The delta of many offline tokens could exceed the gRPC message limit: the server says RESOURCE_EXHAUSTED
    with what to do, and the same resync in a smaller piece (from the same verified length) succeeds."""
    import dataclasses

    _, drafter, service, stub = served
    out, sid, token, verified, root = run_session(stub, drafter, [4, 4, 1, 2, 5], 10)
    offline = [root] + drafter.draft(root, 6)[0]
    req = pb.ResyncRequest(session_id=sid, resume_token=token, verified_length=verified, offline_tokens=offline,
                           model_fingerprint=FP)  # fmt: skip
    size = stub.Resync(req).ByteSize()
    one = stub.Resync(pb.ResyncRequest(session_id=sid, resume_token=token, verified_length=verified,
                                       offline_tokens=offline[:1], model_fingerprint=FP)).ByteSize()  # fmt: skip
    config = service.config
    service.engine.config = dataclasses.replace(config, max_message_bytes=1024 + (size + one) // 2)
    try:
        with pytest.raises(grpc.RpcError) as e:
            stub.Resync(req)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert Refusal.of_rpc_error(e.value).reason == pb.REASON_REPLY_TOO_LARGE
        reply = stub.Resync(pb.ResyncRequest(session_id=sid, resume_token=token, verified_length=verified,
                                             offline_tokens=offline[:1], model_fingerprint=FP))  # fmt: skip
        assert reply.verified_length == verified + 1
    finally:
        service.engine.config = config


def test_serve_command_answers_then_stops_on_sigterm():
    import signal
    import subprocess
    import sys
    from pathlib import Path

    exe = Path(sys.executable).parent / "tether-server"
    cmd = [str(exe), "serve", *toy_model_flags(), "--port", "0", "--device", "cpu"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline().strip()
        assert line.startswith("listening on 127.0.0.1:"), line
        with grpc.insecure_channel(line.removeprefix("listening on ")) as channel:
            info = tether_pb2_grpc.TetherStub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=120)
        assert info.tli_layers == 3 and len(info.model_fingerprint) == 64
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0
        assert "stopped" in proc.stdout.read()
    finally:
        proc.kill()


def test_api_keys_authenticate_and_bind_sessions(served):
    target, drafter, service, _ = served
    keyed = TetherService(Engine(target, drafter, service.engine.tokenizer,
                          ServiceConfig(api_keys=frozenset({"key-a", "key-b"}), max_sessions_per_key=1),
                          model_fingerprint=FP))  # fmt: skip
    server, port = make_server(keyed, "127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = tether_pb2_grpc.TetherStub(channel)
            a, b = [("authorization", "Bearer key-a")], [("authorization", "Bearer key-b")]
            for meta in (None, [("authorization", "Bearer wrong")]):
                with pytest.raises(grpc.RpcError) as e:
                    stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=meta)
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=a).model_fingerprint == FP
            outbox: queue.Queue = queue.Queue()
            replies = stub.Session(iter(outbox.get, None), metadata=a)
            outbox.put(open_msg([1, 2, 3]))
            opened = next(replies).opened
            outbox.put(None)
            second: queue.Queue = queue.Queue()
            other = stub.Session(iter(second.get, None), metadata=a)
            second.put(open_msg([1, 2]))
            refused = next(other).error  # one session per key
            assert refused.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0] and refused.reason == pb.REASON_KEY_QUOTA
            assert refused.retry_after_ms > 0
            second.put(None)
            with pytest.raises(grpc.RpcError) as e:
                stub.Close(pb.CloseRequest(session_id=opened.session_id), metadata=b)
            assert e.value.code() == grpc.StatusCode.NOT_FOUND  # another key's session does not exist for b
            resync = pb.ResyncRequest(session_id=opened.session_id, resume_token=opened.resume_token,
                                      verified_length=3, offline_tokens=[opened.first_token])  # fmt: skip
            with pytest.raises(grpc.RpcError) as e:
                stub.Resync(resync, metadata=b)  # the same answer as for a session nobody holds
            assert Refusal.of_rpc_error(e.value).reason == pb.REASON_HISTORY_REQUIRED
            assert stub.Resync(resync, metadata=a).verified_length == 4
            stub.Close(pb.CloseRequest(session_id=opened.session_id), metadata=a)
    finally:
        server.stop(grace=None)


def test_metrics_count_rounds_tokens_bytes_and_errors(served):
    from prometheus_client import generate_latest

    target, drafter, service, stub = served
    before = service.engine.metrics.registry.get_sample_value("tether_rounds_total")
    run_session(stub, drafter, [2, 2, 2], 10)
    text = generate_latest(service.engine.metrics.registry).decode()
    assert service.engine.metrics.registry.get_sample_value("tether_rounds_total") > before
    for name in ("tether_accepted_tokens_total", "tether_tau_bucket", 'tether_bytes_out_total{kind="kv_delta"}',
                 "tether_verify_seconds_count", "tether_sessions "):  # fmt: skip
        assert name in text, name


def _openssl(*args, cwd):
    import shutil
    import subprocess

    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_pki(d):
    """A CA, a server certificate for localhost/127.0.0.1 and a client certificate, all signed by the CA."""
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
             "-subj", "/CN=tether-test-ca", cwd=d)  # fmt: skip
    (d / "san.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    for name in ("server", "client"):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                 "-subj", f"/CN={name}", cwd=d)  # fmt: skip
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{name}.pem", "-days", "2", "-extfile", "san.ext", cwd=d)  # fmt: skip


@pytest.mark.parametrize("mutual", [False, True])
def test_tls_and_mutual_tls(served, tmp_path, mutual):
    from tether.server.rpc_server import TLSFiles

    _, _, service, _ = served
    make_pki(tmp_path)
    tls = TLSFiles(str(tmp_path / "server.pem"), str(tmp_path / "server.key"),
                   str(tmp_path / "ca.pem") if mutual else "")  # fmt: skip
    server, port = make_server(service, "127.0.0.1:0", tls=tls)
    server.start()
    ca = (tmp_path / "ca.pem").read_bytes()
    client_pair = {"private_key": (tmp_path / "client.key").read_bytes(),
                   "certificate_chain": (tmp_path / "client.pem").read_bytes()}  # fmt: skip
    try:
        creds = grpc.ssl_channel_credentials(root_certificates=ca, **(client_pair if mutual else {}))
        with grpc.secure_channel(f"localhost:{port}", creds) as channel:
            info = tether_pb2_grpc.TetherStub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
            assert info.model_fingerprint == FP
        refused = grpc.ssl_channel_credentials(root_certificates=ca) if mutual else None
        with (grpc.secure_channel(f"localhost:{port}", refused) if mutual
              else grpc.insecure_channel(f"127.0.0.1:{port}")) as channel:  # fmt: skip
            with pytest.raises(grpc.RpcError) as e:
                tether_pb2_grpc.TetherStub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=5)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE  # no certificate / no TLS: no connection
    finally:
        server.stop(grace=None)


def test_health_and_reflection(served):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    _, _, service, _ = served
    server, port = make_server(service, "127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            status = health.Check(health_pb2.HealthCheckRequest(service="tether.v1.Tether")).status
            assert status == health_pb2.HealthCheckResponse.SERVING
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            req = reflection_pb2.ServerReflectionRequest(list_services="")
            listed = next(stub.ServerReflectionInfo(iter([req]))).list_services_response.service
            assert "tether.v1.Tether" in {s.name for s in listed}
    finally:
        server.stop(grace=None)


def test_least_recently_used_session_is_evicted_then_rebuilt_by_resync(served):
    target, drafter, service, _ = served
    small = TetherService(
        Engine(target, drafter, service.engine.tokenizer, ServiceConfig(max_sessions=2), model_fingerprint=FP)
    )
    server, port = make_server(small, "127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = tether_pb2_grpc.TetherStub(channel)
            first = Client(stub)
            opened = first.send(open_msg([1, 2, 3])).opened
            for prompt in ([2, 3], [3, 4]):  # two more sessions: the first one, least recently used, goes
                other = Client(stub)
                other.send(open_msg(prompt))
                other.close()
            lost = first.send(pb.ClientMessage(round=pb.DraftRound(round=1, root=opened.first_token)))
            assert lost.error.code == grpc.StatusCode.NOT_FOUND.value[0]
            first.close()
            req = pb.ResyncRequest(session_id=opened.session_id, resume_token=opened.resume_token, verified_length=3,
                                   offline_tokens=[opened.first_token], history=[1, 2, 3])  # fmt: skip
            reply = stub.Resync(req)
            assert reply.rebuilt and reply.verified_length == 4
            assert reply.target_token == plain(target, [1, 2, 3], 2)[1]
        assert small.engine.metrics.registry.get_sample_value("tether_evictions_total", {"reason": "sessions"}) >= 1
    finally:
        server.stop(grace=None)


def test_kv_memory_pressure_evicts_the_idle_session_and_resync_rebuilds_it_exactly(served):
    target, drafter, service, _ = served
    block = 4 * 2 * target.cfg.n_layers * target.cfg.n_kv_heads * target.cfg.head_dim * 4  # 4 rows, K+V, fp32
    config = ServiceConfig(kv_pool_bytes=8 * block, kv_block_size=4, max_prompt_tokens=64)
    small = TetherService(Engine(target, drafter, service.engine.tokenizer, config, model_fingerprint=FP))
    assert small.engine.pool.num_blocks == 8
    server, port = make_server(small, "127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = tether_pb2_grpc.TetherStub(channel)
            prompt = [1, 2, 3, 4, 5, 6, 0, 1, 2, 3]
            a = Client(stub)
            opened = a.send(open_msg(prompt)).opened  # 3 blocks
            drafter.begin(to_delta(opened.delta))
            out, root = [opened.first_token], opened.first_token
            drafts, _, _ = drafter.draft(root, 3)
            v = a.send(pb.ClientMessage(round=pb.DraftRound(round=1, root=root, tokens=drafts))).verdict
            drafter.commit(to_delta(v.delta))
            out += drafts[: v.accepted] + [v.bonus]
            for p in ([3, 4, 5, 6, 0, 1, 2, 3], [5] * 14):  # 2 + 4 blocks: the second one pushes `a` out
                other = Client(stub)
                assert other.send(open_msg(p)).WhichOneof("body") == "opened"
                other.close()
            assert small.engine.pool.used_blocks <= 8
            lost = a.send(pb.ClientMessage(round=pb.DraftRound(round=2, root=v.bonus)))
            assert lost.error.code == grpc.StatusCode.NOT_FOUND.value[0]
            a.close()
            history = prompt + out[:-1]
            req = pb.ResyncRequest(session_id=opened.session_id, resume_token=opened.resume_token,
                                   verified_length=len(history), offline_tokens=[out[-1]], history=history)  # fmt: skip
            reply = stub.Resync(req)
            assert reply.rebuilt and reply.verified_length == len(history) + 1
            assert out + [reply.target_token] == plain(target, prompt, len(out) + 1)
            # A prompt larger than the whole pool is refused with a clear status; the service goes on.
            huge = Client(stub)
            err = huge.send(open_msg([1] * 40)).error
            assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0] and err.reason == pb.REASON_TOO_LONG
            assert huge.send(open_msg([1, 2])).WhichOneof("body") == "opened"
            huge.close()
        get = small.engine.metrics.registry.get_sample_value
        assert get("tether_evictions_total", {"reason": "memory"}) >= 1
        assert get("tether_kv_blocks") == 8 and 0 < get("tether_kv_blocks_used") <= 8
    finally:
        server.stop(grace=None)


def test_a_new_stream_attaches_to_the_held_session_after_resync(served):
    target, drafter, _, stub = served
    prompt = [3, 1, 4, 1, 5]
    out, sid, token, verified, root = run_session(stub, drafter, prompt, 8)  # that stream is closed now
    reply = stub.Resync(pb.ResyncRequest(session_id=sid, resume_token=token, verified_length=verified,
                                         offline_tokens=[root], model_fingerprint=FP))  # fmt: skip
    drafter.commit(to_delta(reply.delta))
    client = Client(stub)
    wrong = client.send(pb.ClientMessage(attach=pb.AttachSession(session_id=sid, resume_token="0" * 32))).error
    assert wrong.code == grpc.StatusCode.PERMISSION_DENIED.value[0] and wrong.reason == pb.REASON_WRONG_RESUME_TOKEN
    other = Client(stub)
    lost = other.send(pb.ClientMessage(attach=pb.AttachSession(session_id="0" * 32, resume_token=token)))
    assert lost.error.code == grpc.StatusCode.NOT_FOUND.value[0]
    other.close()
    attached = client.send(pb.ClientMessage(attach=pb.AttachSession(session_id=sid, resume_token=token))).attached
    assert attached.verified_length == verified + 1 and attached.root == reply.target_token
    assert attached.last_round == 0  # numbering restarts after a resync
    out, root = out + [reply.target_token], reply.target_token
    for rnd in (1, 2, 3):
        drafts, _, _ = drafter.draft(root, 3)
        v = client.send(pb.ClientMessage(round=pb.DraftRound(round=rnd, root=root, tokens=drafts))).verdict
        drafter.commit(to_delta(v.delta))
        out += drafts[: v.accepted] + [v.bonus]
        root = v.bonus
    client.close()
    assert out == plain(target, prompt, len(out))


def test_server_only_generate_streams_plain_decoding(served):
    target, _, service, stub = served
    prompt = [2, 6, 1, 3]
    held = service.engine.pool.used_blocks
    req = pb.OpenSession(prompt=prompt, max_new_tokens=12, model_fingerprint=FP)
    tokens = [t for msg in stub.Generate(req) for t in msg.tokens]
    assert tokens == plain(target, prompt, 12)
    assert service.engine.pool.used_blocks == held  # its KV blocks went back when the stream ended
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(pb.OpenSession(prompt=[1, 99], model_fingerprint=FP)))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_generate_beside_other_streams_decodes_through_the_batcher(served):
    """With other Generate streams decoding, each token is a round of the batcher (batched with every other stream
    and Session round): the same tokens as plain decoding."""
    target, _, service, stub = served
    before = service.engine.metrics.batch_size.collect()[0].samples
    count = lambda samples: next(s.value for s in samples if s.name.endswith("_count"))  # noqa: E731
    service.engine.plain.generating += 1  # as if another stream were decoding
    try:
        req = pb.OpenSession(prompt=[5, 1, 4], max_new_tokens=9, model_fingerprint=FP)
        tokens = [t for msg in stub.Generate(req) for t in msg.tokens]
    finally:
        service.engine.plain.generating -= 1
    assert tokens == plain(target, [5, 1, 4], 9)
    assert (
        count(service.engine.metrics.batch_size.collect()[0].samples) - count(before) == 8
    )  # one round per token after the first


def test_model_info_tells_what_a_streams_token_takes_alone_and_beside_others(served):
    """decode_step_s is answered per call from the streams decoded: nothing before any; a lone stream's figure
    while none decodes, the batched one while one does."""
    _, _, service, stub = served
    plain_decoding = service.engine.plain
    plain_decoding.pace = DecodePace()  # this module's earlier streams forgotten
    info = lambda: stub.GetModelInfo(pb.GetModelInfoRequest())  # noqa: E731
    assert info().decode_step_s == 0.0
    generate = pb.OpenSession(prompt=[2, 6, 1, 3], max_new_tokens=12, model_fingerprint=FP)
    assert len([t for msg in stub.Generate(generate) for t in msg.tokens]) == 12
    alone = plain_decoding.pace.alone_s
    assert alone > 0 and info().decode_step_s == pytest.approx(alone)
    plain_decoding.generating += 1  # as if another stream were decoding
    try:
        assert len([t for msg in stub.Generate(generate) for t in msg.tokens]) == 12
        together = plain_decoding.pace.together_s
        assert together > 0 and info().decode_step_s == pytest.approx(together)
    finally:
        plain_decoding.generating -= 1
    assert info().decode_step_s == pytest.approx(alone)


def test_top_k_one_samples_the_argmax_in_sessions_and_generate(served):
    """Sampling with top_k 1 keeps only the argmax, so sampled verification and sampled Generate are greedy decoding
    whatever the temperature: top_k reaches the verifier's rule on both paths."""
    target, drafter, _, stub = served
    prompt = [1, 2, 3, 4, 5, 6]
    sampling = pb.SamplingParams(temperature=1.7, top_k=1, seed=5)
    out, *_ = run_session(stub, drafter, prompt, 20, sampling=sampling)
    assert out == plain(target, prompt, len(out))
    req = pb.OpenSession(prompt=prompt, max_new_tokens=12, model_fingerprint=FP, sampling=sampling)
    assert [t for msg in stub.Generate(req) for t in msg.tokens] == plain(target, prompt, 12)
    loose = pb.OpenSession(prompt=prompt, max_new_tokens=12, model_fingerprint=FP,
                           sampling=pb.SamplingParams(temperature=1.7, seed=5))  # fmt: skip
    assert [t for msg in stub.Generate(loose) for t in msg.tokens] != plain(target, prompt, 12)  # it does sample


def test_json_logs_carry_session_ids(served, capsys):
    import json
    import logging

    from tether.server.logs import configure_logging

    _, drafter, _, stub = served
    configure_logging("json")
    try:
        _, sid, *_ = run_session(stub, drafter, [1, 2, 3], 6)
        stub.Close(pb.CloseRequest(session_id=sid))
    finally:
        logging.getLogger("tether").handlers.clear()
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines() if line.startswith("{")]
    mine = [r for r in lines if r.get("session") == sid]
    assert [r["event"] for r in mine] == ["open", "close"]
    assert mine[0]["prompt_tokens"] == 3 and mine[1]["length"] >= 9 and mine[0]["level"] == "info"


def test_a_long_prompts_delta_arrives_in_parts_under_the_message_limit(served):
    target, drafter, service, _ = served
    small = TetherService(Engine(target, drafter, service.engine.tokenizer, ServiceConfig(max_message_bytes=8192),
                          model_fingerprint=FP))  # fmt: skip
    server, port = make_server(small, "127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            client = Client(tether_pb2_grpc.TetherStub(channel))
            prompt = [(i * 5 + 1) % VOCAB for i in range(50)]
            opened = client.send(open_msg(prompt)).opened
            assert opened.delta_parts >= 2
            parts = [opened.delta] + [next(client.replies).delta for _ in range(opened.delta_parts)]
            assert all(len(p.SerializeToString()) < 8192 for p in parts)
            assert [t for p in parts for t in p.tokens] == prompt
            drafter.begin(to_delta(parts[0]))
            for p in parts[1:]:
                drafter.commit(to_delta(p))
            out, root = [opened.first_token], opened.first_token
            for rnd in (1, 2, 3):
                drafts, _, _ = drafter.draft(root, 3)
                v = client.send(pb.ClientMessage(round=pb.DraftRound(round=rnd, root=root, tokens=drafts))).verdict
                drafter.commit(to_delta(v.delta))
                out += drafts[: v.accepted] + [v.bonus]
                root = v.bonus
            client.close()
        assert out == plain(target, prompt, len(out))
    finally:
        server.stop(None)
