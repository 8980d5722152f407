"""A real server behind a tampering relay: one round's verdict or KV delta is corrupted on its way to the client.

The client refuses the message (Stats.bad_messages), loses that round as if the link had dropped, drafts alone,
resyncs, and under rewind still finishes with exactly the target's greedy text. Corruptions: a zstd bomb under
an unknown name (it once took the client to gigabytes and a KeyError: 'lsa'), tensors renamed, a shape one
position too long, a start off by one, a token the client never sent, a bonus token outside the vocabulary. A
corrupted prompt delta ends the command line client in one line with status 2 instead.
"""

import struct
from concurrent import futures

import grpc
import pytest
import torch
import zstandard
from edge_text import run_text
from toy_models import toy_model_dir

from tether.client.cli import main
from tether.client.session import ClientConfig, EdgeSession
from tether.server.engine_core import Engine
from tether.server.model_loading import load
from tether.server.rpc_server import make_server
from tether.server.serve_config import ServiceConfig
from tether.server.service import TetherService
from tether.shared.checkpoint import fingerprint
from tether.shared.codecs import Codec, EncodedTensor, decode_many, encode_many
from tether.shared.drafter_loading import load_drafter
from tether.v1 import tether_pb2 as pb
from tether.v1 import tether_pb2_grpc

PROMPT = "def read_config(path):\n    with open(path"
N_NEW = 40
CORRUPT_ROUND = 3
MAX_OFFLINE = 8  # offline tokens per outage: a resync always follows before the text is done


@pytest.fixture(scope="module")
def upstream():
    target, tok = load(toy_model_dir(), "cpu")
    drafter = load_drafter(toy_model_dir("drafter"), target)
    plain = list(target.generate(torch.tensor([tok.encode(PROMPT)]), N_NEW))
    service = TetherService(
        Engine(target, drafter, tok, ServiceConfig(), model_fingerprint=fingerprint(toy_model_dir()))
    )
    server, port = make_server(service, "127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}", plain, target.cfg.vocab_size
    server.stop(None)


class Relay(tether_pb2_grpc.TetherServicer):
    """Forwards every call to the real server; `tamper` may rewrite the Session stream's messages, `tamper_resync`
    the Resync replies."""

    def __init__(self, address: str, tamper, tamper_resync=None):
        self.channel = grpc.insecure_channel(address)
        self.stub = tether_pb2_grpc.TetherStub(self.channel)
        self.tamper = tamper
        self.tamper_resync = tamper_resync or (lambda reply: reply)

    def _unary(self, method, request, context):
        try:
            return method(request, metadata=context.invocation_metadata(), timeout=30)
        except grpc.RpcError as e:
            context.set_trailing_metadata(e.trailing_metadata() or ())
            context.abort(e.code(), e.details())

    def GetModelInfo(self, request, context):
        return self._unary(self.stub.GetModelInfo, request, context)

    def Resync(self, request, context):
        return self.tamper_resync(self._unary(self.stub.Resync, request, context))

    def Close(self, request, context):
        return self._unary(self.stub.Close, request, context)

    def FetchWeights(self, request, context):
        yield from self.stub.FetchWeights(request, metadata=context.invocation_metadata(), timeout=30)

    def Session(self, request_iterator, context):
        call = self.stub.Session(request_iterator, metadata=context.invocation_metadata())
        context.add_callback(call.cancel)
        try:
            for message in call:
                yield self.tamper(message)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.CANCELLED:
                context.abort(e.code(), e.details())


@pytest.fixture
def relay(upstream):
    servers = []

    def start(tamper, tamper_resync=None) -> str:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
        tether_pb2_grpc.add_TetherServicer_to_server(Relay(upstream[0], tamper, tamper_resync), server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        return f"127.0.0.1:{port}"

    yield start
    for server in servers:
        server.stop(None)


def bomb_bundle() -> bytes:
    """About 8 KB of zstd declared as a 256 MiB tensor named "x" (a 2 GiB one would hurt the old client more)."""
    c = zstandard.ZstdCompressor(level=3, write_content_size=False).compressobj()
    payload = b"".join([c.compress(bytes(1 << 20)) for _ in range(256)] + [c.flush()])
    frame = EncodedTensor(Codec.FP16_SHUFFLE_ZSTD, "float16", (1 << 27,), payload).to_bytes()
    return struct.pack("<4sBI", b"TTBN", 1, 1) + struct.pack("<H", 1) + b"x" + struct.pack("<I", len(frame)) + frame


def reencoded(delta: pb.KVDelta, edit) -> bytes:
    return encode_many(edit(decode_many(delta.payload)), Codec.RAW)


def corruptions(vocab: int) -> dict:
    """name -> edit of one Verdict in place."""

    def payload(make):
        def edit(v: pb.Verdict) -> None:
            v.delta.payload = make(v.delta)

        return edit

    def renamed(ts):
        return {"hidden" if k == "lsa" else k: t for k, t in ts.items()}

    def one_more_position(ts):
        return ts | {"lsa": torch.cat([ts["lsa"], ts["lsa"][-1:]])}

    def set_start(v):
        v.delta.start += 1

    def set_token(v):
        v.delta.tokens[-1] = (v.delta.tokens[-1] + 1) % vocab

    def set_bonus(v):
        v.bonus = vocab + 7

    return {
        "bomb": payload(lambda d: bomb_bundle()),
        "renamed": payload(lambda d: reencoded(d, renamed)),
        "shape": payload(lambda d: reencoded(d, one_more_position)),
        "start": set_start,
        "token": set_token,
        "bonus": set_bonus,
    }


def one_round(edit):
    """Apply `edit` to the CORRUPT_ROUND-th verdict of the first stream only."""
    seen = {"verdicts": 0}

    def tamper(message: pb.ServerMessage) -> pb.ServerMessage:
        if message.WhichOneof("body") == "verdict":
            seen["verdicts"] += 1
            if seen["verdicts"] == CORRUPT_ROUND:
                message = pb.ServerMessage.FromString(message.SerializeToString())
                edit(message.verdict)
        return message

    return tamper


def run(address: str, tmp_path, policy: str = "rewind"):
    # Alone, the drafter can write the rest of the text before the backoff lets it reconnect (onnxruntime drafts
    # these in about a millisecond a token), and under keep a generation that ends offline never resyncs: it holds
    # the text after MAX_OFFLINE tokens instead, until a resync succeeds.
    cfg = ClientConfig(server=address, max_new_tokens=N_NEW, policy=policy, cache_dir=str(tmp_path / "cache"),
                       round_timeout_s=30, connect_timeout_s=30, backoff_initial_s=0.05, backoff_max_s=0.2,
                       mode="hybrid", max_offline_tokens=MAX_OFFLINE)  # fmt: skip
    session = EdgeSession(cfg)
    try:
        return run_text(session, PROMPT)
    finally:
        session.close()


@pytest.mark.parametrize("case", ["bomb", "renamed", "shape", "start", "token", "bonus"])
def test_one_corrupted_round_is_lost_and_rewind_still_equals_plain_greedy(upstream, relay, tmp_path, case):
    _, plain, vocab = upstream
    result = run(relay(one_round(corruptions(vocab)[case])), tmp_path)
    assert result.stats.bad_messages == 1
    assert result.stats.resyncs >= 1 and result.stats.outages == 1
    assert result.token_ids == plain


def resync_lies(vocab: int) -> dict:
    """Resync replies the client must refuse: a delta that is a bomb, or claims the client can check."""

    def bomb(r):
        r.delta.payload = bomb_bundle()

    def next_token(r):
        r.target_token = vocab + 3

    def positions(r):
        r.verified_length += 2

    def session_id(r):
        r.session_id = "../" + r.session_id[3:]

    def dropped(r):  # keep never retracts: a reply absorbing less than the piece is a lie under keep
        del r.delta.tokens[-1:]

    return {"bomb": bomb, "next_token": next_token, "positions": positions, "session_id": session_id,
            "dropped": dropped}  # fmt: skip


@pytest.mark.parametrize("case", ["bomb", "next_token", "positions", "session_id", "dropped"])
def test_a_resync_reply_that_lies_is_lost_too(upstream, relay, tmp_path, case):
    """The round's loss makes the client resync; the first Resync reply then lies. That resync is lost as well (the
    client keeps drafting alone), and the next one brings it back."""
    _, plain, vocab = upstream
    replies = []

    def tamper_resync(reply: pb.ResyncReply) -> pb.ResyncReply:
        replies.append(reply)
        if len(replies) == 1:
            reply = pb.ResyncReply.FromString(reply.SerializeToString())
            resync_lies(vocab)[case](reply)
        return reply

    policy = "keep" if case == "dropped" else "rewind"
    result = run(relay(one_round(corruptions(vocab)["bomb"]), tamper_resync), tmp_path, policy)
    assert len(replies) >= 2 and result.stats.bad_messages == 2
    assert result.stats.retracted == 0 or policy == "rewind"
    if policy == "rewind":
        assert result.token_ids == plain
    else:
        assert len(result.token_ids) == N_NEW


def test_a_corrupted_prompt_delta_ends_the_cli_in_one_line(upstream, relay, tmp_path, capsys):
    def tamper(message: pb.ServerMessage) -> pb.ServerMessage:
        if message.WhichOneof("body") == "opened":
            message = pb.ServerMessage.FromString(message.SerializeToString())
            message.opened.delta.payload = bomb_bundle()
        return message

    address = relay(tamper)
    args = ["generate", "--server", address, "--prompt", PROMPT, "--json", "--cache-dir", str(tmp_path / "cache")]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and "the server sent an invalid KV delta:" in err, err
