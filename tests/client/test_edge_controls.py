"""The edge HTTP API's logprobs without a server: which logprobs go out with which tokens (tether.client.edge_api's
Release), how the server's are checked (tether.client.logprobs), and how the app names the drafter's own entries in
a choice (tether.shared.openai_responses.with_offline, in bodies, streams and the openai package's objects).
"""

import json
import math

import httpx
import numpy as np
import openai
import pytest
from test_edge_api import BOUND_S, scripted_app, tok  # noqa: F401 (the fixtures)

from tether.client.edge_api import Release
from tether.client.logprobs import drafter_logprobs, server_logprobs
from tether.client.session_types import ClientConfig, Event
from tether.shared.openai_api import Tokens
from tether.shared.sampling import LOGPROB_FLOOR, TokenLogprobs
from tether.v1 import tether_pb2 as pb


def lp(token: int, logprob: float = -0.5) -> TokenLogprobs:
    return TokenLogprobs(token, logprob, ((token, logprob), (token + 1, logprob - 1)))


def told(ids: list[int], tag: str) -> Event:
    return Event("tokens", tokens=list(ids), tag=tag, logprobs=[lp(t) for t in ids])


def released(rewind: bool, events: list[Event]) -> list[Tokens]:
    sent: list[Tokens] = []
    release = Release(rewind, sent.append, reporting=True)
    for e in events:
        release.event(e)
    release.end()
    return sent


# ---- which logprobs go with which tokens ------------------------------------------------------------------------


def test_keep_sends_the_drafters_logprobs_with_offline_tokens_marked():
    sent = released(False, [told([1, 2], "verified"), told([3], "offline"), Event("verify", count=1),
                            told([4], "verified")])  # fmt: skip
    assert [(t.ids, t.drafter_logprobs) for t in sent] == [([1, 2], False), ([3], True), ([], False), ([4], False)]
    assert [[e.token for e in t.logprobs or ()] for t in sent] == [[1, 2], [3], [], [4]]


def test_rewind_holds_the_logprobs_with_their_tokens_and_drops_those_retracted():
    events = [told([1], "verified"), told([2, 3], "offline"), told([4], "offline"), Event("verify", count=1),
              Event("retract", count=2), told([9], "verified")]  # fmt: skip
    sent = released(True, events)
    assert [(t.ids, t.offline, t.drafter_logprobs) for t in sent] == [
        ([1], False, False), ([2], False, True), ([9], False, False)]  # fmt: skip
    assert [[e.token for e in t.logprobs] for t in sent] == [[1], [2], [9]]
    never_back = released(True, [told([1], "verified"), told([2, 3], "offline")])
    assert (never_back[-1].ids, never_back[-1].offline, never_back[-1].drafter_logprobs) == ([2, 3], True, True)
    assert [e.token for e in never_back[-1].logprobs] == [2, 3]


def test_no_logprobs_go_out_unless_asked():
    sent: list[Tokens] = []
    release = Release(False, sent.append)
    for e in (told([1], "verified"), told([2], "offline")):
        release.event(e)
    assert [t.logprobs for t in sent] == [None, None] and not any(t.drafter_logprobs for t in sent)


# ---- the server's entries, checked -------------------------------------------------------------------------------


def entry(token: int, logprob: float = -0.25, top: tuple = ((5, -0.25),)) -> pb.TokenLogprob:
    return pb.TokenLogprob(token=token, logprob=logprob, top_ids=[t for t, _ in top], top_logprobs=[v for _, v in top])


def test_the_servers_logprobs_are_checked_against_the_tokens_they_report():
    got = server_logprobs([entry(5), entry(7, -1.5, ((5, -0.125), (7, -1.5)))], [5, 7], 2, 10)
    assert got == [TokenLogprobs(5, -0.25, ((5, -0.25),)), TokenLogprobs(7, -1.5, ((5, -0.125), (7, -1.5)))]
    assert server_logprobs([], [5], 2, 10) is None  # a server older than SamplingParams.logprobs sends none
    assert server_logprobs([entry(5, 1e-6)], [5], 1, 10)[0].logprob == 0.0  # a rounding hair above 0
    assert server_logprobs([entry(5, LOGPROB_FLOOR)], [5], 1, 10)[0].logprob == LOGPROB_FLOOR
    hostile = {
        "entries for": ([entry(5)], [5, 6], 2),
        "where token": ([entry(6)], [5], 2),
        "top ids": ([entry(5, top=((1, -1.0), (2, -2.0), (3, -3.0)))], [5], 2),
        "outside the vocabulary": ([entry(5, top=((10, -1.0),))], [5], 2),
        "not a log-probability": ([entry(5, math.nan)], [5], 2),
    }
    for match, (entries, tokens, top) in hostile.items():
        with pytest.raises(ValueError, match=match):
            server_logprobs(entries, tokens, top, 10)
    for bad in (0.5, -math.inf, LOGPROB_FLOOR - 1):
        with pytest.raises(ValueError, match="log-probability"):
            server_logprobs([entry(5, bad)], [5], 1, 10)


def test_the_drafters_logprobs_follow_the_sampling_rule():
    logits = np.array([2.0, 1.0, 0.0, -1.0])  # [V]
    greedy = drafter_logprobs(logits, 0, 2, ClientConfig())  # greedy: the rule at temperature 1
    z = math.log(sum(math.exp(x) for x in logits))
    assert greedy.logprob == pytest.approx(2.0 - z) and [t for t, _ in greedy.top] == [0, 1]
    cut = drafter_logprobs(logits, 3, 1, ClientConfig(temperature=1.0, top_k=2))
    assert cut.logprob == LOGPROB_FLOOR and cut.top[0][1] == pytest.approx(2.0 - math.log(math.exp(2) + math.exp(1)))


# ---- the drafter's entries named in each choice -----------------------------------------------------------------


def test_each_choice_names_the_entries_that_are_the_drafters(tok, scripted_app):  # noqa: F811
    ids = [tok.encode(w)[0] for w in ("def", " read", "_", "config", "(", "path")]
    chunks = [Tokens(ids[:2], logprobs=tuple(map(lp, ids[:2]))),
              Tokens(ids[2:4], offline=True, logprobs=tuple(map(lp, ids[2:4])), drafter_logprobs=True),
              Tokens([], verified=2), Tokens(ids[4:], logprobs=tuple(map(lp, ids[4:])))]  # fmt: skip
    url = scripted_app(chunks)
    body = {"prompt": "x", "max_tokens": len(ids), "temperature": 0, "logprobs": 1}
    done = httpx.post(url + "/v1/completions", json=body, timeout=BOUND_S).json()
    choice = done["choices"][0]
    assert choice["tether"] == {"offline_tokens": 0, "drafter_logprobs": [2, 3]}  # verified since, still the drafter's
    assert len(choice["logprobs"]["token_logprobs"]) == len(ids)
    with httpx.stream("POST", url + "/v1/completions", json=body | {"stream": True}, timeout=BOUND_S) as r:
        frames = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    marks = [(len(f["choices"][0]["logprobs"]["tokens"]), f["choices"][0]["tether"].get("drafter_logprobs"))
             for f in frames if (f["choices"][0]["logprobs"] or {}).get("tokens")]  # fmt: skip
    assert marks == [(1, []), (1, []), (1, [0]), (1, [0]), (1, []), (1, [])]
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=BOUND_S)
    chat = client.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "x"}],
                                          max_tokens=len(ids), logprobs=True, top_logprobs=1)  # fmt: skip
    assert len(chat.choices[0].logprobs.content) == len(ids)
    assert chat.choices[0].model_extra["tether"]["drafter_logprobs"] == [2, 3]
    plain = httpx.post(url + "/v1/completions", json=body | {"logprobs": None}, timeout=BOUND_S).json()
    assert "drafter_logprobs" not in plain["choices"][0]["tether"]  # named only when logprobs are asked
