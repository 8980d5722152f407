"""The delta codec is negotiated: the client offers the codecs it decodes (accept_codecs, its preference first), the
server sends the first of them it knows, an older client's delta_codec still works, and whatever the codec the
verified tokens are the target's own."""

import queue

import grpc
import pytest
import torch
from tiny_models import served_tiny_pair

from tether.client.session_types import codec_fields
from tether.server.serve_config import ServiceConfig
from tether.shared.codecs import Codec, decode_many
from tether.shared.drafter import DraftDelta
from tether.shared.wire import parse_many
from tether.v1 import tether_pb2 as pb

FP = "c" * 64
VOCAB = 7  # small, so random drafts are often right and acceptance paths run


@pytest.fixture(scope="module")
def served():
    with served_tiny_pair(ServiceConfig(max_prompt_tokens=64, max_sessions=8), FP, VOCAB) as (target, drafter, _, stub):
        yield target, drafter, stub


def to_delta(kv: pb.KVDelta) -> DraftDelta:
    return DraftDelta(start=kv.start, tokens=list(kv.tokens), tensors=decode_many(kv.payload))


def codecs_of(kv: pb.KVDelta) -> set[Codec]:
    return {e.codec for e in parse_many(kv.payload).values()}


def open_message(prompt: list[int], **fields) -> pb.ClientMessage:
    return pb.ClientMessage(open=pb.OpenSession(prompt=prompt, max_new_tokens=32, model_fingerprint=FP, **fields))


def test_model_info_lists_every_codec(served):
    _, _, stub = served
    assert set(stub.GetModelInfo(pb.GetModelInfoRequest()).codecs) == {int(c) for c in Codec}


@pytest.mark.parametrize(
    ("fields", "sent"),
    [
        (dict(accept_codecs=[Codec.INT3_HADAMARD, Codec.INT8_ZSTD]), Codec.INT3_HADAMARD),
        (dict(accept_codecs=[42, Codec.INT4_HADAMARD], delta_codec=Codec.RAW), Codec.INT4_HADAMARD),  # 42: newer
        (dict(delta_codec=Codec.INT8_ZSTD), Codec.INT8_ZSTD),  # an older client: no offer
        (dict(delta_codec=Codec.INT2_HADAMARD), Codec.INT2_HADAMARD),
        (codec_fields("int3"), Codec.INT3_HADAMARD),
        (codec_fields("lossless"), Codec.FP16_SHUFFLE_ZSTD),
    ],
    ids=["offer", "newer-first", "old-client", "old-field-new-codec", "client-int3", "client-lossless"],
)
def test_the_server_sends_the_first_codec_offered_that_it_knows(served, fields, sent):
    """Every delta of the session (the prompt's, each verdict's) travels in the codec picked, and the verified
    tokens are plain greedy decoding's whatever the codec."""
    target, drafter, stub = served
    prompt = [1, 2, 3, 4, 5, 6, 0]
    outbox: queue.Queue = queue.Queue()
    replies = stub.Session(iter(outbox.get, None))
    outbox.put(open_message(prompt, **fields))
    opened = next(replies).opened
    seen = codecs_of(opened.delta)
    drafter.begin(to_delta(opened.delta))
    out, root = [opened.first_token], opened.first_token
    for rnd in range(1, 5):
        drafts, _, _ = drafter.draft(root, 3)
        outbox.put(pb.ClientMessage(round=pb.DraftRound(round=rnd, root=root, tokens=drafts)))
        v = next(replies).verdict
        seen |= codecs_of(v.delta)
        drafter.commit(to_delta(v.delta))
        out += drafts[: v.accepted] + [v.bonus]
        root = v.bonus
    outbox.put(None)
    assert seen == {sent}
    assert out == list(target.generate(torch.tensor([prompt]), len(out)))


def test_an_offer_of_nothing_it_knows_is_refused(served):
    _, _, stub = served
    outbox = [open_message([1, 2], accept_codecs=[42, 43]), open_message([1, 2], accept_codecs=[Codec.RAW] * 33)]
    for message in outbox:
        error = next(stub.Session(iter([message]))).error
        assert error.reason == pb.REASON_INVALID_REQUEST and error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]


def test_a_rebuilt_session_takes_the_resync_offer(served):
    """A resync that rebuilds a lost session picks its codec from the resync's own offer."""
    _, _, stub = served
    prompt = [3, 1, 4, 1, 5]
    reply = stub.Resync(
        pb.ResyncRequest(
            verified_length=len(prompt),
            history=prompt,
            offline_tokens=[2, 6],
            model_fingerprint=FP,
            accept_codecs=[Codec.INT4_HADAMARD],
        )
    )
    assert reply.rebuilt and codecs_of(reply.delta) == {Codec.INT4_HADAMARD}


def test_the_client_offers_its_choice_then_what_loses_less():
    assert codec_fields("int3") == {
        "delta_codec": Codec.INT8_ZSTD,  # what a server that reads no offer knows
        "accept_codecs": [
            Codec.INT3_HADAMARD,
            Codec.INT4_HADAMARD,
            Codec.INT8_ZSTD,
            Codec.FP16_SHUFFLE_ZSTD,
            Codec.RAW,
        ],
    }
    assert codec_fields("lossless") == {
        "delta_codec": Codec.FP16_SHUFFLE_ZSTD,
        "accept_codecs": [Codec.FP16_SHUFFLE_ZSTD, Codec.RAW],
    }
    assert codec_fields("raw") == {"delta_codec": Codec.RAW, "accept_codecs": [Codec.RAW]}
