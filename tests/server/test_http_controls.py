"""The sampling controls on the server's OpenAI-compatible HTTP API, over a real server on 127.0.0.1 with a tiny
model: /v1/completions and /v1/chat/completions with penalties, logit_bias (OpenAI's string-keyed map) and min_p
write what the model's own step-by-step decoding with the same controls writes; stop_token_ids end the text; a
value out of range is a 400 naming its param; logprobs are each position's processed distribution (streamed and
not); n choices are n generations, choice i with seed + i; ignore_eos decodes through end-of-text."""

import httpx
import pytest
import torch
from sse import sse_events
from tiny_models import tiny_target

from tether.server.engine_core import Engine
from tether.server.errors import Reason, RequestError
from tether.server.http_api import api_error, sampling_params, start_http
from tether.server.rpc_server import make_server
from tether.server.serve_config import ServiceConfig
from tether.server.service import TetherService
from tether.shared.logits_processing import SamplingControls
from tether.shared.openai_api import parse_completion
from tether.shared.openai_app import HttpConfig
from tether.shared.sampling import token_logprobs
from tether.shared.text_stream import TextStream
from tether.shared.tokenizer import Tokenizer

FP = "f" * 64
MODEL = "tiny"
BOUND_S = 60  # a safety net, never a timing assumption


@pytest.fixture(scope="module")
def api():
    tok = Tokenizer.train(texts=["def f(x):\n    return x + 1\n"] * 20, vocab_size=260)
    target = tiny_target(vocab_size=tok.vocab_size)
    service = TetherService(Engine(target, None, tok, ServiceConfig(max_prompt_tokens=64, max_new_tokens=32),
                            model_fingerprint=FP))  # fmt: skip
    server, _ = make_server(service, "127.0.0.1:0")
    server.start()
    http, port = start_http(service.engine, MODEL, HttpConfig(port=0))
    yield service, f"http://127.0.0.1:{port}/v1"
    http.stop()
    server.stop(grace=None)


def expected_text(service, prompt: list[int], n: int, controls: SamplingControls, stop_ids=frozenset()) -> str:
    """What the app shows for the model's own decoding with these controls (its TextStream, its stop ids)."""
    chat = service.engine.chat_format
    text = TextStream(chat.tokenizer, stop_ids=chat.stop_ids | stop_ids, hidden_ids=chat.hidden_ids)
    out = []
    for token in service.engine.target.generate(torch.tensor([prompt]), n, controls=controls):
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
    prompt = service.engine.chat_format.encode(service.engine.chat_format.render(messages))
    body = {"messages": messages, "max_tokens": 16, "temperature": 0, "presence_penalty": 2, "frequency_penalty": 1}
    r = post(url + "/chat/completions", body)
    assert r.status_code == 200, r.text
    controls = SamplingControls(presence_penalty=2, frequency_penalty=1)
    assert r.json()["choices"][0]["message"]["content"] == expected_text(service, prompt, 16, controls)


def test_stop_token_ids_end_the_text(api):
    service, url = api
    tokens = list(service.engine.target.generate(torch.tensor([PROMPT]), 16))
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


def reference_logprobs(service, prompt: list[int], tokens: list[int], controls: SamplingControls, top: int) -> list:
    """What each token's logprobs must be: the processed distribution of its position, from the model's own
    step-by-step forward (tether.shared.sampling.token_logprobs over SamplingControls' processing)."""
    target, out = service.engine.target, []
    cache = target.new_cache(1, len(prompt) + len(tokens))
    logits = target.prefill(torch.tensor([prompt]), cache, last_only=True).logits[0, -1]
    for m, token in enumerate(tokens):
        x = logits.detach().float().numpy()
        proc = controls.processing(prompt + tokens[:m], len(prompt), target.cfg.vocab_size)
        x = x if proc is None else proc.apply_np(x)
        out.append(token_logprobs(x, token, top, controls.temperature, controls.top_p, controls.top_k, controls.min_p))
        logits = target.prefill(torch.tensor([[token]]), cache).logits[0, -1]
    return out


def test_completion_logprobs_are_the_processed_distributions(api):
    service, url = api
    controls = SamplingControls(frequency_penalty=1.0, logit_bias={50: 3.0})
    tokens = list(service.engine.target.generate(torch.tensor([PROMPT]), 6, controls=controls))
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "logprobs": 3, "frequency_penalty": 1.0,
            "logit_bias": {"50": 3}, "ignore_eos": True}  # fmt: skip
    lp = post(url + "/completions", body).json()["choices"][0]["logprobs"]
    expected = reference_logprobs(service, PROMPT, tokens, controls, 3)
    text = service.engine.tokenizer.decode
    assert lp["tokens"] == [text([t]) for t in tokens]
    assert lp["token_logprobs"] == pytest.approx([e.logprob for e in expected], abs=1e-4)
    for got, e in zip(lp["top_logprobs"], expected, strict=True):
        # Keyed by text, as OpenAI's completions report them: tokens of one text (partial UTF-8) share a key.
        assert got == pytest.approx({text([t]): v for t, v in e.top}, abs=1e-4) and len(e.top) == 3
    # Greedy: each token is its processed distribution's most probable (reported at temperature 1, as vLLM's).
    assert all(e.top[0] == (e.token, e.logprob) for e in expected)
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(6)]


def test_streamed_chat_logprobs_cover_every_token(api):
    _, url = api
    body = {"messages": [{"role": "user", "content": "def f(x):"}], "max_tokens": 8, "temperature": 0.8, "seed": 1,
            "logprobs": True, "top_logprobs": 2, "stream": True, "stream_options": {"include_usage": True},
            "ignore_eos": True}  # fmt: skip
    events = sse_events(url + "/chat/completions", {"model": MODEL, **body}, BOUND_S)
    entries = [e for ev in events[:-1] if ev["choices"] and ev["choices"][0]["logprobs"]
               for e in ev["choices"][0]["logprobs"]["content"]]  # fmt: skip
    assert len(entries) == events[-2]["usage"]["completion_tokens"] == 8
    for e in entries:
        assert len(e["top_logprobs"]) == 2 and e["bytes"] == list(e["token"].encode())
        assert e["logprob"] <= 0 and e["top_logprobs"][0]["logprob"] >= e["top_logprobs"][1]["logprob"]
    whole = post(url + "/chat/completions", body | {"stream": False, "stream_options": None}).json()
    assert whole["choices"][0]["logprobs"]["content"] == entries  # the same seed: the same tokens and figures


def test_n_choices_each_sample_with_their_own_seed(api):
    _, url = api
    body = {"max_tokens": 8, "temperature": 1.0, "seed": 5, "ignore_eos": True}
    many = post(url + "/completions", body | {"prompt": PROMPT, "n": 3}).json()
    assert [c["index"] for c in many["choices"]] == [0, 1, 2]
    alone = [post(url + "/completions", body | {"prompt": PROMPT, "seed": 5 + i}).json()["choices"][0]["text"]
             for i in range(3)]  # fmt: skip
    assert [c["text"] for c in many["choices"]] == alone and len(set(alone)) > 1
    assert many["usage"]["completion_tokens"] == 24
    body |= {"messages": [{"role": "user", "content": "x"}], "n": 2}
    events = sse_events(url + "/chat/completions", {"model": MODEL, **body, "stream": True}, BOUND_S)
    texts, finished = ["", ""], [None, None]
    for ev in events[:-1]:
        choice = ev["choices"][0]
        texts[choice["index"]] += choice["delta"].get("content", "")
        finished[choice["index"]] = choice["finish_reason"] or finished[choice["index"]]
    chat = post(url + "/chat/completions", body).json()
    assert texts == [c["message"]["content"] for c in chat["choices"]] and finished == ["length", "length"]


def test_logprobs_of_choices_decoded_together_equal_each_alone(api):
    """Two choices decode through the batcher (each token a round verified with the other's): their logprobs are
    what each reports decoded alone."""
    _, url = api
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0.9, "seed": 11, "logprobs": 2,
            "presence_penalty": 0.5, "ignore_eos": True}  # fmt: skip
    both = post(url + "/completions", body | {"n": 2}).json()["choices"]
    for i, choice in enumerate(both):
        alone = post(url + "/completions", body | {"seed": 11 + i}).json()["choices"][0]
        assert choice["text"] == alone["text"] and choice["logprobs"]["tokens"] == alone["logprobs"]["tokens"]
        assert choice["logprobs"]["token_logprobs"] == pytest.approx(alone["logprobs"]["token_logprobs"], abs=1e-4)


def test_serve_sets_the_most_choices_a_request_may_ask_for():
    from tether.server.cli import build_parser
    from tether.server.daemon import _http_config
    from tether.server.serve_config import ServeConfig
    from tether.shared.cli_support import build_config

    cfg = build_config(ServeConfig, build_parser().parse_args(["serve", "--http-max-n", "3"]))
    assert _http_config(cfg, ServiceConfig()).max_n == 3


def test_ignore_eos_decodes_through_end_of_text_on_the_server(api):
    """ignore_eos travels to the server's decoding (SamplingParams.ignore_eos): with end-of-text every token's
    pick, the completion runs to max_tokens; without it, decoding ends at the first."""
    service, url = api
    eos = service.engine.tokenizer.eos_id
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "logit_bias": {str(eos): 100}}
    through = post(url + "/completions", body | {"ignore_eos": True}).json()
    assert through["usage"]["completion_tokens"] == 6 and through["choices"][0]["finish_reason"] == "length"
    assert sampling_params(parse_completion({"prompt": "x", "ignore_eos": True}).sampling).ignore_eos
    ended = post(url + "/completions", body).json()
    assert ended["usage"]["completion_tokens"] == 1 and ended["choices"][0]["finish_reason"] == "stop"
