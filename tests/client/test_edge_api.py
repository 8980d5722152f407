"""The edge endpoint's parts that need no tether server (tether.client.edge_api, tether.client.edge_serve): which
tokens may be sent when (keep sends offline tokens at once, marked; rewind holds them until a resync decides, so
nothing sent is ever taken back), the HTTP status of each upstream refusal, the offline marks as the app renders
them in bodies and SSE chunks (counted once, on the chunk that carries their text), the server's chat format
read defensively, and the command line: its flags, an address without a port, and a server that cannot be
reached at start (one line, exit status 1)."""

import asyncio
import json
import socket
import subprocess
import sys
import threading

import grpc
import httpx
import pytest
from toy_models import toy_model_dir

from tether.client.edge_api import Release, api_error, chat_format
from tether.client.edge_serve import ServeConfig, parse_listen, read_keys
from tether.client.errors import Problem, ServerDataError
from tether.client.refusals import Refusal
from tether.client.session_types import Event
from tether.client.transport import LinkDown, ServerBusy, ServerError, SessionLost
from tether.shared.chat_template import ChatFormat
from tether.shared.openai_api import ErrorKind, Sampling, Tokens
from tether.shared.openai_app import HttpConfig, HttpServer, OpenAIApp
from tether.shared.tokenizer import Tokenizer
from tether.v1 import tether_pb2 as pb

BOUND_S = 60  # a safety net for waits that end on events


def tokens(ids, tag):
    return Event("tokens", tokens=list(ids), tag=tag)


def released(rewind: bool, events: list[Event]) -> list[Tokens]:
    sent: list[Tokens] = []
    release = Release(rewind, sent.append)
    for e in events:
        release.event(e)
    release.end()
    return sent


# ---- which tokens go out, and when ------------------------------------------------------------------------------


def test_keep_sends_offline_tokens_at_once_marked():
    events = [tokens([1], "verified"), tokens([2, 3], "verified"), Event("state"), tokens([4], "offline"),
              tokens([5], "offline"), tokens([6], "verified")]  # fmt: skip
    assert released(False, events) == [Tokens([1]), Tokens([2, 3]), Tokens([4], offline=True),
                                       Tokens([5], offline=True), Tokens([6])]  # fmt: skip


def test_rewind_sends_only_what_a_resync_kept_and_never_what_it_retracted():
    # Offline 4 5 6 7; the resync keeps 4 5 (the target agrees: the session tags them verified), retracts 6 7, and
    # the target's token 9 follows.
    events = [tokens([1, 2], "verified"), tokens([4], "offline"), tokens([5], "offline"), tokens([6], "offline"),
              tokens([7], "offline"), Event("verify", start=2, count=2), Event("retract", count=2),
              tokens([9], "verified"), tokens([10], "verified")]  # fmt: skip
    sent = released(True, events)
    assert sent == [Tokens([1, 2]), Tokens([4, 5]), Tokens([9]), Tokens([10])]
    assert not any(t.offline for t in sent)


def test_rewind_with_everything_retracted_and_an_outage_that_never_ends():
    events = [tokens([1], "verified"), tokens([4, 5], "offline"), Event("retract", count=2), tokens([8], "verified"),
              tokens([6], "offline"), tokens([7], "offline")]  # fmt: skip
    # The generation ended offline and the link did not come back: the held tokens stand, marked.
    assert released(True, events) == [Tokens([1]), Tokens([8]), Tokens([6, 7], offline=True)]


# ---- upstream refusals as HTTP errors --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("error", "kind", "retry_after"),
    [
        (ServerBusy(Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED, pb.REASON_CAPACITY, "full", 0.2)), ErrorKind.OVERLOADED,
         1.0),
        (ServerBusy(Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED, pb.REASON_KEY_QUOTA, "quota", 7.0)),
         ErrorKind.OVERLOADED, 7.0),
        (LinkDown("no answer within 2.0 s"), ErrorKind.UNREACHABLE, 2.0),
        (SessionLost("gone"), ErrorKind.UNREACHABLE, 2.0),
        (ServerError(grpc.StatusCode.INVALID_ARGUMENT, "too long", pb.REASON_TOO_LONG), ErrorKind.CONTEXT_LENGTH, 0),
        (ServerError(grpc.StatusCode.INVALID_ARGUMENT, "bad", pb.REASON_INVALID_REQUEST), ErrorKind.INVALID_REQUEST,
         0),
        (ServerError(grpc.StatusCode.UNAUTHENTICATED, "key", pb.REASON_UNAUTHENTICATED), ErrorKind.UPSTREAM, 0),
        (ServerError(grpc.StatusCode.FAILED_PRECONDITION, "model", pb.REASON_MODEL_MISMATCH), ErrorKind.UPSTREAM, 0),
        (ServerDataError(Problem.TOKEN, "token 99999 is outside the vocabulary"), ErrorKind.UPSTREAM, 0),
    ],
)  # fmt: skip
def test_upstream_refusals_map_to_openai_errors(error, kind, retry_after):
    e = api_error(error, "10.0.0.1:50051")
    assert e.kind is kind and e.retry_after_s == retry_after
    assert ("10.0.0.1:50051" in e.message) == (kind is not ErrorKind.UNREACHABLE)  # that one: the reason alone
    assert e.body()["error"]["type"] == ("server_error" if kind.status >= 500 else "invalid_request_error")
    assert (e.headers() != {}) == (kind in (ErrorKind.OVERLOADED, ErrorKind.UNREACHABLE))
    assert api_error(RuntimeError("a bug"), "x") is None  # the endpoint answers 500 and logs it


# ---- the marks as the app renders them -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_file(toy_model_dir() / "tokenizer.json")


class Scripted:
    """A Backend that yields a fixed list of chunks (the app's side of the protocol, without a server)."""

    drafts_offline = True
    model_id = "scripted"
    max_context, max_prompt_tokens, max_new_tokens = 512, 256, 64

    def __init__(self, tok: Tokenizer, chunks: list[Tokens]):
        self.chat, self.chunks = ChatFormat.builtin_for(tok), chunks

    async def generate(self, prompt: list[int], sampling: Sampling, max_tokens: int):
        for chunk in self.chunks:
            yield chunk


@pytest.fixture
def scripted_app(tok):
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    servers = []

    def start(chunks: list[Tokens]) -> str:
        config = HttpConfig(port=0)
        server = HttpServer(OpenAIApp(Scripted(tok, chunks), config), config)
        servers.append(server)
        return f"http://127.0.0.1:{server.start(loop)}"

    yield start
    for server in servers:
        server.stop()
    loop.call_soon_threadsafe(loop.stop)
    thread.join(BOUND_S)


def test_offline_tokens_are_counted_on_the_chunk_that_carries_their_text(tok, scripted_app):
    words = [tok.encode(w) for w in ("def", " read", "_config", "(path", "):\n", "    return", " path")]
    offline = {2, 3}  # the words made offline
    chunks = [Tokens(ids, offline=i in offline) for i, ids in enumerate(words)]
    url = scripted_app(chunks)
    n_offline = sum(len(words[i]) for i in offline)
    body = {"prompt": "x", "max_tokens": 64, "temperature": 0}
    done = httpx.post(url + "/v1/completions", json=body, timeout=BOUND_S).json()
    assert done["choices"][0]["tether"] == {"offline_tokens": n_offline}
    stop = "    return"  # a stop string the text holds back across tokens: what comes after is never consumed
    events = []
    with httpx.stream("POST", url + "/v1/completions", json=body | {"stream": True, "stop": stop},
                      timeout=BOUND_S) as r:  # fmt: skip
        for line in r.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line.removeprefix("data: ")))
    pieces = [(e["choices"][0]["text"], e["choices"][0]["tether"]["offline_tokens"]) for e in events]
    assert "".join(t for t, _ in pieces) == "def read_config(path):\n"
    assert sum(n for _, n in pieces) == n_offline
    assert "".join(t for t, n in pieces if n) == "_config(path"
    assert events[-1]["choices"][0]["finish_reason"] == "stop"


def test_the_servers_chat_format_is_read_defensively(tok):
    info = pb.ModelInfo()
    assert chat_format(info, tok).builtin  # an older server sends none
    info.chat_format_json = ChatFormat.builtin_for(tok).to_json()
    assert chat_format(info, tok).render([{"role": "user", "content": "hi"}]).endswith("assistant:")
    for hostile in ("{not json", "[1, 2]", json.dumps({"template": 5, "specials": {}})):
        info.chat_format_json = hostile
        with pytest.raises(ServerDataError) as e:
            chat_format(info, tok)
        assert e.value.problem == Problem.MODEL_INFO


# ---- the command line ----------------------------------------------------------------------------------------


def test_listen_addresses_and_endpoint_keys(tmp_path):
    assert parse_listen("127.0.0.1:8080") == ("127.0.0.1", 8080)
    assert parse_listen("[::1]:0") == ("::1", 0)
    for bad in ("8080", "localhost", "127.0.0.1:", "127.0.0.1:99999", "http://127.0.0.1:8080"):
        with pytest.raises(ValueError, match="HOST:PORT"):
            parse_listen(bad)
    path = tmp_path / "keys"
    path.write_text("# the laptop's apps\nk1\n\nk2\n")
    assert read_keys(("k3",), str(path)) == {"k1", "k2", "k3"}
    assert read_keys((), "") == frozenset()
    path.write_text("# nothing\n")
    with pytest.raises(ValueError, match="no API keys"):
        read_keys((), str(path))
    with pytest.raises(ValueError, match="whitespace"):
        read_keys(("a b",), "")
    assert ServeConfig().listen == "127.0.0.1:8080"  # loopback unless asked


def serve(*args: str, timeout: float = BOUND_S) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "tether.client.edge_serve", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def test_help_lists_the_session_flags_but_not_the_per_request_sampling():
    out = serve("--help").stdout
    for flag in ("--listen", "--server", "--max-streams", "--http-api-keys", "--http-api-key-file", "--policy",
                 "--backend", "--precision", "--api-key-file", "--max-new-tokens", "--final-resync-s"):  # fmt: skip
        assert flag in out, flag
    for flag in ("--temperature", "--top-p", "--top-k", "--min-p", "--presence-penalty", "--frequency-penalty",
                 "--repetition-penalty", "--logit-bias", "--stop-token-ids", "--seed", "--session-file"):  # fmt: skip
        assert flag not in out, flag
    assert "{keep,rewind}" in out


def test_an_unreachable_server_at_start_is_one_line_and_status_1(tmp_path):
    with socket.socket() as s:  # a free port, closed again: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    done = serve("--server", f"127.0.0.1:{port}", "--connect-timeout-s", "1", "--cache-dir", str(tmp_path))
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr and done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert lines == [f"connecting to 127.0.0.1:{port}", lines[-1]] and lines[-1].startswith("tether-client serve: ")
    assert f"127.0.0.1:{port}" in lines[-1]


def test_an_address_without_a_port_is_refused_in_one_line():
    done = serve("--listen", "8080")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip() == "tether-client serve: error: --listen '8080' is not HOST:PORT (for example " \
                                  "127.0.0.1:8080)"  # fmt: skip
