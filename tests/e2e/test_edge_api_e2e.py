"""The edge's OpenAI-compatible endpoint (tether.client.edge_api, `tether-client serve`) against a real tether server
on 127.0.0.1, through the netsim proxy, driven by the official `openai` package and by raw SSE over httpx.

- greedy completions equal `tether-server generate --drafter none`, streamed or not; chat with the server's
  template; usage, stop strings, seeded sampling, top_k; the server's limits and refusals as OpenAI errors (503
  with Retry-After for a full or unreachable server); --max-streams (429) with concurrent sessions each getting
  the text they get alone;
- a client that goes away, or a stop string, stops its session, which closes its server session;
- the link cut mid-answer: under keep the answer completes with the offline tokens marked, then is verified
  again; under rewind only verified text is sent and it equals plain greedy decoding; under rewind with the link
  never back, the held text is sent at the end, marked;
- the command itself: `python -m tether.client.edge_serve` pairs, listens, answers and stops on SIGTERM.

Nothing waits on the clock: faults strike on the session's events (after its Nth verified round; the link comes
back when it tries to resync having written M tokens alone), generations that must be in flight are held at a gate
in the session's event callback, and every wait has a bound only as a safety net.
"""

import asyncio
import contextlib
import json
import signal
import socket
import subprocess
import sys
import threading

import httpx
import openai
import pytest
from sse import sse_events
from toy_models import toy_model_dir

from tether.client.edge_api import EdgeBackend
from tether.client.session import ClientConfig, EdgeSession, Event, State
from tether.netsim.proxy import NetSimThread
from tether.server.generate import GenerateConfig, generate_text
from tether.shared.openai_app import HttpConfig, HttpServer, OpenAIApp

MODEL = "tether-default"
PROMPT = "class Parser:\n    def __init__(self"
LONG_PROMPT = "def read_config(path):\n    with open(path"
N = 48
N_LONG = 100
MAX_OFFLINE = 16  # tokens a session writes alone in one outage before it waits for the link
BOUND_S = 120  # a safety net for waits that end on events, never a timing assumption


def plain(prompt: str, n: int) -> dict:
    """`tether-server generate --drafter none` (its function): the text greedy must equal."""
    return generate_text(GenerateConfig(model=str(toy_model_dir()), prompt=prompt, drafter="none", max_new_tokens=n,
                                        device="cpu"))  # fmt: skip


@pytest.fixture(scope="module")
def reference():
    return plain(PROMPT, N)


@pytest.fixture(scope="module")
def reference_long():
    return plain(LONG_PROMPT, N_LONG)


class Endpoint:
    """The edge endpoint for a server, through a netsim proxy (`sim`); `observer(session, event)` sees every event
    of every session, on its worker thread."""

    def __init__(self, address: str, cache_dir: str, policy: str, max_streams: int = 2, **overrides):
        self.sim = NetSimThread(("127.0.0.1", 0), address)
        self.sim.start()
        settings = dict(round_timeout_s=60.0, connect_timeout_s=30.0, backoff_initial_s=0.05, backoff_max_s=0.4,
                        max_offline_tokens=MAX_OFFLINE, max_new_tokens=128) | overrides  # fmt: skip
        cfg = ClientConfig(mode="hybrid", server=self.sim.address, cache_dir=cache_dir, policy=policy, **settings)
        self.observer = None
        self.backend = EdgeBackend.connect(cfg, observe=lambda s, e: self.observer and self.observer(s, e))
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        config = HttpConfig(port=0, max_streams=max_streams)
        self.app = OpenAIApp(self.backend, config)
        self.http = HttpServer(self.app, config)
        self.url = f"http://127.0.0.1:{self.http.start(self.loop)}"
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=BOUND_S)

    def close(self) -> None:
        self.http.stop()
        self.backend.stop_all()
        self.sim.restore()
        assert self.backend.wait_released(BOUND_S)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(BOUND_S)
        self.sim.stop()


@pytest.fixture(scope="module")
def upstream(start_server):
    return start_server()


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("edge-cache"))


@pytest.fixture(scope="module")
def endpoints(upstream, cache):
    """endpoints(policy, **config) -> an Endpoint for the module's server, made once per configuration."""
    made: dict = {}

    def get(policy: str, **overrides) -> Endpoint:
        key = (policy, tuple(sorted(overrides.items())))
        if key not in made:
            made[key] = Endpoint(upstream[0], cache, policy, **overrides)
        return made[key]

    yield get
    for endpoint in made.values():
        endpoint.close()


@pytest.fixture
def keep(endpoints):
    """The keep endpoint, with no session of an earlier test still running (each observer sees only its own)."""
    endpoint = endpoints("keep")
    assert endpoint.backend.wait_released(BOUND_S)
    yield endpoint
    endpoint.observer = None


def offline_marks(chunks) -> list[tuple[str, int]]:
    """(text, offline tokens) of each streamed completion chunk that has a choice (openai package objects)."""
    return [(c.choices[0].text, c.choices[0].model_extra["tether"]["offline_tokens"]) for c in chunks if c.choices]


# ---- faults and gates, struck on the sessions' events ------------------------------------------------------------


class CutAfter:
    """Cuts the link once the session has verified `rounds` rounds; restores it when the session tries to resync
    having written `offline` tokens alone (or unable to write more), unless `forever`. `written` counts the
    tokens it wrote alone."""

    def __init__(self, sim: NetSimThread, rounds: int = 2, offline: int = 8, forever: bool = False):
        self.sim, self.rounds, self.offline, self.forever = sim, rounds, offline, forever
        self.struck = self.restored = False
        self.written = 0
        self.sessions: list[EdgeSession] = []

    def __call__(self, session: EdgeSession, e: Event) -> None:
        if session not in self.sessions:
            self.sessions.append(session)
        assert self.sessions == [session], "one session at a time"
        if e.kind == "tokens" and e.tag == "offline":
            self.written += len(e.tokens)
        between_rounds = e.kind == "tokens" and e.tag == "verified" and session.state == State.ONLINE
        if not self.struck and between_rounds and session.stats.rounds >= self.rounds:
            self.struck = True
            self.sim.cut()
        elif self.struck and not (self.restored or self.forever) and e.kind == "state" and e.state == State.RESYNCING:
            if self.written >= self.offline or session.resync.offline_run >= MAX_OFFLINE or session.done:
                self.restored = True
                self.sim.restore()


class Hold:
    """Holds each session's worker at the first "tokens" event after it has emitted `after` tokens, until `go` is
    set: a generation known to be in flight. `reached` is released once per session held."""

    def __init__(self, go: threading.Event, after: int = 1):
        self.go, self.after = go, after
        self.reached = threading.Semaphore(0)
        self.sessions: list[EdgeSession] = []
        self.ids: list[str] = []  # their server sessions' ids (a session forgets its id once it has closed it)
        self.released: list[bool] = []

    def __call__(self, session: EdgeSession, e: Event) -> None:
        if e.kind != "tokens" or session in self.sessions or len(session.tokens) - len(e.tokens) < self.after:
            return
        self.sessions.append(session)  # its tokens so far have been handed to the app: only this event waits
        self.ids.append(session.link.session_id)
        self.reached.release()
        self.released.append(self.go.wait(BOUND_S))


@pytest.fixture
def stopped(monkeypatch) -> threading.Event:
    """Set when any session is asked to stop (EdgeSession.stop: the app closed its generation)."""
    event, real = threading.Event(), EdgeSession.stop

    def stop(self):
        event.set()
        real(self)

    monkeypatch.setattr(EdgeSession, "stop", stop)
    return event


def closed_on_the_server(endpoint: Endpoint, service, ids: list[str]) -> bool:
    assert endpoint.backend.wait_released(BOUND_S)
    held = service.engine.sessions
    return bool(ids) and all(i and i not in held for i in ids)


# ---- basics --------------------------------------------------------------------------------------------------


def test_models_and_health(keep):
    assert [m.id for m in keep.client.models.list().data] == [MODEL]
    assert httpx.get(keep.url + "/health").json() == {"status": "ok"}


def test_greedy_completion_equals_tether_server_generate(keep, reference):
    done = keep.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=N, temperature=0)
    assert done.choices[0].text == reference["text"]
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (reference["prompt_tokens"],
                                                                        reference["new_tokens"])  # fmt: skip
    assert done.choices[0].model_extra["tether"] == {"offline_tokens": 0}
    chunks = list(keep.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=N, temperature=0, stream=True))
    marks = offline_marks(chunks)
    assert "".join(t for t, _ in marks) == reference["text"] and all(n == 0 for _, n in marks)
    assert chunks[-1].choices[0].finish_reason == done.choices[0].finish_reason


def test_chat_streaming_and_not_with_the_servers_template(keep, upstream):
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "import os"}]
    done = keep.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    chat = upstream[1].engine.chat_format
    assert done.usage.prompt_tokens == len(chat.encode(chat.render(messages)))
    assert done.choices[0].message.role == "assistant" and done.object == "chat.completion"
    chunks = list(keep.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0,
                                                      stream=True, stream_options={"include_usage": True}))  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == done.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == done.usage.completion_tokens


def test_raw_sse_chunks_carry_the_offline_field(keep):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    *chunks, usage_chunk, done = sse_events(keep.url + "/v1/chat/completions", body, BOUND_S)
    assert done == "[DONE]" and usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 5
    assert all(c["choices"][0]["tether"] == {"offline_tokens": 0} for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_seeded_sampling_is_reproducible_and_top_k_one_is_greedy(keep, reference):
    def sample(seed: int) -> str:
        out = keep.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0.9, top_p=0.95,
                                             seed=seed, extra_body={"top_k": 40})  # fmt: skip
        return out.choices[0].text

    assert sample(7) == sample(7)
    assert len({sample(s) for s in range(4)}) > 1
    # top_k 1 leaves the target's argmax alone: the server's verdicts make sampling greedy, whatever was drafted
    done = keep.client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=N, temperature=1.5, seed=3,
                                          extra_body={"top_k": 1})  # fmt: skip
    assert done.choices[0].text == reference["text"]


# ---- limits and refusals ---------------------------------------------------------------------------------------


def test_the_servers_limits_and_refusals_as_openai_errors(keep, upstream):
    url, service = keep.url + "/v1/completions", upstream[1]
    too_long = httpx.post(url, json={"prompt": "x " * (service.config.max_prompt_tokens + 8)}, timeout=BOUND_S)
    assert too_long.status_code == 400 and too_long.json()["error"]["code"] == "context_length_exceeded"
    assert httpx.post(url, json={"prompt": "x", "max_tokens": 129}, timeout=BOUND_S).status_code == 400
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4}
    pool = service.engine.pool
    hog = service.engine.table.lend(pool.num_blocks * pool.block_size)  # every free block of the server's KV pool taken
    try:
        hog.reserve(pool.free_blocks * pool.block_size)
        for stream in (False, True):
            r = httpx.post(url, json=body | {"stream": stream}, timeout=BOUND_S)
            assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1, r.text
            assert r.json()["error"]["code"] == "overloaded" and "full" in r.json()["error"]["message"]
    finally:
        service.engine.table.give_back(hog)
    keep.sim.cut()  # the server cannot be reached: nothing can be drafted before it has verified the prompt
    try:
        r = httpx.post(url, json=body, timeout=BOUND_S)
    finally:
        keep.sim.restore()
    assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1
    assert r.json()["error"]["code"] == "server_unreachable" and r.json()["error"]["message"] == "server unreachable"
    assert httpx.post(url, json=body, timeout=BOUND_S).status_code == 200


def test_max_streams_and_concurrent_sessions_each_get_their_own_text(keep):
    prompts = ["import os\n", "def main(argv):\n    "]
    alone = [keep.client.completions.create(model=MODEL, prompt=p, max_tokens=20, temperature=0).choices[0].text
             for p in prompts]  # fmt: skip
    go = threading.Event()
    hold = Hold(go)
    keep.observer = hold
    results: dict = {}

    def stream(i: int) -> None:
        chunks = keep.client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=20, temperature=0,
                                                stream=True)  # fmt: skip
        results[i] = "".join(c.choices[0].text for c in chunks)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    try:
        for _ in threads:
            assert hold.reached.acquire(timeout=BOUND_S)  # both generations in flight: the endpoint's limit
        third = httpx.post(keep.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=BOUND_S)
        assert third.status_code == 429 and int(third.headers["retry-after"]) >= 1
    finally:
        go.set()
        for t in threads:
            t.join(BOUND_S)
    assert [results[0], results[1]] == alone and hold.released == [True, True]


# ---- lifetimes -------------------------------------------------------------------------------------------------


def test_a_streaming_client_that_goes_away_stops_its_session(keep, upstream, stopped):
    hold = Hold(stopped)
    keep.observer = hold
    body = {"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": N_LONG, "temperature": 0, "stream": True}
    with httpx.stream("POST", keep.url + "/v1/completions", json=body, timeout=BOUND_S) as r:
        assert r.status_code == 200
        assert hold.reached.acquire(timeout=BOUND_S)  # in flight, held until the app stops it
    assert stopped.wait(BOUND_S) and closed_on_the_server(keep, upstream[1], hold.ids)
    assert hold.released == [True] and len(hold.sessions[0].tokens) < N_LONG and keep.app.live == 0


def test_a_waiting_client_that_goes_away_stops_its_session(keep, upstream, stopped):
    hold = Hold(stopped)
    keep.observer = hold
    host, port = keep.url.removeprefix("http://").split(":")
    body = json.dumps({"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": N_LONG}).encode()
    with socket.create_connection((host, int(port)), timeout=BOUND_S) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip
        assert hold.reached.acquire(timeout=BOUND_S)
    assert stopped.wait(BOUND_S) and closed_on_the_server(keep, upstream[1], hold.ids)
    assert hold.released == [True] and len(hold.sessions[0].tokens) < N_LONG


def test_a_stop_string_ends_the_generation_and_its_server_session(keep, upstream, reference_long, stopped):
    text = reference_long["text"]
    stop = text[40:44]
    want = text[: text.index(stop)]
    covering = next(n for n in range(1, N_LONG + 1)
                    if stop in upstream[1].engine.tokenizer.decode(reference_long["token_ids"][:n]))  # fmt: skip
    hold = Hold(stopped, after=covering)  # the text holding the stop string was sent; nothing more until stopped
    sessions: list[EdgeSession] = []
    ids: list[str] = []

    def observe(session: EdgeSession, e: Event) -> None:
        if session not in sessions and session.link.session_id:
            sessions.append(session)
            ids.append(session.link.session_id)
        hold(session, e)

    keep.observer = observe
    done = keep.client.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=N_LONG, temperature=0,
                                          stop=stop)  # fmt: skip
    assert done.choices[0].text == want and done.choices[0].finish_reason == "stop"
    # The session stopped before its next event, or was held there until it did: it never ran to max_tokens.
    assert stopped.wait(BOUND_S) and all(hold.released)
    assert len(sessions[0].tokens) < N_LONG and closed_on_the_server(keep, upstream[1], ids)


# ---- the link down mid-answer ----------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_keep_answers_through_an_outage_with_the_offline_tokens_marked(keep, stream):
    cut = CutAfter(keep.sim)
    keep.observer = cut
    request = dict(model=MODEL, prompt=LONG_PROMPT, max_tokens=N_LONG, temperature=0)
    if stream:
        marks = offline_marks(list(keep.client.completions.create(**request, stream=True)))
        offline = sum(n for _, n in marks)
        shape = "".join("o" if n else "v" for t, n in marks if t)
        assert shape.strip("v") == "o" * len(shape.strip("v")) and shape.startswith("v"), shape
    else:
        done = keep.client.completions.create(**request)
        offline = done.choices[0].model_extra["tether"]["offline_tokens"]
    assert cut.struck and cut.restored and cut.written >= 8
    session = cut.sessions[0]
    # Streamed, each chunk's count was true when it went out; the whole body comes after the resync that kept them.
    assert offline == (cut.written if stream else 0) and session.stats.resyncs >= 1
    assert session.tags.count("offline") == 0  # the resync kept them: the session tags them verified now
    assert session.tags[-1] == "verified", session.tags  # the answer went on, verified again once the link was back


def test_rewind_sends_only_verified_text_which_equals_plain_greedy(endpoints, reference_long):
    rewind = endpoints("rewind")
    cut = CutAfter(rewind.sim)
    rewind.observer = cut
    try:
        chunks = list(rewind.client.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=N_LONG,
                                                       temperature=0, stream=True))  # fmt: skip
    finally:
        rewind.observer = None
    marks = offline_marks(chunks)
    assert cut.struck and cut.restored and cut.written >= 8 and cut.sessions[0].stats.resyncs >= 1
    assert all(n == 0 for _, n in marks)  # what was drafted offline waited for the resync's verdict
    assert "".join(t for t, _ in marks) == reference_long["text"]


def test_rewind_with_the_link_never_back_sends_the_held_text_marked(start_server, cache, reference_long):
    address, _ = start_server()  # its own server: this test leaves a session there, unreachable to close
    endpoint = Endpoint(address, cache, "rewind", final_resync_s=0.0, max_offline_tokens=0)
    cut = CutAfter(endpoint.sim, forever=True)
    endpoint.observer = cut
    try:
        chunks = list(endpoint.client.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=N_LONG,
                                                         temperature=0, stream=True))  # fmt: skip
    finally:
        endpoint.close()
    marks = offline_marks(chunks)
    verified = "".join(t for t, n in marks if n == 0)
    assert cut.struck and cut.written > 0 and sum(n for _, n in marks) == cut.written
    assert reference_long["text"].startswith(verified)  # the text before the outage, then the offline text, marked
    assert [bool(n) for t, n in marks if t] == sorted(bool(n) for t, n in marks if t)


# ---- the command ------------------------------------------------------------------------------------------------


def test_the_command_pairs_listens_answers_and_stops_on_sigterm(upstream, tmp_path, reference):
    cmd = [sys.executable, "-m", "tether.client.edge_serve", "--listen", "127.0.0.1:0", "--server", upstream[0],
           "--cache-dir", str(tmp_path), "--round-timeout-s", "60", "--policy", "rewind"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("listening on http://127.0.0.1:") and "policy rewind" in line, proc.stderr.read()
        base = line.split()[2]
        client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=BOUND_S)
        done = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=N, temperature=0)
        assert done.choices[0].text == reference["text"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=BOUND_S) == 0
        assert "Traceback" not in proc.stderr.read()
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        proc.wait(BOUND_S)


def test_the_torch_backend_shares_its_weights_between_concurrent_sessions(endpoints, reference):
    torch_backend = endpoints("keep", backend="torch")
    prompts = [PROMPT, "import os\n"]
    alone = [plain(p, N)["text"] for p in prompts]
    results: dict = {}

    def complete(i: int) -> None:
        out = torch_backend.client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=N, temperature=0)
        results[i] = out.choices[0].text

    go = threading.Event()
    hold = Hold(go)  # both sessions drafted their first round before either goes on: their caches interleave
    torch_backend.observer = hold
    threads = [threading.Thread(target=complete, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    try:
        for _ in threads:
            assert hold.reached.acquire(timeout=BOUND_S)
    finally:
        go.set()
        for t in threads:
            t.join(BOUND_S)
        torch_backend.observer = None
    assert [results[0], results[1]] == alone and alone[0] == reference["text"]
