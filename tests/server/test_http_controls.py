"""The sampling controls on the server's OpenAI-compatible HTTP API, over a real server on 127.0.0.1 with a tiny
model: /v1/completions and /v1/chat/completions with penalties, logit_bias (OpenAI's string-keyed map) and min_p
write what the model's own step-by-step decoding with the same controls writes; stop_token_ids end the text; a
value out of range is a 400 naming its param."""

import httpx
import pytest
import torch
from tiny_models import tiny_target

from tether.server.errors import Reason, RequestError
from tether.server.http_api import api_error, start_http
from tether.server.rpc_server import make_server
from tether.server.service import ServiceConfig, TetherService
from tether.shared.logits_processing import SamplingControls
from tether.shared.openai_api import TextStream
from tether.shared.openai_app import HttpConfig
from tether.shared.tokenizer import Tokenizer

FP = "f" * 64
MODEL = "tiny"
BOUND_S = 60  # a safety net, never a timing assumption


@pytest.fixture(scope="module")
def api():
    tok = Tokenizer.train(texts=["def f(x):\n    return x + 1\n"] * 20, vocab_size=260)
    target = tiny_target(vocab_size=tok.vocab_size)
    service = TetherService(target, None, tok, ServiceConfig(max_prompt_tokens=64, max_new_tokens=32),
                            model_fingerprint=FP)  # fmt: skip
    server, _ = make_server(service, "127.0.0.1:0")
    server.start()
    http, port = start_http(service, MODEL, HttpConfig(port=0))
    yield service, f"http://127.0.0.1:{port}/v1"
    http.stop()
    server.stop(grace=None)


def expected_text(service, prompt: list[int], n: int, controls: SamplingControls, stop_ids=frozenset()) -> str:
    """What the app shows for the model's own decoding with these controls (its TextStream, its stop ids)."""
    chat = service.chat_format
    text = TextStream(chat.tokenizer, stop_ids=chat.stop_ids | stop_ids, hidden_ids=chat.hidden_ids)
    out = []
    for token in service.target.generate(torch.tensor([prompt]), n, controls=controls):
        out.append(text.push(token))
        if text.finish_reason:
            break
    return "".join(out) + text.flush()


def post(url: str, body: dict) -> httpx.Response:
    return httpx.post(url, json={"model": MODEL, **body}, timeout=BOUND_S)


PROMPT = [40, 41, 42, 43, 44, 45, 46]
CASES = {
    "frequency": ({"frequency_penalty": 1.5}, SamplingControls(frequency_penalty=1.5)),
    "presence+repetition": ({"presence_penalty": 1.0, "repetition_penalty": 1.5},
                            SamplingControls(presence_penalty=1.0, repetition_penalty=1.5)),
    "logit_bias": ({"logit_bias": {"50": 30, "51": 30}}, SamplingControls(logit_bias={50: 30.0, 51: 30.0})),
    # min_p 1 keeps the most probable token alone: sampling with it is greedy whatever the draws.
    "min_p": ({"temperature": 1.3, "min_p": 1.0, "seed": 3, "frequency_penalty": 0.75},
              SamplingControls(frequency_penalty=0.75)),
}  # fmt: skip


@pytest.mark.parametrize("name", list(CASES))
def test_completions_with_controls_equal_plain_decoding_with_them(api, name):
    service, url = api
    fields, controls = CASES[name]
    r = post(url + "/completions", {"prompt": PROMPT, "max_tokens": 16, "temperature": 0, **fields})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == expected_text(service, PROMPT, 16, controls)
    assert r.json()["choices"][0]["text"] != expected_text(service, PROMPT, 16, SamplingControls())


def test_chat_with_a_penalty_equals_plain_decoding_with_it(api):
    service, url = api
    messages = [{"role": "user", "content": "def f(x):"}]
    prompt = service.chat_format.encode(service.chat_format.render(messages))
    body = {"messages": messages, "max_tokens": 16, "temperature": 0, "presence_penalty": 2, "frequency_penalty": 1}
    r = post(url + "/chat/completions", body)
    assert r.status_code == 200, r.text
    controls = SamplingControls(presence_penalty=2, frequency_penalty=1)
    assert r.json()["choices"][0]["message"]["content"] == expected_text(service, prompt, 16, controls)


def test_stop_token_ids_end_the_text(api):
    service, url = api
    tokens = list(service.target.generate(torch.tensor([PROMPT]), 16))
    stop = tokens[4]
    r = post(url + "/completions", {"prompt": PROMPT, "max_tokens": 16, "temperature": 0, "stop_token_ids": [stop]})
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["text"] == expected_text(service, PROMPT, 16, SamplingControls(), frozenset({stop}))
    assert r.json()["usage"]["completion_tokens"] == tokens.index(stop) + 1


@pytest.mark.parametrize(
    "fields,param",
    [
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"repetition_penalty": -1}, "repetition_penalty"),
        ({"min_p": 2}, "min_p"),
        ({"logit_bias": {"5": 200}}, "logit_bias"),
        ({"logit_bias": {"999": 1}}, "logit_bias"),  # outside the vocabulary
        ({"stop_token_ids": [999]}, "stop_token_ids"),
    ],
)
def test_a_value_out_of_range_is_a_400_naming_its_param(api, fields, param):
    _, url = api
    for path, body in (("/completions", {"prompt": PROMPT}), ("/chat/completions", {"messages": [
            {"role": "user", "content": "x"}]})):  # fmt: skip
        r = post(url + path, {**body, **fields})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param and error["type"] == "invalid_request_error" and param in error["message"]


def test_the_service_refusal_of_a_field_keeps_its_name():
    """A control the model's own checks refuse (a logit_bias id of the tokenizer past the model's vocabulary)
    answers 400 with the field as param."""
    e = api_error(RequestError(Reason.REASON_INVALID_REQUEST, "logit_bias token 300 is outside", field="logit_bias"))
    assert (e.kind.status, e.param) == (400, "logit_bias")
