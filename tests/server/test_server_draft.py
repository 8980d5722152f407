"""Server-side speculation (`serve --server-draft`, tether.server.server_draft) against plain decoding, both over
real gRPC and HTTP on 127.0.0.1 with the toy models: two engines over the same models, one decoding plainly, one
drafting with the MoA drafter on the server.

- Greedy Generate and the HTTP API give plain decoding's tokens, with the sampling controls, stop ids, lengths and
  log-probabilities, and the engine did draft (rounds with accepted drafts).
- Sampled Generate follows plain sampling's distribution: a two-sample chi-square over fixed seeds (so the outcome
  is fixed for given code), as tests/e2e/test_sampling_wire.py does for the edge; the same statistic tells sampling
  at another temperature (or without the controls) apart, so it has power.
- Several streams at once, held until all are decoding so their rounds go through the batcher together: each gets
  its own plain text, and every KV block goes back.
- `--drafter none` with `--server-draft` is refused before anything loads, as are the other combinations it cannot
  run; the engine's start says the mode is on.

Nothing here waits on the clock: streams that must overlap are held at an event, and every wait has a bound only as a
safety net."""

import logging
import os
import threading

import grpc
import httpx
import pytest
from chi_square import chi_square_p
from held_decoding import Gate
from toy_models import load_toy_pair

from tether.server.cli import main
from tether.server.engine_core import Engine
from tether.server.http_api import start_http
from tether.server.rpc_server import make_server
from tether.server.serve_config import ServeConfig, ServiceConfig, service_config
from tether.server.service import TetherService
from tether.shared import env
from tether.shared.openai_app import HttpConfig
from tether.v1 import tether_pb2 as pb
from tether.v1 import tether_pb2_grpc

pytestmark = pytest.mark.heavy  # a long file, started first (tests/conftest.py)

K = 3  # draft tokens a round
MODEL = "tether-default"
PROMPTS = ("class Parser:\n    def __init__(self", "def fib(n):\n    ", "import os\nimport")
SAMPLED = "    def __init__(self, "  # at T=1 its next tokens spread over several likely ones
SAMPLES = 160  # generations per side
POSITIONS = (1, 2, 3)  # token 0 is the prefill's sample either way; these pass through drafts and verdicts
P_MIN = 1e-3  # each position's chi-square p-value must exceed this (and the power check's fall below it)
BOUND_S = 120  # a safety net for waits that end on events, never a timing assumption


@pytest.fixture(scope="module")
def servers():
    target, tok, drafter, fp = load_toy_pair()
    config = ServiceConfig(max_prompt_tokens=256, max_new_tokens=128, model_id=MODEL)
    up, out = [], {"tok": tok, "fp": fp}
    for name, k in (("plain", 0), ("drafted", K)):
        service = TetherService(Engine(target, drafter, tok, config, model_fingerprint=fp, server_draft=k))
        server, port = make_server(service, "127.0.0.1:0")
        server.start()
        http, http_port = start_http(service.engine, MODEL, HttpConfig(port=0))
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        out[name] = {"engine": service.engine, "stub": tether_pb2_grpc.TetherStub(channel),
                     "url": f"http://127.0.0.1:{http_port}"}  # fmt: skip
        up.append((server, http, channel))
    yield out
    for server, http, channel in up:
        channel.close()
        http.stop()
        server.stop(grace=None)


def generate(servers, name: str, prompt: list[int], n: int, **sampling) -> tuple[list[int], list]:
    """One Generate stream: its tokens and their log-probability entries."""
    req = pb.OpenSession(prompt=prompt, max_new_tokens=n, model_fingerprint=servers["fp"],
                         sampling=pb.SamplingParams(**sampling))  # fmt: skip
    tokens, logprobs = [], []
    for msg in servers[name]["stub"].Generate(req, timeout=BOUND_S):
        tokens += msg.tokens
        logprobs += msg.logprobs
    return tokens, logprobs


# ---------------------------------------------------------------------------------------------- greedy


def test_greedy_generate_gives_plain_decodings_tokens(servers):
    stats = servers["drafted"]["engine"].decoding.stats
    rounds, accepted = stats.rounds, stats.accepted
    for text in PROMPTS:
        prompt = servers["tok"].encode(text)
        for n in (1, 2, K + 1, 48):
            want, _ = generate(servers, "plain", prompt, n)
            assert generate(servers, "drafted", prompt, n)[0] == want, (text, n)
    assert stats.rounds > rounds and stats.accepted > accepted  # it drafted, and drafts were taken


def test_greedy_controls_stops_and_logprobs_as_plain_decoding(servers):
    prompt = servers["tok"].encode(PROMPTS[0])
    controls = dict(presence_penalty=0.8, frequency_penalty=0.4, repetition_penalty=1.3, logit_bias={13: 2.0}, top_k=5)
    want, _ = generate(servers, "plain", prompt, 48, **controls)
    stop = want[20]  # a token the text reaches: it ends the generation there, itself the last one sent
    for sampling in (controls, {**controls, "stop_token_ids": [stop]}, {**controls, "ignore_eos": True}):
        plain, plain_lp = generate(servers, "plain", prompt, 48, logprobs=3, **sampling)
        drafted, drafted_lp = generate(servers, "drafted", prompt, 48, logprobs=3, **sampling)
        assert drafted == plain and len(drafted_lp) == len(plain_lp) == len(plain)
        for a, b in zip(drafted_lp, plain_lp, strict=True):
            assert a.token == b.token and a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert list(a.top_ids) == list(b.top_ids) and a.top_logprobs == pytest.approx(b.top_logprobs, abs=1e-4)
    assert generate(servers, "drafted", prompt, 48, stop_token_ids=[stop], **controls)[0][-1] == stop


def test_http_api_gives_plain_decodings_text(servers):
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 48, "temperature": 0}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "def fib(n):"}], "max_tokens": 32,
            "temperature": 0}  # fmt: skip
    for path, request in (("/v1/completions", body), ("/v1/chat/completions", chat)):
        replies = [httpx.post(servers[name]["url"] + path, json=request, timeout=BOUND_S).json()
                   for name in ("plain", "drafted")]  # fmt: skip
        plain, drafted = replies
        assert drafted["choices"] == plain["choices"] and drafted["usage"] == plain["usage"], path
    assert plain["usage"]["completion_tokens"] > 0


# ---------------------------------------------------------------------------------------------- sampling


def samples(servers, name: str, seeds: range, temperature: float, **controls) -> list[list[int]]:
    prompt = servers["tok"].encode(SAMPLED)
    return [generate(servers, name, prompt, 1 + max(POSITIONS), temperature=temperature, top_p=1.0, seed=seed,
                     **controls)[0] for seed in seeds]  # fmt: skip


def test_sampling_follows_plain_samplings_distribution(servers):
    drafted = samples(servers, "drafted", range(SAMPLES), 1.0)
    # Seeds disjoint from the drafted side's: the prefill samples the first token with the same generator either way.
    plain = samples(servers, "plain", range(10_000, 10_000 + SAMPLES), 1.0)
    cooler = samples(servers, "plain", range(20_000, 20_000 + SAMPLES), 0.6)
    for p in POSITIONS:
        assert chi_square_p([d[p] for d in drafted], [s[p] for s in plain]) > P_MIN, p
    assert min(chi_square_p([d[p] for d in drafted], [s[p] for s in cooler]) for p in POSITIONS) < P_MIN


def test_sampling_under_the_controls_follows_plain_samplings_distribution(servers):
    """Penalties, top_k and min_p, and a logit_bias that pushes plain sampling's commonest later token down."""
    plain = samples(servers, "plain", range(10_000, 10_000 + SAMPLES), 1.0)
    later = [s[p] for s in plain for p in POSITIONS]
    common = max(set(later), key=later.count)
    controls = dict(presence_penalty=0.8, frequency_penalty=0.6, repetition_penalty=1.4, logit_bias={common: -2.0},
                    top_k=40, min_p=0.02)  # fmt: skip
    drafted = samples(servers, "drafted", range(SAMPLES), 1.0, **controls)
    served = samples(servers, "plain", range(30_000, 30_000 + SAMPLES), 1.0, **controls)
    for p in POSITIONS:
        assert chi_square_p([d[p] for d in drafted], [s[p] for s in served]) > P_MIN, p
    assert min(chi_square_p([d[p] for d in drafted], [s[p] for s in plain]) for p in POSITIONS) < P_MIN


# ---------------------------------------------------------------------------------------------- streams


class Counted:
    """Counts the rounds an engine's batcher is given meanwhile."""

    def __init__(self, batcher):
        self.batcher, self.rounds, self.inner = batcher, 0, batcher.submit_here

    def __enter__(self):
        self.batcher.submit_here = self.submit
        return self

    def __exit__(self, *exc):
        del self.batcher.submit_here

    def submit(self, *args, **kwargs):
        self.rounds += 1
        return self.inner(*args, **kwargs)


def concurrently(jobs: list) -> list:
    out: list = [None] * len(jobs)

    def run(i: int) -> None:
        out[i] = jobs[i]()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(BOUND_S)
    return out


def test_several_streams_at_once_each_get_their_own_text(servers):
    engine = servers["drafted"]["engine"]
    prompts = [servers["tok"].encode(t) for t in (*PROMPTS, PROMPTS[0])]  # two streams of one prompt too
    want = [generate(servers, "plain", p, 40)[0] for p in prompts]
    sampled = dict(temperature=1.0, ignore_eos=True)
    jobs = [lambda p=p: generate(servers, "drafted", p, 40)[0] for p in prompts]
    jobs += [lambda s=s: generate(servers, "drafted", prompts[0], 24, seed=s, **sampled)[0] for s in range(2)]
    # Held after their first token until all have it: then they decode at once, as batcher rounds.
    with Gate(engine, count=len(jobs)), Counted(engine.batcher) as counted:
        got = concurrently(jobs)
    assert got[: len(prompts)] == want
    assert [len(g) for g in got[len(prompts) :]] == [24, 24]
    assert counted.rounds > 0  # the streams' rounds went through the batcher, verified together
    assert engine.pool.used_blocks == 0 and engine.decoding.generating == 0


# ---------------------------------------------------------------------------------------------- refusals


@pytest.fixture
def clean_env(monkeypatch):
    """No TETHER_* variable of this shell reaches the command lines."""
    for name in [n for n in os.environ if n.startswith(env.PREFIX)]:
        monkeypatch.delenv(name)


def test_server_draft_without_a_drafter_is_refused_before_anything_loads(clean_env, capsys):
    with pytest.raises(ValueError, match="--server-draft drafts with the drafter on the server: give it one"):
        service_config(ServeConfig(drafter="none", server_draft=True))
    assert main(["serve", "--drafter", "none", "--server-draft", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "--server-draft drafts with the drafter on the server: give it one, not --drafter none" in err
    assert err.count("\n") == 1
    for flags, says in ((["--server-draft-k", "0"], "--server-draft-k is at least 1"), (["--tp", "2"], "--tp 1")):
        assert main(["serve", "--server-draft", "--device", "cpu", *flags]) == 2
        assert says in capsys.readouterr().err
    service_config(ServeConfig(drafter="none", server_draft_k=0))  # without the flag its value is not checked


def test_the_engine_says_the_mode_is_on_and_needs_a_drafter(servers, caplog):
    drafted = servers["drafted"]["engine"]
    with caplog.at_level(logging.INFO, logger="tether.server"):
        engine = Engine(drafted.target, drafted.drafter, drafted.tokenizer, model_fingerprint=servers["fp"],
                        server_draft=K)  # fmt: skip
    engine.close()
    assert "server-draft on: Generate and the HTTP API draft 3 tokens a round with the moa drafter" in caplog.text
    assert servers["plain"]["engine"].decoding is servers["plain"]["engine"].plain  # off: plain decoding
    with pytest.raises(ValueError, match="--server-draft drafts with the drafter"):
        Engine(drafted.target, None, drafted.tokenizer, model_fingerprint=servers["fp"], server_draft=K)
