"""The edge's HTTP API with every sampling control (tether.client.edge_api), against a real tether server on
127.0.0.1 through the netsim proxy, and what the controls look like on the wire:

- ignore_eos: end-of-text (forced first by logit_bias) ends a completion, unless ignore_eos, which runs to
  max_tokens; a stop token id still ends it; the server-only path (bench/link.py's baseline) sends it on Generate;
- penalties: presence, frequency and repetition penalties and min_p from a request's body decide its greedy tokens
  as the server's own Generate decides them under the same controls;
- logprobs: the server's for verified tokens (equal to the target's own processed distribution), the drafter's own
  for tokens drafted offline (ONNX and torch drafters), which each choice lists in "tether": {"drafter_logprobs"};
  the openai package parses the chat shape;
- n > 1: each choice is a session of its own, choice i sampling with seed + i; past the endpoint's max_n a 400;
  `tether-client serve --max-n`;
- the wire: a sampled session's open and every resync carry top_k and the other controls (logprobs and ignore_eos
  included), and every round's draft distributions keep at most top_k tokens.

Helpers come from tests/e2e/test_edge_api_e2e.py (the endpoint, cuts struck on the session's events) and
tests/e2e/test_client_controls_e2e.py (the watch on the server's RPCs). Nothing waits on the clock.
"""

import argparse
import math
import types

import grpc
import httpx
import pytest
import torch
from bench_modules import load_bench
from edge_text import run_text
from test_client_controls_e2e import OFFLINE, Watch
from test_edge_api_e2e import BOUND_S, MODEL, PROMPT, CutAfter, Endpoint

from tether.client import edge_serve
from tether.client.controls import sampling_params
from tether.client.server_only import ServerOnlySession
from tether.client.session import ClientConfig, EdgeSession
from tether.shared.sampling import token_logprobs
from tether.v1 import tether_pb2 as pb
from tether.v1 import tether_pb2_grpc

N = 8  # completion tokens of most requests here


@pytest.fixture(scope="module")
def served(start_server):
    """One watched server for the module: (address, service, watch)."""
    watch = Watch()
    address, service = start_server(watch)
    return address, service, watch


@pytest.fixture(scope="module")
def edges(served, tmp_path_factory):
    """edges(backend) -> the keep endpoint in front of the module's server drafting with `backend`, made once; each
    test sets its own observer."""
    made: dict[str, Endpoint] = {}
    cache = str(tmp_path_factory.mktemp("edge-cache"))

    def get(backend: str) -> Endpoint:
        if backend not in made:
            made[backend] = Endpoint(served[0], cache, "keep", backend=backend)
        return made[backend]

    yield get
    for endpoint in made.values():
        endpoint.close()


@pytest.fixture
def edge(edges):
    return edges("onnx")


@pytest.fixture
def emitted(edge):
    """The token ids the edge's sessions emit (one request at a time), in order."""
    assert edge.backend.wait_released(BOUND_S)
    ids: list[int] = []
    edge.observer = lambda session, e: ids.extend(e.tokens) if e.kind == "tokens" else None
    yield ids
    edge.observer = None


def complete(edge: Endpoint, **body) -> dict:
    reply = httpx.post(edge.url + "/v1/completions", json={"model": MODEL, "prompt": PROMPT, **body}, timeout=BOUND_S)
    assert reply.status_code == 200, reply.text
    return reply.json()


def eos_of(edge: Endpoint) -> int:
    return edge.backend.paired.info.eos_ids[0]


@torch.inference_mode()
def target_logprobs(service, prompt: list[int], tokens: list[int], top: int) -> list:
    """The target's greedy logprobs of `tokens` after `prompt`: one forward over the sequence, each row the
    distribution of the next position (no controls: the rule at temperature 1)."""
    cache = service.engine.target.new_cache(1, len(prompt) + len(tokens))
    rows = service.engine.target.prefill(torch.tensor([prompt + tokens[:-1]]), cache).logits[0, len(prompt) - 1 :]
    return [token_logprobs(r.float().numpy(), t, top) for r, t in zip(rows, tokens, strict=True)]


# ---- ignore_eos --------------------------------------------------------------------------------------------------


def test_ignore_eos_runs_past_end_of_text_and_a_stop_token_id_still_ends_it(edge):
    forced = {"max_tokens": N, "temperature": 0, "logit_bias": {str(eos_of(edge)): 100}}  # end-of-text first
    ended = complete(edge, **forced)
    assert (ended["choices"][0]["finish_reason"], ended["usage"]["completion_tokens"]) == ("stop", 1)
    through = complete(edge, **forced, ignore_eos=True)
    assert (through["choices"][0]["finish_reason"], through["usage"]["completion_tokens"]) == ("length", N)
    assert through["choices"][0]["text"] == ""  # end-of-text ids add no text
    stopped = complete(edge, **forced, ignore_eos=True, stop_token_ids=[eos_of(edge)])
    assert (stopped["choices"][0]["finish_reason"], stopped["usage"]["completion_tokens"]) == ("stop", 1)


def test_the_server_only_path_sends_ignore_eos_and_bench_link_asks_it(served, edge, tmp_path):
    address, service, watch = served
    watch.reset()
    eos = eos_of(edge)
    session = EdgeSession(ClientConfig(server=address, cache_dir=str(tmp_path)))
    try:
        info = session.model_info()
        lengths = []
        for ignore in (False, True):
            cfg = ClientConfig(server=address, max_new_tokens=N, logit_bias=((eos, 100.0),), ignore_eos=ignore)
            link = session.link
            run = ServerOnlySession(link.stub, link.metadata, cfg, info, service.engine.tokenizer, stop_ids=())
            lengths.append(len(run.run(service.engine.tokenizer.encode(PROMPT)).token_ids))
    finally:
        session.close()
    assert lengths == [1, N]  # Generate stops at end-of-text unless told, whatever the client's own stop ids
    assert [g.sampling.ignore_eos for g in watch.generates] == [False, True]
    link = load_bench("link")
    stand_in = types.SimpleNamespace(args=link.settings(["--quick"]), sim=types.SimpleNamespace(address=address),
                                     cache=types.SimpleNamespace(name=str(tmp_path)))  # fmt: skip
    assert sampling_params(link.Rig.config(stand_in), info).ignore_eos  # every mode's cell counts full lengths


# ---- penalties ---------------------------------------------------------------------------------------------------


def test_penalties_in_a_request_decide_its_tokens_as_on_the_server(served, edge, emitted):
    """Greedy under the penalties and min_p of the HTTP body: the edge's tokens (drafted under them, verified) are
    the server's own Generate's under the same controls, and not the plain greedy ones."""
    address, service, _ = served
    fields = dict(presence_penalty=1.0, frequency_penalty=0.5, repetition_penalty=1.3, min_p=0.05)
    complete(edge, max_tokens=2 * N, temperature=0, ignore_eos=True, **fields)
    prompt, fp = service.engine.tokenizer.encode(PROMPT), service.engine.model_fingerprint
    with grpc.insecure_channel(address) as channel:
        stub = tether_pb2_grpc.TetherStub(channel)

        def generate(**controls) -> list[int]:
            sampling = pb.SamplingParams(ignore_eos=True, **controls)
            req = pb.OpenSession(prompt=prompt, max_new_tokens=2 * N, model_fingerprint=fp, sampling=sampling)
            return [t for msg in stub.Generate(req, timeout=BOUND_S) for t in msg.tokens]

        assert emitted == generate(**fields) != generate()


# ---- logprobs ----------------------------------------------------------------------------------------------------


def test_verified_tokens_carry_the_servers_logprobs(served, edge, emitted):
    service = served[1]
    body = complete(edge, max_tokens=N, temperature=0, logprobs=3)
    choice = choice_of(body)
    want = target_logprobs(service, service.engine.tokenizer.encode(PROMPT), emitted, 3)
    lp = choice["logprobs"]
    assert len(emitted) == N and choice["tether"]["drafter_logprobs"] == []
    assert lp["token_logprobs"] == pytest.approx([e.logprob for e in want], abs=1e-3)
    text = edge.backend.chat.tokenizer.decode
    for got, expected in zip(lp["top_logprobs"], want, strict=True):
        assert got == pytest.approx({text([t]): v for t, v in expected.top}, abs=1e-3)
    chat = edge.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPT}],
                                               max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)  # fmt: skip
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(len(c.top_logprobs) == 2 for c in content)
    assert chat.choices[0].model_extra["tether"]["drafter_logprobs"] == []


def choice_of(body: dict) -> dict:
    [choice] = body["choices"]
    return choice


@pytest.mark.parametrize("backend", ["onnx", "torch"])
def test_offline_tokens_carry_the_drafters_own_logprobs_named_in_the_choice(served, edges, backend):
    service, edge = served[1], edges(backend)
    assert edge.backend.wait_released(BOUND_S)
    cut, emitted = CutAfter(edge.sim, rounds=1, offline=4), []
    edge.observer = lambda session, e: (emitted.extend(e.tokens) if e.kind == "tokens" else None, cut(session, e))
    try:
        choice = choice_of(complete(edge, max_tokens=3 * N, temperature=0, logprobs=2))
    finally:
        edge.observer = None
    assert cut.struck and cut.written >= 4
    drafted = choice["tether"]["drafter_logprobs"]
    assert drafted and drafted == list(range(drafted[0], drafted[0] + cut.written))  # the tokens written alone
    values = choice["logprobs"]["token_logprobs"]
    assert len(values) == len(emitted) and all(math.isfinite(v) and v <= 0 for v in values)
    for i in drafted:  # greedy: each token is the drafter's most probable one, so its top entry
        assert max(choice["logprobs"]["top_logprobs"][i].values()) == pytest.approx(values[i])
    want = [e.logprob for e in target_logprobs(service, service.engine.tokenizer.encode(PROMPT), emitted, 2)]
    verified = [i for i in range(len(values)) if i not in drafted]
    assert [values[i] for i in verified] == pytest.approx([want[i] for i in verified], abs=1e-3)
    assert [values[i] for i in drafted] != pytest.approx([want[i] for i in drafted], abs=1e-3)  # not the target's


# ---- n > 1 -------------------------------------------------------------------------------------------------------


def test_n_choices_are_sessions_of_their_own_each_with_its_seed(edge):
    sampled = {"max_tokens": N, "temperature": 0.9, "seed": 11}
    body = complete(edge, **sampled, n=2)
    assert [c["index"] for c in body["choices"]] == [0, 1]
    alone = [choice_of(complete(edge, **sampled | {"seed": seed}))["text"] for seed in (11, 12)]
    assert [c["text"] for c in body["choices"]] == alone
    too_many = httpx.post(edge.url + "/v1/completions", json={"model": MODEL, "prompt": PROMPT, "n": 9},
                          timeout=BOUND_S)  # fmt: skip
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "n"


def test_serve_takes_max_n():
    parser = argparse.ArgumentParser()
    edge_serve.add_arguments(parser)
    assert parser.parse_args(["--max-n", "3"]).max_n == 3 and parser.parse_args([]).max_n == 8


# ---- the wire ----------------------------------------------------------------------------------------------------


def test_a_sampled_sessions_controls_travel_on_open_and_every_resync_and_rounds_keep_top_k(served, paired_once):
    address, service, watch = served
    watch.reset(cut=True)  # the first verdict cut: OFFLINE tokens alone, then resyncs (one with the history)
    vocab = service.engine.target.cfg.vocab_size
    cfg = ClientConfig(server=address, cache_dir=paired_once, max_new_tokens=24, k=4, tree="chain", pipeline=False,
                       codec="raw", backoff_initial_s=0.01, backoff_max_s=0.05, max_offline_tokens=OFFLINE,
                       temperature=0.9, top_k=3, top_p=0.95, min_p=0.01, presence_penalty=0.2, frequency_penalty=0.1,
                       repetition_penalty=1.1, logit_bias=((13, -5.0),), stop_token_ids=(vocab - 1,), seed=3,
                       mode="hybrid", ignore_eos=True)  # fmt: skip
    events = []
    session = EdgeSession(cfg, events.append)
    session.logprobs = 2
    try:
        result = run_text(session, PROMPT)
    finally:
        session.close()
        opens, resyncs, rounds = watch.opens, watch.resyncs, watch.rounds
        watch.reset()  # no cut for the tests after this one
    p = opens[0].sampling
    assert (p.top_k, p.seed, p.ignore_eos, p.logprobs, list(p.stop_token_ids)) == (3, 3, True, 2, [vocab - 1])
    assert (p.temperature, p.top_p, p.min_p) == (pytest.approx(0.9), pytest.approx(0.95), pytest.approx(0.01))
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (
        pytest.approx(0.2), pytest.approx(0.1), pytest.approx(1.1))  # fmt: skip
    assert dict(p.logit_bias) == {13: -5.0}
    assert result.stats.resyncs == 1 and all(r.sampling == p for r in resyncs)
    assert len(resyncs) >= 2 and any(r.history for r in resyncs)
    sampled_rows = [q for r in rounds for q in r.q]
    support = [sum(p > 0 for p in q.probs) for q in sampled_rows]  # a row is `support` wide, zeros past top_k
    assert sampled_rows and all(1 <= n <= 3 for n in support) and 3 in support  # the drafter proposes under top_k
    told = [e for e in events if e.kind == "tokens"]  # every token with its logprobs, online and offline
    assert {e.tag for e in told} == {"verified", "offline"}
    assert all(len(e.logprobs) == len(e.tokens) and all(len(x.top) == 2 for x in e.logprobs) for e in told)
