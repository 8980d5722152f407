"""The OpenAI-compatible HTTP API (tether.server.http_api over tether.shared.openai_app) on a real server on
127.0.0.1, driven by the official `openai` package and by raw SSE over httpx: greedy output equal to
`tether-server generate`, seeded sampling reproducible, top_k, stop strings, usage, OpenAI's error shapes and
statuses, capacity (429 and 503 with Retry-After), a client that goes away freeing its generation at once,
HTTP streams and a gRPC Generate stream batched together, and `serve --drafter none` end to end.

Nothing here waits on the clock: generations that must be in flight are held at a gate (an event) in the decoding
loop, and every wait has a bound only as a safety net."""

import json
import socket
import threading

import grpc
import httpx
import openai
import pytest
from held_decoding import Gate
from sse import sse_events
from toy_models import load_toy_pair, toy_model_dir

from tether.server.engine_core import Engine
from tether.server.generate import GenerateConfig, generate_text
from tether.server.http_api import start_http
from tether.server.rpc_server import make_server
from tether.server.serve_config import ServiceConfig
from tether.server.service import TetherService
from tether.shared.chat_template import ChatFormat
from tether.shared.openai_app import HttpConfig
from tether.v1 import tether_pb2 as pb
from tether.v1 import tether_pb2_grpc

pytestmark = pytest.mark.heavy  # a long file, started first (tests/conftest.py)

MODEL = "tether-default"
MAX_STREAMS = 6
PROMPT = "class Parser:\n    def __init__(self"
BOUND_S = 120  # a safety net for waits that end on events, never a timing assumption


@pytest.fixture(scope="module")
def api():
    target, tok, drafter, fp = load_toy_pair()
    chat = ChatFormat.from_model_dir(toy_model_dir(), tok)
    config = ServiceConfig(max_prompt_tokens=256, max_new_tokens=128, model_id=MODEL)
    service = TetherService(Engine(target, drafter, tok, config, model_fingerprint=fp, chat_format=chat))
    server, grpc_port = make_server(service, "127.0.0.1:0")
    server.start()
    http, port = start_http(service.engine, MODEL, HttpConfig(port=0, max_streams=MAX_STREAMS))
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=BOUND_S)
    channel = grpc.insecure_channel(f"127.0.0.1:{grpc_port}")
    yield {"service": service, "app": http.app, "backend": http.app.backend, "client": client,
           "url": f"http://127.0.0.1:{port}", "stub": tether_pb2_grpc.TetherStub(channel)}  # fmt: skip
    channel.close()
    http.stop()
    server.stop(grace=None)


@pytest.fixture(scope="module")
def reference():
    """`tether-server generate --drafter none` (its function) for PROMPT: the text greedy HTTP must equal."""
    return generate_text(GenerateConfig(model=str(toy_model_dir()), prompt=PROMPT, drafter="none", max_new_tokens=48,
                                        device="cpu"))  # fmt: skip


# ---------------------------------------------------------------------------------------------- basics


def test_models_and_health(api):
    models = api["client"].models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert api["client"].models.retrieve(MODEL).id == MODEL
    assert httpx.get(api["url"] + "/health").json() == {"status": "ok"}


def test_greedy_completion_equals_tether_server_generate(api, reference):
    client = api["client"]
    done = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=48, temperature=0)
    assert done.choices[0].text == reference["text"]
    assert done.usage.prompt_tokens == reference["prompt_tokens"]
    assert done.usage.completion_tokens == reference["new_tokens"]
    assert done.usage.total_tokens == done.usage.prompt_tokens + done.usage.completion_tokens
    assert done.choices[0].finish_reason == ("stop" if 0 in reference["token_ids"] else "length")
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=48, temperature=0, stream=True)
    pieces = list(stream)
    assert "".join(c.choices[0].text for c in pieces) == reference["text"]
    assert pieces[-1].choices[0].finish_reason == done.choices[0].finish_reason


def test_token_id_prompt_and_top_k_one_are_greedy(api, reference):
    ids = ChatFormat.from_model_dir(toy_model_dir(), api["service"].engine.tokenizer).encode(PROMPT)
    done = api["client"].completions.create(model=MODEL, prompt=ids, max_tokens=48, temperature=1.5,
                                             extra_body={"top_k": 1})  # fmt: skip
    assert done.choices[0].text == reference["text"]  # top-k 1 leaves the argmax alone: sampling it is greedy


def test_chat_streaming_and_not_with_the_openai_client(api):
    client = api["client"]
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "import os"}]
    done = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    chat = api["service"].engine.chat_format
    assert done.usage.prompt_tokens == len(chat.encode(chat.render(messages)))
    assert done.choices[0].message.role == "assistant" and done.object == "chat.completion"
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == done.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == done.usage.completion_tokens
    assert len({c.id for c in chunks}) == 1


def test_seeded_sampling_is_reproducible(api):
    client = api["client"]

    def sample(seed: int) -> str:
        out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=32, temperature=0.9, top_p=0.95,
                                        seed=seed, extra_body={"top_k": 40})  # fmt: skip
        return out.choices[0].text

    assert sample(7) == sample(7)
    assert len({sample(s) for s in range(4)}) > 1


def test_stop_strings_cut_the_text_before_them(api, reference):
    text = reference["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 3]  # three characters inside the greedy text
    assert stop and stop in text
    want = text[: text.index(stop)]
    client = api["client"]
    done = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=48, temperature=0, stop=[stop, "\x00"])
    assert done.choices[0].text == want and done.choices[0].finish_reason == "stop"
    assert done.usage.completion_tokens < reference["new_tokens"]
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 48, "temperature": 0, "stop": stop, "stream": True}
    events = sse_events(api["url"] + "/v1/completions", body, BOUND_S)
    assert events[-1] == "[DONE]"
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == want
    assert events[-2]["choices"][0]["finish_reason"] == "stop"


def test_raw_sse_chunks_and_usage(api):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    events = sse_events(api["url"] + "/v1/chat/completions", body, BOUND_S)
    *chunks, usage_chunk, done = events
    assert done == "[DONE]"
    assert all(c["object"] == "chat.completion.chunk" and c["usage"] is None for c in chunks)
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 5
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and chunks[-1]["choices"][0]["delta"] == {}


# ---------------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "path,body,status,param,code",
    [
        ("/v1/completions", {"model": "gpt-4", "prompt": "x"}, 404, "model", "model_not_found"),
        ("/v1/completions", {"prompt": "x", "n": 9}, 400, "n", "invalid_request"),  # HttpConfig.max_n is 8
        ("/v1/completions", {"prompt": "x", "temperature": 3}, 400, "temperature", "invalid_request"),
        ("/v1/completions", {"prompt": "x", "temperature": True}, 400, "temperature", "invalid_request"),
        ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p", "invalid_request"),
        ("/v1/completions", {"prompt": "x", "frobnicate": 1}, 400, "frobnicate", "invalid_request"),
        ("/v1/completions", {"prompt": ""}, 400, "prompt", "invalid_request"),
        ("/v1/completions", {"prompt": [1, 99999]}, 400, "prompt", "invalid_request"),
        ("/v1/completions", {"prompt": "x " * 400}, 400, "prompt", "context_length_exceeded"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 100000}, 400, "max_tokens", "invalid_request"),
        ("/v1/completions", {"prompt": "x", "stop": [""]}, 400, "stop", "invalid_request"),
        ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options",
         "invalid_request"),
        ("/v1/chat/completions", {"messages": []}, 400, "messages", "invalid_request"),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role",
         "invalid_request"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True,
                                  "top_logprobs": 21}, 400, "top_logprobs", "invalid_request"),
    ],
)  # fmt: skip
def test_errors_have_openais_shape_and_status(api, path, body, status, param, code):
    r = httpx.post(api["url"] + path, json=body, timeout=BOUND_S)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert (error["param"], error["code"]) == (param, code)
    assert error["type"] == ("invalid_request_error" if status < 500 else "server_error")


def test_a_refused_conversation_is_the_callers_400_and_a_broken_template_the_servers_500(api, monkeypatch):
    tok = api["service"].engine.tokenizer
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    monkeypatch.setattr(api["backend"], "chat", ChatFormat("{{ raise_exception('no, thanks') }}", {}, tok))
    r = httpx.post(api["url"] + "/v1/chat/completions", json=body, timeout=BOUND_S)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages" and "no, thanks" in r.text
    monkeypatch.setattr(api["backend"], "chat", ChatFormat("{% for %}", {}, tok))
    r = httpx.post(api["url"] + "/v1/chat/completions", json=body, timeout=BOUND_S)
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error" and "template" in r.text


def test_malformed_bodies_routes_and_methods(api):
    url = api["url"]
    cases = [
        (httpx.post(url + "/v1/completions", content=b"{not json"), 400),
        (httpx.post(url + "/v1/completions", content=b'{"prompt": NaN}'), 400),
        (httpx.post(url + "/v1/completions", content=b"[1, 2]"), 400),
        (httpx.post(url + "/v1/completions", content=b"x" * (5 << 20)), 413),
        (httpx.get(url + "/v1/nothing"), 404),
        (httpx.get(url + "/v1/completions"), 405),
    ]
    for r, status in cases:
        assert r.status_code == status and set(r.json()["error"]) == {"message", "type", "param", "code"}
    with pytest.raises(openai.NotFoundError):
        api["client"].chat.completions.create(model="other", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError) as e:
        api["client"].completions.create(model=MODEL, prompt="x", n=9)
    assert e.value.status_code == 400 and e.value.body["param"] == "n"


def test_at_capacity_429_and_503_with_retry_after(api):
    app, service = api["app"], api["service"]
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4}
    app.live += MAX_STREAMS  # as if that many generations were running
    try:
        r = httpx.post(api["url"] + "/v1/completions", json=body, timeout=BOUND_S)
    finally:
        app.live -= MAX_STREAMS
    assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
    assert r.json()["error"]["code"] == "rate_limit_exceeded"
    pool = service.engine.pool
    hog = service.engine.table.lend(pool.num_blocks * pool.block_size)  # every free block of the KV pool held elsewhere
    try:
        hog.reserve(pool.free_blocks * pool.block_size)
        for stream in (False, True):
            r = httpx.post(api["url"] + "/v1/completions", json=body | {"stream": stream}, timeout=BOUND_S)
            assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1
            assert r.json()["error"] == {"message": r.json()["error"]["message"], "type": "server_error",
                                         "param": None, "code": "overloaded"}  # fmt: skip
    finally:
        service.engine.table.give_back(hog)
    assert api["backend"].wait_released(BOUND_S) and service.engine.pool.used_blocks == 0
    assert httpx.post(api["url"] + "/v1/completions", json=body, timeout=BOUND_S).status_code == 200


def test_api_keys_are_required_except_for_health(api):
    keyed, port = start_http(api["service"].engine, MODEL, HttpConfig(port=0, api_keys=frozenset({"k1", "k2"})))
    try:
        url = f"http://127.0.0.1:{port}"
        assert httpx.get(url + "/health").status_code == 200
        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "Basic k1"}):
            r = httpx.get(url + "/v1/models", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0).models.list()
        client = openai.OpenAI(base_url=url + "/v1", api_key="k2", max_retries=0, timeout=BOUND_S)
        assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2).usage.completion_tokens == 2
    finally:
        keyed.stop()


# ---------------------------------------------------------------------------------------------- lifetimes


def test_a_streaming_client_that_goes_away_frees_its_generation(api):
    service, backend = api["service"], api["backend"]
    held = service.engine.pool.used_blocks
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 120, "temperature": 0, "stream": True}
    with Gate(service.engine) as gate:
        with httpx.stream("POST", api["url"] + "/v1/completions", json=body, timeout=BOUND_S) as r:
            assert r.status_code == 200
            assert gate.reached.acquire(timeout=BOUND_S)  # the generation is in flight, held at the gate
            assert service.engine.pool.used_blocks > held
        # the response is closed (the connection with it): the server notices and closes the generation
        assert backend.wait_released(BOUND_S)
    assert service.engine.pool.used_blocks == held and service.engine.plain.generating == 0 and api["app"].live == 0


def test_a_waiting_client_that_goes_away_frees_its_generation(api):
    service, backend = api["service"], api["backend"]
    held = service.engine.pool.used_blocks
    host, port = api["url"].removeprefix("http://").split(":")
    body = json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 120}).encode()
    with Gate(service.engine) as gate:
        sock = socket.create_connection((host, int(port)), timeout=BOUND_S)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip
        assert gate.reached.acquire(timeout=BOUND_S)
        sock.close()
        assert backend.wait_released(BOUND_S)
    assert service.engine.pool.used_blocks == held and api["app"].live == 0


def test_http_streams_and_a_grpc_generate_stream_at_once(api):
    """Four generations held at one gate until all four are decoding (so the batcher verifies them together), each
    with its own prompt: every one gets the tokens it gets alone."""
    service, client, stub = api["service"], api["client"], api["stub"]
    prompts = ["import os\n", "def main(argv):\n    ", "def f(x):\n"]
    alone = [client.completions.create(model=MODEL, prompt=p, max_tokens=20, temperature=0).choices[0].text
             for p in prompts]  # fmt: skip
    grpc_prompt = service.engine.tokenizer.encode("for i in range(10):\n")
    request = pb.OpenSession(prompt=grpc_prompt, max_new_tokens=20)
    grpc_alone = [t for m in stub.Generate(request) for t in m.tokens]
    batches = service.engine.metrics.batch_size.collect()[0].samples
    before = next(s.value for s in batches if s.name.endswith("_count"))
    results: dict = {}

    def http(i: int) -> None:
        stream = client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=20, temperature=0, stream=True)
        results[i] = "".join(c.choices[0].text for c in stream)

    def grpc_call() -> None:
        results["grpc"] = [t for m in stub.Generate(request) for t in m.tokens]

    with Gate(service.engine, count=4):
        threads = [threading.Thread(target=http, args=(i,)) for i in range(3)] + [threading.Thread(target=grpc_call)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(BOUND_S)
    assert [results[i] for i in range(3)] == alone and results["grpc"] == grpc_alone
    batches = service.engine.metrics.batch_size.collect()[0].samples
    assert next(s.value for s in batches if s.name.endswith("_count")) > before  # decoded through the batcher


# ---------------------------------------------------------------------------------------------- serve --drafter none


def test_serve_without_a_drafter_over_grpc_and_http():
    import signal
    import subprocess
    import sys
    from pathlib import Path

    exe = Path(sys.executable).parent / "tether-server"
    plain = ["--model", str(toy_model_dir()), "--drafter", "none"]
    cmd = [str(exe), "serve", *plain, "--port", "0", "--http-port", "0", "--device", "cpu"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        grpc_at = proc.stdout.readline().strip().removeprefix("listening on ")
        http_at = proc.stdout.readline().strip().removeprefix("http listening on ")
        with grpc.insecure_channel(grpc_at) as channel:
            stub = tether_pb2_grpc.TetherStub(channel)
            info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=BOUND_S)
            assert info.server_only and info.drafter_fingerprint == "" and info.tli_layers == 0
            assert list(info.client_part_formats) == [pb.CLIENT_PART_TOKENIZER]  # the tokenizer alone
            assert json.loads(info.chat_format_json)["builtin"]
            with pytest.raises(grpc.RpcError) as e:
                list(stub.FetchWeights(pb.FetchWeightsRequest(), timeout=BOUND_S))
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            opened = next(stub.Session(iter([pb.ClientMessage(open=pb.OpenSession(prompt=[1, 2]))]), timeout=BOUND_S))
            assert opened.error.reason == pb.REASON_NO_DRAFTER
            tokens = [t for m in stub.Generate(pb.OpenSession(prompt=[5, 6, 7], max_new_tokens=8)) for t in m.tokens]
            assert len(tokens) == 8
        r = httpx.post(f"http://{http_at}/v1/completions", json={"prompt": PROMPT, "max_tokens": 24, "temperature": 0},
                       timeout=BOUND_S)  # fmt: skip
        generate = [str(exe), "generate", *plain, "--prompt", PROMPT, "--max-new-tokens", "24", "--json"]
        generated = subprocess.run(generate + ["--device", "cpu"], capture_output=True, text=True, check=True)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == json.loads(generated.stdout)["text"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=BOUND_S) == 0
    finally:
        proc.kill()
