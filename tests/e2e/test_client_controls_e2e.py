"""The edge client's sampling controls and end-of-text ids against a real server, watched from inside it.

- Open and Resync carry the controls in SamplingParams, and a Resync that sends the history says the prompt's
  length; Generate (a server-only stream) carries them too.
- Online, every chain sent is the drafter's processed greedy chain, each position with its own context's counts.
- Offline, the drafter writes its processed greedy text: each token the argmax of the drafter's logits after
  logit_bias and penalties counted over the text so far (the torch drafter over the same prompt states gives it).
- A generation ends at any of ModelInfo.eos_ids, not only the first, and at the request's stop token ids, on the
  edge session (verified or drafted offline) and on the server-only stream.
- Greedy under the controls, drafted by the processed rule and verified by the server, is the server's own
  processed greedy text, as chains and trees.
- The edge HTTP API hands a request's controls to its session (they reach the server's open); a control the
  server does not apply is a 400 naming it.
- A session restored from its file under a penalty goes on as if it had never stopped.
- A server that says it does not apply the controls is refused before anything is downloaded.

One server of the toy models (tests/e2e/conftest.py) serves the module; its service's methods are wrapped to
record requests and to cut the link on events (the first verdict; a resync until the client has drafted enough
alone), not on time.
"""

import asyncio
import copy
import dataclasses
import threading

import grpc
import httpx
import pytest
import torch
from edge_text import run_text
from toy_models import toy_model_dir

from tether.client.chat import Chat
from tether.client.controls import ControlsNotOffered
from tether.client.edge_api import EdgeBackend, chat_format
from tether.client.server_only import ServerOnlySession
from tether.client.session import ClientConfig, EdgeSession
from tether.server.model_loading import load
from tether.server.verifier import SequenceVerifier
from tether.shared.drafter_loading import load_drafter
from tether.shared.logits_processing import SamplingControls
from tether.shared.openai_app import HttpConfig, HttpServer, OpenAIApp
from tether.shared.speculative import DraftTree
from tether.v1 import tether_pb2 as pb

PROMPT = "def read_config(path):\n    with open(path"
OFFLINE = 10  # tokens the client drafts alone before the link comes back
BANNED = 13  # ",", which the toy model writes first and often after PROMPT
BOUND_S = 120  # a safety net for waits that end on events, never a timing assumption


class Watch:
    """Wraps a service's Session, Resync and Generate: records what the client sends; `cut` aborts the stream at
    the first verdict and refuses resyncs until they carry OFFLINE drafted tokens; the first resync let through is
    sent on under an unknown session id, so the client sends it again with the history."""

    def __init__(self):
        self.reset()

    def reset(self, cut: bool = False) -> None:
        self.cut, self.cut_done = cut, False
        self.opens: list[pb.OpenSession] = []
        self.rounds: list[pb.DraftRound] = []
        self.resyncs: list[pb.ResyncRequest] = []
        self.generates: list[pb.OpenSession] = []

    def __call__(self, service) -> None:
        session, resync, generate = service.Session, service.Resync, service.Generate

        async def Session(request_iterator, context):
            async def tap():
                async for m in request_iterator:
                    if m.HasField("open"):
                        self.opens.append(copy.deepcopy(m.open))
                    if m.HasField("round"):
                        self.rounds.append(copy.deepcopy(m.round))
                    yield m

            async for reply in session(tap(), context):
                if reply.HasField("verdict") and self.cut and not self.cut_done:
                    self.cut_done = True
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "the link is cut")
                yield reply

        async def Resync(request, context):
            self.resyncs.append(copy.deepcopy(request))
            if self.cut and len(request.offline_tokens) < 1 + OFFLINE:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "the link is still down")
            if self.cut and not request.history:
                request = copy.deepcopy(request)
                request.session_id = "0" * 32  # a session this server never had: it asks for the history
            return await resync(request, context)

        async def Generate(request, context):
            self.generates.append(copy.deepcopy(request))
            async for reply in generate(request, context):
                yield reply

        service.Session, service.Resync, service.Generate = Session, Resync, Generate


@pytest.fixture(scope="module")
def served(start_server):
    """One server for the module (each holds a KV pool of its own), watched: (address, service, watch)."""
    watch = Watch()
    address, service = start_server(watch)
    return address, service, watch


@pytest.fixture
def server(served):
    """The module's server for one test: its watch reset, and its model info as served again afterwards."""
    address, service, watch = served
    info = pb.ModelInfo()
    info.CopyFrom(service.engine.model_info)
    watch.reset()
    yield served
    service.engine.model_info.CopyFrom(info)
    watch.reset()


@pytest.fixture(scope="module")
def models():
    target, tok = load(toy_model_dir(), "cpu")
    return target, load_drafter(toy_model_dir("drafter"), target), tok


def config(address: str, cache: str, **kw) -> ClientConfig:
    return ClientConfig(server=address, cache_dir=cache, max_new_tokens=24, k=4, tree="chain", pipeline=False,
                        mode="hybrid", codec="raw", backoff_initial_s=0.01, backoff_max_s=0.05, **kw)  # fmt: skip


@torch.inference_mode()
def drafted_after(models, prompt: list[int], first: int, n: int, controls: SamplingControls) -> list[int]:
    """The torch drafter's greedy chain of n after the prompt's states and `first`, under `controls`."""
    target, drafter, _ = models
    _, delta = SequenceVerifier(target, drafter, capacity=len(prompt) + n + 8).open(prompt)
    drafter.begin(delta)
    proc = controls.processing([*prompt, first], len(prompt), target.cfg.vocab_size)
    return drafter.draft(first, n, processing=proc)[0]


def test_the_controls_travel_and_the_offline_text_is_the_drafters_processed_greedy(server, models,
                                                                                    paired_once):  # fmt: skip
    address, _, watch = server
    watch.reset(cut=True)
    prompt = models[2].encode(PROMPT)
    # Penalties strong enough to change the drafter's greedy text.
    plain = SamplingControls()
    controls = SamplingControls(presence_penalty=1.0, frequency_penalty=0.5, repetition_penalty=1.3, min_p=0.05)
    cfg = config(address, paired_once, max_offline_tokens=OFFLINE, presence_penalty=1.0, frequency_penalty=0.5,
                 repetition_penalty=1.3, min_p=0.05)  # fmt: skip
    events = []
    session = EdgeSession(cfg, events.append)
    try:
        result = run_text(session, PROMPT)
    finally:
        session.close()
    first = result.token_ids[0]  # the server's, before the cut: the drafter went on alone after it
    offline = [t for e in events if e.kind == "tokens" and e.tag == "offline" for t in e.tokens]
    want = drafted_after(models, prompt, first, OFFLINE, controls)
    assert offline == want[: len(offline)] and len(offline) == OFFLINE
    assert want != drafted_after(models, prompt, first, OFFLINE, plain)  # the controls decided drafts
    p = watch.opens[0].sampling
    assert (p.presence_penalty, p.frequency_penalty) == (1.0, 0.5) and p.repetition_penalty == pytest.approx(1.3)
    assert p.min_p == pytest.approx(0.05)
    assert all(r.sampling == p for r in watch.resyncs) and len(watch.resyncs) >= 2
    history = [r for r in watch.resyncs if r.history]
    assert history and all(r.HasField("prompt_length") and r.prompt_length == len(prompt) for r in history)
    assert not any(r.HasField("prompt_length") for r in watch.resyncs if not r.history)
    assert result.stats.resyncs == 1 and result.stats.offline_tokens == OFFLINE


@torch.inference_mode()
def test_each_online_round_is_the_drafters_processed_greedy_chain(server, models, paired_once):
    """Every chain the edge sends is the drafter's greedy chain under the controls, each position processed with
    the counts of the text through the round's root and the drafts before it: replayed with the torch drafter over
    the target's own states, round by round."""
    address, _, watch = server
    controls = SamplingControls(presence_penalty=0.8, frequency_penalty=0.4, repetition_penalty=1.2)
    session = EdgeSession(config(address, paired_once, presence_penalty=0.8, frequency_penalty=0.4,
                                 repetition_penalty=1.2))  # fmt: skip
    try:
        result = run_text(session, PROMPT)
    finally:
        session.close()
    target, drafter, tok = models
    prompt = tok.encode(PROMPT)
    verifier = SequenceVerifier(target, drafter, capacity=len(prompt) + 40, controls=controls)
    root, delta = verifier.open(prompt)
    drafter.begin(delta)
    text = [root]
    for sent in watch.rounds:
        assert sent.root == root
        proc = controls.processing([*prompt, *text], len(prompt), target.cfg.vocab_size)
        chain = drafter.draft(root, len(sent.tokens), processing=proc)[0]
        assert list(sent.tokens) == chain, len(text)
        verdict, delta = verifier.verify(DraftTree.chain(root, chain))
        drafter.commit(delta)
        text += verdict.emitted_tokens(DraftTree.chain(root, chain))
        root = text[-1]
    assert text[: len(result.token_ids)] == result.token_ids and result.stats.accepted > 0


def test_a_generation_ends_at_any_end_of_text_id_and_at_a_stop_id(server, paired_once):
    address, service, watch = server
    base = dataclasses.replace(config(address, paired_once), max_new_tokens=12)
    session = EdgeSession(base)
    try:
        plain = run_text(session, PROMPT).token_ids
    finally:
        session.close()
    eos = service.engine.tokenizer.eos_id
    assert eos not in plain[:8] and len(plain) == 12
    # The model's second end-of-text id, as a Llama 3 instruct model lists two; then a stop id of the request.
    service.engine.model_info.eos_ids[:] = [eos, plain[5]]
    for cfg, end in ((base, plain[5]), (dataclasses.replace(base, stop_token_ids=(plain[3],)), plain[3])):
        want = plain[: plain.index(end) + 1]
        session = EdgeSession(cfg)
        try:
            edge = run_text(session, PROMPT)
            tok = session.models.tokenizer
            stream = ServerOnlySession(session.link.stub, session.link.metadata, cfg, session.model_info(), tok)
            alone = stream.run(tok.encode(PROMPT))
            for result, ends in ((edge, session.stop_ids), (alone, stream.stop_ids)):
                # The id it ended at is no part of the text, which follows the prompt.
                text = result.continuation(tok, ends)
                assert (result.token_ids, text) == (want, tok.decode(want[:-1], after=tok.encode(PROMPT)))
        finally:
            session.close()
    assert list(watch.opens[-1].sampling.stop_token_ids) == [plain[3]]
    assert list(watch.generates[-1].sampling.stop_token_ids) == [plain[3]]


@torch.inference_mode()
def test_a_second_end_of_text_id_drafted_offline_ends_the_generation(server, models, paired_once):
    target, drafter, tok = models
    prompt = tok.encode(PROMPT)
    first, _ = SequenceVerifier(target, drafter, capacity=len(prompt) + 8).open(prompt)  # the server's first token
    drafts = drafted_after(models, prompt, first, OFFLINE, SamplingControls())
    end = drafts[3]
    assert end not in [first, *drafts[:3]] and end != tok.eos_id
    address, service, watch = server
    watch.reset(cut=True)
    service.engine.model_info.eos_ids[:] = [tok.eos_id, end]  # as Llama 3 instruct lists <|end_of_text|>, <|eot_id|>
    session = EdgeSession(config(address, paired_once, max_offline_tokens=OFFLINE))
    try:
        result = run_text(session, PROMPT)
    finally:
        session.close()
    assert result.token_ids == [first, *drafts[:4]] and result.tags == ["verified"] + ["offline"] * 4


def test_a_banned_token_is_never_sampled_online_or_offline(server, paired_once):
    """Sampling with a token's logit_bias at -100: the server never emits it, and neither does the drafter alone."""
    address, _, watch = server
    runs = {}
    for name, bias in (("plain", ()), ("banned", ((BANNED, -100.0),))):
        watch.reset(cut=True)
        cfg = config(address, paired_once, temperature=1.0, seed=5, max_offline_tokens=OFFLINE, logit_bias=bias)
        session = EdgeSession(dataclasses.replace(cfg, max_new_tokens=40))
        try:
            runs[name] = run_text(session, PROMPT)
        finally:
            session.close()
    assert BANNED in runs["plain"].token_ids  # it is likely at this temperature, after this prompt
    assert BANNED not in runs["banned"].token_ids and runs["banned"].stats.offline_tokens == OFFLINE


def test_greedy_under_controls_on_the_edge_equals_the_servers_own(server, paired_once):
    """Drafted under the processed rule and verified by the server with it, the edge's greedy text is the server's
    own processed greedy decoding (Generate, no drafter), as chains and as trees, drafted on onnxruntime or torch."""
    address, *_ = server
    controls = dict(presence_penalty=0.8, frequency_penalty=0.4, repetition_penalty=1.2, logit_bias=((13, -100.0),))
    for shape, backend in (("chain", "onnx"), ("tree", "onnx"), ("chain", "torch")):
        cfg = dataclasses.replace(config(address, paired_once, **controls), tree=shape, pipeline=True, backend=backend)
        session = EdgeSession(cfg)
        try:
            got = run_text(session, PROMPT)
            link, tok = session.link, session.models.tokenizer
            want = ServerOnlySession(link.stub, link.metadata, cfg, link.info, tok).run(got.prompt_ids).token_ids
            plain = ServerOnlySession(link.stub, link.metadata, config(address, paired_once), link.info,
                                      tok).run(got.prompt_ids).token_ids  # fmt: skip
        finally:
            session.close()
        assert got.token_ids == want and got.stats.accepted > 0, (shape, backend)
        assert want != plain and 13 not in want


def test_a_chats_turn_under_a_penalty_is_a_fresh_sessions_reply(server, paired_once):
    """Under a penalty a turn opens a new server session over the whole conversation (extended, the server would
    count the turn's tokens as generated), so its reply is a fresh session's."""
    address, *_ = server
    cfg = dataclasses.replace(config(address, paired_once, presence_penalty=0.6, frequency_penalty=0.3),
                              max_new_tokens=12)  # fmt: skip
    session = EdgeSession(cfg)
    session.pair()
    chat = Chat(session, chat_format(session.info, session.models.tokenizer))
    try:
        replies = [chat.reply(text) for text in ("def add(a, b):", "and subtract?")]
    finally:
        chat.close()
    assert [r.stats.reopened for r in replies] == [0, 1]
    fresh = EdgeSession(cfg)
    try:
        fresh.pair()
        fresh.stop_ids |= chat.conversation.format.stop_ids
        assert fresh.run(list(replies[1].prompt_ids)).token_ids == replies[1].token_ids
    finally:
        fresh.close()


class Killed(Exception):
    """The client dies mid-generation (its session file written)."""


@pytest.mark.parametrize("policy", ["keep", "rewind"])
def test_a_session_restored_under_a_penalty_goes_on_as_if_never_stopped(server, paired_once, tmp_path,
                                                                         policy):  # fmt: skip
    """Restored from its session file, a penalised greedy generation ends as the uninterrupted one: the new server
    session counts the generated text as generated (it is absorbed after an open over the prompt alone)."""
    address, *_ = server
    cfg = config(address, paired_once, presence_penalty=0.8, frequency_penalty=0.4, policy=policy)
    session = EdgeSession(cfg)
    try:
        whole = run_text(session, PROMPT).token_ids
    finally:
        session.close()
    saved = dataclasses.replace(cfg, session_file=str(tmp_path / f"{policy}.json"))

    def die(e):
        if e.kind == "tokens" and len(first.tokens) >= 9:
            raise Killed

    first = EdgeSession(saved, die)
    with pytest.raises(Killed):
        run_text(first, PROMPT)
    first.close()
    again = EdgeSession(saved)
    try:
        result = run_text(again, PROMPT)
    finally:
        again.close()
    assert result.token_ids == whole and result.stats.retracted == 0 and result.stats.resyncs == 1


def test_the_edge_api_passes_a_requests_controls_to_its_session(server, paired_once):
    address, _, watch = server
    backend = EdgeBackend.connect(config(address, paired_once))
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    http_config = HttpConfig(port=0)
    server = HttpServer(OpenAIApp(backend, http_config), http_config)
    url = f"http://127.0.0.1:{server.start(loop)}/v1/completions"
    body = {
        "prompt": PROMPT,
        "max_tokens": 12,
        "temperature": 0,
        "top_k": 7,
        "min_p": 0.1,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.25,
        "repetition_penalty": 1.2,
        "logit_bias": {"13": -100},
        "stop_token_ids": [2],
    }
    try:
        reply = httpx.post(url, json=body, timeout=BOUND_S)
        assert reply.status_code == 200, reply.text
        p = watch.opens[-1].sampling
        assert (p.top_k, p.presence_penalty, p.frequency_penalty, dict(p.logit_bias)) == (7, 0.5, 0.25, {13: -100})
        assert (p.min_p, p.repetition_penalty) == (pytest.approx(0.1), pytest.approx(1.2))
        assert list(p.stop_token_ids) == [2]
        backend.paired.info.sampling_controls = False  # as a server older than the controls says
        reply = httpx.post(url, json=body | {"presence_penalty": 0.5}, timeout=BOUND_S)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "min_p", reply.text
        assert "does not apply" in reply.json()["error"]["message"]
        opened = len(watch.opens)
        plain = {k: body[k] for k in ("prompt", "max_tokens", "temperature", "top_k")}
        reply = httpx.post(url, json=plain, timeout=BOUND_S)
        assert reply.status_code == 200, reply.text  # temperature and top_k: every server applies them
        assert len(watch.opens) == opened + 1
    finally:
        server.stop()
        backend.stop_all()
        assert backend.wait_released(BOUND_S)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(BOUND_S)


def test_a_server_that_does_not_apply_the_controls_is_refused_before_a_download(server, tmp_path):
    address, service, _ = server
    service.engine.model_info.sampling_controls = False  # as a server older than the controls says
    session = EdgeSession(config(address, str(tmp_path), presence_penalty=0.5))
    try:
        with pytest.raises(ControlsNotOffered, match="presence_penalty"):
            session.pair()
        info = session.model_info()
        with pytest.raises(ControlsNotOffered, match="presence_penalty"):
            ServerOnlySession(session.link.stub, session.link.metadata, session.cfg, info, service.engine.tokenizer)
    finally:
        session.close()
    assert not any(tmp_path.iterdir())  # nothing was downloaded
