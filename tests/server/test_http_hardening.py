"""The OpenAI-compatible HTTP API under hostile or broken clients (tether.shared.openai_app, http_guard,
http_observe, and the server's metrics port), on a scripted backend on 127.0.0.1, no model:

- a prompt being tokenized (held at an event inside the tokenizer) or a chat being rendered does not hold the event
  loop: /health answers meanwhile;
- connections that never finish a request's head, or its body, are answered 408 and closed; past the connection cap
  a connection is answered 503 and closed at once (a bounded number of half-open sockets);
- a busy port is one OSError line, its socket closed;
- JSON nested past the recursion limit, lone surrogates, a top_k past 32 bits: 400 in OpenAI's shape; a bug: 500 and
  one log line without a traceback; an event loop's repeated errors: one line per kind and window;
- one log line and one observation per request (status, tokens, time to first token, the response id); the
  metrics port serves /metrics and 404 elsewhere.

Nothing waits on the clock: held work waits at events; the timeouts under test are short and each wait for their
effect is for an event (a socket closed by the server), with a bound only as a safety net."""

import asyncio
import json
import logging
import socket
import subprocess
import sys
import threading

import httpx
import pytest
from toy_models import toy_model_dir

from tether.server.metrics import ServiceMetrics, serve_metrics
from tether.shared.chat_template import ChatFormat
from tether.shared.http_guard import RateLimitedLog, install_loop_error_log
from tether.shared.openai_api import Sampling, Tokens
from tether.shared.openai_app import HttpConfig, HttpServer, OpenAIApp
from tether.shared.tokenizer import Tokenizer

BOUND_S = 30  # a safety net for waits that end on events


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_file(toy_model_dir() / "tokenizer.json")


class HeldChat:
    """A ChatFormat whose encode (or render) waits at `release` once `entered` is set: work held mid-way."""

    def __init__(self, chat: ChatFormat, hold: str):
        self._chat, self.hold = chat, hold
        self.entered, self.release = threading.Event(), threading.Event()

    def __getattr__(self, name):
        return getattr(self._chat, name)

    def _held(self) -> None:
        self.entered.set()
        assert self.release.wait(BOUND_S)

    def encode(self, text: str) -> list[int]:
        if self.hold == "encode":
            self._held()
        return self._chat.encode(text)

    def render(self, messages) -> str:
        if self.hold == "render":
            self._held()
        return self._chat.render(messages)


class Scripted:
    drafts_offline = False
    model_id = "scripted"
    max_context, max_prompt_tokens, max_new_tokens = 512, 256, 64

    def __init__(self, chat, chunks: list[list[int]], fail: Exception | None = None):
        self.chat, self.chunks, self.fail = chat, chunks, fail

    async def generate(self, prompt: list[int], sampling: Sampling, max_tokens: int):
        if self.fail is not None:
            raise self.fail
        for ids in self.chunks:
            yield Tokens(ids)


class Observer:
    """Collects the records; `wait(n)`: until n requests have ended (their log lines are written just before, on
    the server's side, after the client may already have its answer)."""

    def __init__(self):
        self.records = []
        self._seen = threading.Condition()

    def observe(self, record) -> None:
        with self._seen:
            self.records.append(record)
            self._seen.notify_all()

    def wait(self, n: int) -> None:
        with self._seen:
            assert self._seen.wait_for(lambda: len(self.records) >= n, BOUND_S)


@pytest.fixture
def serve(tok):
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    servers = []

    def start(backend=None, observer=None, **config) -> tuple[str, HttpServer]:
        config = HttpConfig(port=0, **config)
        backend = backend or Scripted(ChatFormat.builtin_for(tok), [tok.encode(" hello")])
        server = HttpServer(OpenAIApp(backend, config, observer), config)
        servers.append(server)
        return f"http://127.0.0.1:{server.start(loop)}", server

    start.loop = loop
    yield start
    for server in servers:
        server.stop()
    loop.call_soon_threadsafe(loop.stop)
    thread.join(BOUND_S)


def connect(url: str) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=BOUND_S)
    return sock


def read_until_closed(sock: socket.socket) -> bytes:
    data = b""
    while part := sock.recv(65536):
        data += part
    return data


# ---- nothing CPU-bound on the event loop ----------------------------------------------------------------------


@pytest.mark.parametrize("hold", ["encode", "render"])
def test_health_answers_while_a_prompt_is_tokenized_or_rendered(tok, serve, hold):
    chat = HeldChat(ChatFormat.builtin_for(tok), hold)
    url, _ = serve(Scripted(chat, [tok.encode(" hi")]))
    body = {"messages": [{"role": "user", "content": "hello " * 20}], "max_tokens": 4}
    answer = {}
    request = threading.Thread(target=lambda: answer.update(
        r=httpx.post(url + "/v1/chat/completions", json=body, timeout=BOUND_S)))  # fmt: skip
    request.start()
    try:
        assert chat.entered.wait(BOUND_S)
        assert httpx.get(url + "/health", timeout=BOUND_S).json() == {"status": "ok"}  # the loop is free
    finally:
        chat.release.set()
        request.join(BOUND_S)
    assert answer["r"].status_code == 200


def test_a_prompt_far_over_the_limit_is_refused_without_tokenizing_it(tok, serve):
    chat = HeldChat(ChatFormat.builtin_for(tok), "encode")  # tokenizing would wait at the event, never set here
    url, _ = serve(Scripted(chat, [tok.encode(" hi")]))
    size = Scripted.max_prompt_tokens * chat.max_token_bytes * 4 + 1
    for path, body in (("/v1/completions", {"prompt": "x" * size}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * size}]})):  # fmt: skip
        r = httpx.post(url + path, json=body, timeout=BOUND_S)
        assert (r.status_code, r.json()["error"]["code"]) == (400, "context_length_exceeded")
    assert not chat.entered.is_set()


# ---- connections ------------------------------------------------------------------------------------------------


def test_connections_that_never_send_their_head_get_408_and_are_closed(serve):
    url, server = serve(header_timeout_s=0.2)
    sockets = [connect(url) for _ in range(20)]
    for i, sock in enumerate(sockets):  # nothing, a partial request line, partial headers
        sock.sendall([b"", b"POST /v1/compl", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"][i % 3])
    for sock in sockets:
        reply = read_until_closed(sock)
        assert reply.startswith(b"HTTP/1.1 408 ") and b"request_timeout" in reply
        sock.close()
    assert httpx.get(url + "/health", timeout=BOUND_S).status_code == 200
    assert server.guard.timed_out == 20


def test_a_keep_alive_connection_must_send_its_next_head_in_time_too(serve):
    url, _ = serve(header_timeout_s=0.2, keep_alive_s=BOUND_S)
    sock = connect(url)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\nGET /hea")  # one request, then the start of another
    reply = read_until_closed(sock)
    assert reply.startswith(b"HTTP/1.1 200 ") and b"HTTP/1.1 408 " in reply
    sock.close()


def test_a_body_that_never_arrives_gets_408_and_the_connection_closes(serve):
    url, _ = serve(body_timeout_s=0.2)
    sock = connect(url)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 1000\r\n\r\n{\"prompt\": ")  # fmt: skip
    reply = read_until_closed(sock)
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 ") and b"connection: close" in head.lower()
    assert json.loads(body)["error"]["code"] == "request_timeout"
    sock.close()


def test_past_the_connection_cap_a_connection_is_answered_503_and_closed_at_once(serve):
    cap = 8
    url, server = serve(max_connections=cap, header_timeout_s=BOUND_S)
    held = [connect(url) for _ in range(cap)]
    for sock in held:
        sock.sendall(b"GET /health HTTP/1.1\r\n")  # half-sent: each holds its connection
    extra = [connect(url) for _ in range(3)]
    for sock in extra:
        reply = read_until_closed(sock)  # answered and closed without sending anything
        assert reply.startswith(b"HTTP/1.1 503 ") and b"overloaded" in reply
        sock.close()
    assert server.guard.refused == 3 and server.guard.cap == cap
    for sock in held:
        sock.sendall(b"Host: x\r\n\r\n")  # the held ones still work
        assert sock.recv(65536).startswith(b"HTTP/1.1 200 ")
        sock.close()


class Endless:
    """A backend generating 1,000 tokens a chunk until it is closed (then `closed` is set)."""

    drafts_offline = False
    model_id = "endless"
    max_context = max_new_tokens = 10**9
    max_prompt_tokens = 256

    def __init__(self, chat, token: int):
        self.chat, self.token, self.closed = chat, token, threading.Event()

    async def generate(self, prompt: list[int], sampling: Sampling, max_tokens: int):
        try:
            while True:
                yield Tokens([self.token] * 1000)
        finally:
            self.closed.set()


def test_a_client_that_stops_reading_its_stream_frees_the_generation_and_the_connection(tok, serve):
    backend = Endless(ChatFormat.builtin_for(tok), tok.encode(" hello")[0])
    url, server = serve(backend, send_timeout_s=0.2)
    server.guard.close_grace_s = 0.2
    sock = connect(url)
    body = json.dumps({"prompt": "x", "max_tokens": 10**8, "stream": True}).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip
    try:  # read nothing: the socket buffers fill, then the server's sends wait
        assert backend.closed.wait(BOUND_S)
        assert wait_until(lambda: server.guard.open == 0)  # aborted, its unsent data dropped, while still unread
    finally:
        sock.close()


def wait_until(condition) -> bool:
    """Whether `condition` holds within BOUND_S (checked every 10 ms: a state of the server's loop, not an event)."""
    tick = threading.Event()
    for _ in range(BOUND_S * 100):
        if condition():
            return True
        tick.wait(0.01)
    return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="file-handle limits as Linux sets them")
def test_the_connection_cap_keeps_half_the_free_file_handles_for_the_rest():
    code = ("import resource; _, hard = resource.getrlimit(resource.RLIMIT_NOFILE); "
            "resource.setrlimit(resource.RLIMIT_NOFILE, (200, hard)); "
            "from tether.shared.http_guard import connection_cap; print(connection_cap(1024))")  # fmt: skip
    cap = int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert 1 <= cap <= 100


def test_a_busy_port_is_one_oserror_line(serve, tok):
    url, _ = serve()
    port = int(url.rsplit(":", 1)[1])
    config = HttpConfig(port=port)
    server = HttpServer(OpenAIApp(Scripted(ChatFormat.builtin_for(tok), []), config), config)
    with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port}") as e:
        server.start(serve.loop)
    assert "\n" not in str(e.value)


# ---- malformed requests and bugs --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path,raw,param",
    [
        ("/v1/completions", b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", None),
        ("/v1/completions", b'{"prompt": "a\\ud800b"}', "prompt"),
        ("/v1/completions", b'{"prompt": "a", "\\udfff": 1}', "\ufffd"),
        ("/v1/completions", b'{"prompt": "a", "stop": ["\\ud83d"]}', "stop"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udc00"}]}', "messages[0].content"),
        ("/v1/completions", b'{"prompt": "a", "top_k": 1000000000000}', "top_k"),
    ],
    ids=["deep", "surrogate", "surrogate-key", "surrogate-stop", "surrogate-chat", "top_k"],
)
def test_malformed_requests_are_400_in_openais_shape(serve, path, raw, param):
    url, _ = serve()
    r = httpx.post(url + path, content=raw, headers={"Content-Type": "application/json"}, timeout=BOUND_S)
    assert r.status_code == 400
    error = r.json()["error"]
    assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", "invalid_request", param)


def test_a_bug_is_a_500_and_one_log_line_without_a_traceback(tok, serve, caplog):
    observer = Observer()
    url, _ = serve(Scripted(ChatFormat.builtin_for(tok), [], fail=RuntimeError("a bug\nwith two lines")), observer)
    with caplog.at_level(logging.INFO, logger="tether.http"):
        r = httpx.post(url + "/v1/completions", json={"prompt": "x"}, timeout=BOUND_S)
        observer.wait(1)
    assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error"
    errors = [rec for rec in caplog.records if rec.levelno >= logging.ERROR]
    assert len(errors) == 1 and errors[0].exc_info is None and "RuntimeError" in errors[0].getMessage()


def test_an_event_loops_repeated_errors_are_one_line_per_kind(caplog):
    loop = asyncio.new_event_loop()
    try:
        log = logging.getLogger("tether.http.test")
        install_loop_error_log(loop, log)
        with caplog.at_level(logging.ERROR, logger="tether.http.test"):
            for _ in range(1000):  # as asyncio reports each accept() that fails for want of file handles
                loop.call_exception_handler({"message": "socket.accept() out of system resource",
                                             "exception": OSError(24, "Too many open files")})  # fmt: skip
        assert len(caplog.records) == 1 and caplog.records[0].exc_info is None
    finally:
        loop.close()


def test_rate_limited_log_says_how_many_it_left_out(caplog):
    now = [0.0]
    limited = RateLimitedLog(logging.getLogger("tether.http.test"), window_s=10, clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="tether.http.test"):
        written = [limited.log(logging.WARNING, "k", "accept failed") for _ in range(500)]
        now[0] = 10.0
        limited.log(logging.WARNING, "k", "accept failed")
    assert written.count(True) == 1 and len(caplog.records) == 2
    assert "499 more" in caplog.records[1].getMessage()


# ---- observability ----------------------------------------------------------------------------------------------


def test_each_request_is_one_log_line_and_one_observation(tok, serve, caplog):
    observer = Observer()
    words = [tok.encode(w) for w in ("def", " f", "():")]
    url, _ = serve(Scripted(ChatFormat.builtin_for(tok), words), observer)
    with caplog.at_level(logging.INFO, logger="tether.http"):
        r = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 32}, timeout=BOUND_S)
        with httpx.stream("POST", url + "/v1/chat/completions", timeout=BOUND_S,
                          json={"messages": [{"role": "user", "content": "hi"}], "stream": True}) as s:  # fmt: skip
            assert s.status_code == 200 and s.read().endswith(b"data: [DONE]\n\n")
        assert httpx.get(url + "/nowhere", timeout=BOUND_S).status_code == 404
        observer.wait(3)
    lines = [rec for rec in caplog.records if getattr(rec, "event", None) == "http_request"]
    assert [(x.method, x.path, x.status) for x in lines] == [("POST", "/v1/completions", 200),
                                                             ("POST", "/v1/chat/completions", 200),
                                                             ("GET", "/nowhere", 404)]  # fmt: skip
    done, streamed, missing = observer.records
    n_completion = sum(map(len, words))
    assert done.session == r.json()["id"] and done.completion_tokens == n_completion and done.prompt_tokens == 1
    assert streamed.session.startswith("chatcmpl-") and streamed.completion_tokens == n_completion
    assert done.ttft_s is not None and streamed.ttft_s is not None and missing.ttft_s is None
    assert lines[0].session == done.session and lines[0].completion_tokens == n_completion


def test_the_metrics_port_serves_metrics_only_with_the_http_series(tok):
    metrics = ServiceMetrics()
    observer = Observer()
    server, _ = serve_metrics(metrics, "127.0.0.1", 0)
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        for path in ("/v1/models", "/", "/metrics/x", "/favicon.ico"):
            assert httpx.get(url + path, timeout=BOUND_S).status_code == 404
        from tether.shared.http_observe import RequestRecord

        record = RequestRecord("POST", "/v1/completions", status=200, prompt_tokens=5, completion_tokens=7,
                               ttft_s=0.01)  # fmt: skip
        metrics.http.observe(record)
        metrics.http.observe(RequestRecord("GET", "/v1/models/../../etc", status=404))
        observer.observe(record)
        text = httpx.get(url + "/metrics", timeout=BOUND_S).text
        assert 'tether_http_requests_total{path="/v1/completions",status="200"} 1.0' in text
        assert 'tether_http_requests_total{path="/v1/models/{model}",status="404"} 1.0' in text
        assert 'tether_http_tokens_total{kind="prompt"} 5.0' in text
        assert 'tether_http_tokens_total{kind="completion"} 7.0' in text
        assert "tether_http_ttft_seconds_count 1.0" in text
    finally:
        server.shutdown()
        server.server_close()


def test_serve_refuses_a_busy_http_port_in_one_line_before_loading_models():
    from tether.server.daemon import check_ports
    from tether.server.serve_config import ServeConfig
    from tether.shared.cli_support import CommandError, Refusal

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(CommandError) as e:
            check_ports(ServeConfig(port=0, http_port=port))
    assert e.value.reason is Refusal.ADDRESS_IN_USE and f"--http-port {port}" in str(e.value)
    assert "\n" not in str(e.value)
