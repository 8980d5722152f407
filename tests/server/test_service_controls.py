"""The sampling controls and every end-of-text id over a loopback gRPC server: Generate, Session rounds and a
Resync's rebuild decode under min_p, the penalties and logit_bias exactly as the model's own step-by-step decoding
with the same controls (Transformer.generate); a control out of its range is INVALID_ARGUMENT naming it; a stop
token and the model's second end-of-text id end a Generate stream; with ignore_eos only the length and the stop tokens
end it. Log-probabilities asked in SamplingParams.logprobs come with Generate's tokens, the first token and each
verdict's emitted tokens: each position's processed distribution, as the HTTP API reports it."""

import grpc
import pytest
import torch
from test_http_controls import reference_logprobs
from test_service import Client, open_msg, run_session, to_delta
from tiny_models import tiny_moa_drafter, tiny_target

from tether.client.refusals import Refusal
from tether.server.engine_core import Engine
from tether.server.rpc_server import make_server
from tether.server.serve_config import ServiceConfig
from tether.server.service import TetherService
from tether.shared.logits_processing import SamplingControls
from tether.shared.tokenizer import Tokenizer
from tether.v1 import tether_pb2 as pb
from tether.v1 import tether_pb2_grpc

FP = "f" * 64
VOCAB = 24
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


GREEDY = SamplingControls()


def plain(target, prompt, n, controls=GREEDY, stop_ids=()):
    return list(target.generate(torch.tensor([prompt]), n, controls=controls, stop_ids=stop_ids))


def second_eos(target) -> tuple[list[int], int]:
    """A prompt and a token its greedy continuation writes third, before any end-of-text id 0: the model's second
    end-of-text id, so that only the second one can end that stream."""
    for first in range(2, VOCAB):
        prompt = [first, *PROMPT]
        out = plain(target, prompt, 3)
        if 0 not in out and out[2] not in out[:2]:
            return prompt, out[2]
    raise AssertionError("no prompt's greedy continuation fits")


@pytest.fixture(scope="module")
def served():
    target = tiny_target(vocab_size=VOCAB)
    trained = Tokenizer.train(texts=["def f(x):\n    return x\n"] * 20, vocab_size=260)
    eos_prompt, second = second_eos(target)
    tok = Tokenizer.from_json(trained.to_json(), eos_ids=[second])
    config = ServiceConfig(max_prompt_tokens=64, max_sessions=8)
    service = TetherService(Engine(target, tiny_moa_drafter(target), tok, config, model_fingerprint=FP))
    server, port = make_server(service, "127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield target, service, tether_pb2_grpc.TetherStub(channel), (eos_prompt, second)
    channel.close()
    server.stop(grace=None)


def generate(stub, prompt, n, sampling=None) -> list[int]:
    req = pb.OpenSession(prompt=prompt, max_new_tokens=n, model_fingerprint=FP, sampling=sampling)
    return [t for msg in stub.Generate(req) for t in msg.tokens]


def cases(target) -> dict[str, tuple[pb.SamplingParams, SamplingControls]]:
    """Each control on the wire and in-process. min_p 1 keeps only the most probable token, so sampling with it is
    greedy: the sampled path's rule, whatever the draws."""
    banned = max(set(out := plain(target, PROMPT, 16)), key=out.count)  # the token greedy writes most
    return {
        "frequency": (pb.SamplingParams(frequency_penalty=1.5), SamplingControls(frequency_penalty=1.5)),
        "presence+repetition": (pb.SamplingParams(presence_penalty=1.0, repetition_penalty=1.5),
                                SamplingControls(presence_penalty=1.0, repetition_penalty=1.5)),
        "logit_bias": (pb.SamplingParams(logit_bias={banned: -100.0, 7: 2.5}),
                       SamplingControls(logit_bias={banned: -100.0, 7: 2.5})),
        "min_p": (pb.SamplingParams(temperature=1.3, min_p=1.0, seed=3, frequency_penalty=0.75),
                  SamplingControls(frequency_penalty=0.75)),
    }  # fmt: skip


def test_model_info_names_every_end_of_text_id_and_the_controls(served):
    target, service, stub, (_, second) = served
    info = stub.GetModelInfo(pb.GetModelInfoRequest())
    assert list(info.eos_ids) == [0, second] and info.eos_id == 0
    assert info.sampling_controls and not info.clean_up_tokenization_spaces
    cleaning = Tokenizer.from_json(service.engine.tokenizer.to_json(), clean_up_spaces=True)
    alone = TetherService(Engine(target, None, cleaning, ServiceConfig(kv_pool_bytes=1 << 20), model_fingerprint=FP))
    try:
        assert alone.engine.model_info.clean_up_tokenization_spaces and alone.engine.model_info.sampling_controls
    finally:
        alone.engine.close()


def test_generate_with_controls_equals_plain_decoding_with_them(served):
    target, service, stub, _ = served
    ends = service.engine.eos_ids  # Generate ends after any of them
    for name, (wire, controls) in cases(target).items():
        got = generate(stub, PROMPT, 16, wire)
        assert got == plain(target, PROMPT, 16, controls, stop_ids=ends), name
        assert got != plain(target, PROMPT, 16, stop_ids=ends), name  # the control decided some token


def test_session_rounds_with_controls_equal_plain_decoding_with_them(served):
    """Drafts proposed without the controls are judged by the processed rule, each position with the counts of its
    own context (accepted drafts included), so the text is plain decoding's with the controls."""
    target, service, stub, _ = served
    for name, (wire, controls) in cases(target).items():
        out, *_ = run_session(stub, service.engine.drafter, PROMPT, 20, sampling=wire)
        assert out == plain(target, PROMPT, len(out), controls), name


def test_a_rebuilt_session_counts_the_history_after_its_prompt_length_as_generated(served):
    target, service, stub, _ = served
    wire, controls = pb.SamplingParams(frequency_penalty=2.0), SamplingControls(frequency_penalty=2.0)
    out, *_, verified, root = run_session(stub, service.engine.drafter, PROMPT, 20, sampling=wire)
    history = (PROMPT + out)[:verified]
    rebuild = pb.ResyncRequest(verified_length=verified, offline_tokens=[root], history=history, sampling=wire,
                               prompt_length=len(PROMPT), model_fingerprint=FP)  # fmt: skip
    reply = stub.Resync(rebuild)
    assert reply.rebuilt and reply.target_token == plain(target, PROMPT, len(out) + 1, controls)[-1]
    # Without prompt_length the whole history is the prompt, as older clients meant it: only the root (absorbed
    # after it) counts as generated.
    rebuild.ClearField("prompt_length")
    context = history + [root]
    cache = target.new_cache(1, len(context))
    logits = target.prefill(torch.tensor([context]), cache, last_only=True).logits[0, -1].detach().float().numpy()
    expected = int(controls.processing(context, len(history), VOCAB).apply_np(logits).argmax())
    assert stub.Resync(rebuild).target_token == expected != reply.target_token


def refusal(call) -> Refusal:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return Refusal.of_rpc_error(e.value)


BAD = {
    "min_p": pb.SamplingParams(min_p=1.5),
    "presence_penalty": pb.SamplingParams(presence_penalty=-2.5),
    "frequency_penalty": pb.SamplingParams(frequency_penalty=float("nan")),
    "repetition_penalty": pb.SamplingParams(repetition_penalty=0.0),
    "logit_bias": pb.SamplingParams(logit_bias={3: 101.0}),
    "stop_token_ids": pb.SamplingParams(stop_token_ids=[VOCAB]),
    "logprobs": pb.SamplingParams(logprobs=21),
}


@pytest.mark.parametrize("field", list(BAD))
def test_a_control_out_of_range_is_invalid_argument_naming_it(served, field):
    _, _, stub, _ = served
    r = refusal(lambda: generate(stub, PROMPT, 4, BAD[field]))
    assert (r.code, r.reason) == (grpc.StatusCode.INVALID_ARGUMENT, pb.REASON_INVALID_REQUEST)
    assert field in r.message
    inline = Client(stub).send(open_msg(PROMPT, sampling=BAD[field])).error  # a Session's open: an inline error
    assert inline.reason == pb.REASON_INVALID_REQUEST and field in inline.message


def test_the_refused_field_is_a_bad_request_detail(served):
    """Besides the message, the rich status names the field as google.rpc.BadRequest does."""
    from google.rpc import error_details_pb2, status_pb2

    _, _, stub, _ = served
    with pytest.raises(grpc.RpcError) as e:
        generate(stub, PROMPT, 4, pb.SamplingParams(min_p=2.0))
    raw = dict(e.value.trailing_metadata())["grpc-status-details-bin"]
    details = status_pb2.Status.FromString(raw).details
    bad = error_details_pb2.BadRequest()
    assert any(d.Unpack(bad) for d in details)
    assert [v.field for v in bad.field_violations] == ["min_p"]


def test_a_logit_bias_outside_the_vocabulary_is_refused(served):
    _, _, stub, _ = served
    r = refusal(lambda: generate(stub, PROMPT, 4, pb.SamplingParams(logit_bias={VOCAB: 1.0})))
    assert r.reason == pb.REASON_INVALID_REQUEST and "logit_bias" in r.message


def test_a_stop_token_and_the_second_end_of_text_id_end_the_stream(served):
    target, service, stub, (eos_prompt, second) = served
    full = plain(target, PROMPT, 16, stop_ids=service.engine.eos_ids)
    stop = full[3]
    got = generate(stub, PROMPT, 16, pb.SamplingParams(stop_token_ids=[stop]))
    assert got == full[: full.index(stop) + 1] and len(got) < len(full)
    got = generate(stub, eos_prompt, 16)
    assert got == plain(target, eos_prompt, 3) and got[-1] == second


def test_ignore_eos_runs_a_stream_to_its_length_and_stop_tokens_still_end_it(served):
    target, service, stub, (eos_prompt, second) = served
    ignoring = pb.SamplingParams(ignore_eos=True)
    got = generate(stub, eos_prompt, 8, ignoring)
    assert got == plain(target, eos_prompt, 8) and second in got[:3] and len(got) == 8  # through end-of-text
    # Every token an end-of-text id: still the whole length.
    forced = generate(stub, PROMPT, 6, pb.SamplingParams(ignore_eos=True, logit_bias={second: 100.0}))
    assert forced == [second] * 6
    assert generate(stub, PROMPT, 6, pb.SamplingParams(logit_bias={second: 100.0})) == [second]
    stop = plain(target, eos_prompt, 8)[4]
    got = generate(stub, eos_prompt, 8, pb.SamplingParams(ignore_eos=True, stop_token_ids=[stop]))
    assert got[-1] == stop and len(got) < 8 and second in got


def unwired(entries) -> list[tuple[int, float, list[tuple[int, float]]]]:
    return [(e.token, e.logprob, list(zip(e.top_ids, e.top_logprobs, strict=True))) for e in entries]


def assert_reported(got, expected) -> None:
    assert [g[0] for g in got] == [e.token for e in expected]
    for (_, logprob, top), e in zip(got, expected, strict=True):
        assert logprob == pytest.approx(e.logprob, abs=1e-4)
        assert [t for t, _ in top] == [t for t, _ in e.top] and len(top) == 3
        assert [v for _, v in top] == pytest.approx([v for _, v in e.top], abs=1e-4)


def test_generate_reports_each_tokens_processed_logprobs(served):
    target, service, stub, _ = served
    controls = SamplingControls(frequency_penalty=1.0, logit_bias={5: 3.0})
    wire = pb.SamplingParams(frequency_penalty=1.0, logit_bias={5: 3.0}, logprobs=3, ignore_eos=True)
    req = pb.OpenSession(prompt=PROMPT, max_new_tokens=20, model_fingerprint=FP, sampling=wire)
    messages = list(stub.Generate(req))
    assert all(len(m.logprobs) == len(m.tokens) for m in messages) and len(messages) > 1  # chunked
    tokens = [t for m in messages for t in m.tokens]
    assert tokens == plain(target, PROMPT, 20, controls)
    assert_reported(unwired(e for m in messages for e in m.logprobs), reference_logprobs(service, PROMPT, tokens,
                                                                                          controls, 3))  # fmt: skip
    assert not any(m.logprobs for m in stub.Generate(pb.OpenSession(prompt=PROMPT, max_new_tokens=4,
                                                                    model_fingerprint=FP)))  # fmt: skip


def test_session_verdicts_report_their_emitted_tokens_logprobs(served):
    """The first token's entry in Opened, then each verdict's accepted drafts' and bonus's: together every emitted
    token's, equal to the model's own step-by-step distributions under the controls; then a resync's next token's."""
    target, service, stub, _ = served
    controls = SamplingControls(presence_penalty=1.0)
    client = Client(stub)
    opened = client.send(open_msg(PROMPT, sampling=pb.SamplingParams(presence_penalty=1.0, logprobs=3))).opened
    drafter = service.engine.drafter
    drafter.begin(to_delta(opened.delta))
    out, got, root = [opened.first_token], unwired([opened.first_logprob]), opened.first_token
    for rnd in range(1, 6):
        drafts, _, _ = drafter.draft(root, 3)
        v = client.send(pb.ClientMessage(round=pb.DraftRound(round=rnd, root=root, tokens=drafts))).verdict
        drafter.commit(to_delta(v.delta))
        assert len(v.logprobs) == v.accepted + 1
        out += [*drafts[: v.accepted], v.bonus]
        got += unwired(v.logprobs)
        root = v.bonus
    client.close()
    assert out == plain(target, PROMPT, len(out), controls) and len(out) > 6  # some drafts were accepted
    assert_reported(got, reference_logprobs(service, PROMPT, out, controls, 3))
    # A resync's next token (here a rebuild from the history): its entry in the reply.
    wire = pb.SamplingParams(presence_penalty=1.0, logprobs=3)
    verified = len(PROMPT) + len(out) - 1
    reply = stub.Resync(pb.ResyncRequest(verified_length=verified, offline_tokens=[root], history=(PROMPT + out)[:-1],
                                         sampling=wire, prompt_length=len(PROMPT), model_fingerprint=FP))  # fmt: skip
    expected = reference_logprobs(service, PROMPT, [*out, reply.target_token], controls, 3)[-1:]
    assert reply.rebuilt and reply.target_token == plain(target, PROMPT, len(out) + 1, controls)[-1]
    assert_reported(unwired([reply.target_logprob]), expected)
