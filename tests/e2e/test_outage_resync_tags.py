"""Outages through tether.netsim, as the edge client tells them: the tags a resync leaves, and the lines users read.

- Tokens a resync kept are tagged verified, by the session (Event "verify"), under keep and under rewind: after a
  resync that keeps the text no token stays tagged offline, and under rewind the retracted ones are gone (the text
  equals plain greedy decoding). So generate --json's tags, the live view and the edge API's counts agree.
- Under rewind, a generation that ends offline is resynced at the end; the edge API's held text goes out verified
  as far as that resync kept it, never marked offline (the tokens a resync kept were once sent marked when no
  verified token followed them, the generation being full).
- One line per change of the link's state (tether.client.outage.LinkNotes): offline with a short reason, resyncing,
  online; however many resync attempts fail while the link is down, and never gRPC's own text.

Faults strike on events: the link is cut after the client's Nth verified round, and comes back when it tries to
resync for the Mth time having written enough alone. Nothing waits on the clock.
"""

import asyncio
import dataclasses
import logging
import re

import pytest
from edge_text import run_text
from toy_models import toy_model_dir

from tether.client.edge_api import EdgeBackend, Release
from tether.client.outage import LinkNotes
from tether.client.session import ClientConfig, EdgeSession, Event, State
from tether.netsim.proxy import NetSimThread
from tether.server.generate import GenerateConfig, generate_text
from tether.shared.openai_api import Sampling, Tokens

PROMPT = "def read_config(path):\n    with open(path"
N = 64
MAX_OFFLINE = 12  # tokens the client writes alone in one outage before it waits for the link


@pytest.fixture(scope="module")
def server(start_server):
    address, _ = start_server()
    return address


@pytest.fixture(scope="module")
def greedy() -> list[int]:
    plain = GenerateConfig(model=str(toy_model_dir()), prompt=PROMPT, drafter="none", max_new_tokens=N, device="cpu")
    return generate_text(plain)["token_ids"]


class CutThenRestore:
    """Cuts the link once the session has verified `rounds` rounds; restores it at its `attempts`-th resync attempt
    once it has written `offline` tokens alone (or can write no more). Records every event, and the lines LinkNotes
    makes of them, and what the edge API's Release would send."""

    def __init__(self, sim: NetSimThread, session: EdgeSession, *, rounds: int = 2, offline: int = 6,
                 attempts: int = 3):  # fmt: skip
        self.sim, self.session = sim, session
        self.rounds, self.offline, self.attempts = rounds, offline, attempts
        self.struck = self.restored = False
        self.written = self.tries = 0
        self.notes, self.lines, self.events = LinkNotes(), [], []
        self.sent = []
        self.release = Release(session.cfg.policy == "rewind", self.sent.append)

    def __call__(self, e: Event) -> None:
        s = self.session
        self.events.append(e)
        self.lines += self.notes.lines(e)
        self.release.event(e)
        if e.kind == "tokens" and e.tag == "offline":
            self.written += len(e.tokens)
        if not self.struck and e.kind == "tokens" and e.tag == "verified" and s.stats.rounds >= self.rounds:
            self.struck = True
            self.sim.cut()
        elif self.struck and not self.restored and e.kind == "state" and e.state == State.RESYNCING:
            self.tries += 1
            enough = self.written >= self.offline or s.resync.offline_run >= MAX_OFFLINE or s.done
            if enough and self.tries >= self.attempts:
                self.restored = True
                self.sim.restore()


def run(server: str, tmp_path, policy: str, **overrides):
    sim = NetSimThread(("127.0.0.1", 0), server)
    sim.start()
    settings = dict(max_new_tokens=N, policy=policy, k=4, cache_dir=str(tmp_path), round_timeout_s=30.0,
                    connect_timeout_s=30.0, backoff_initial_s=0.02, backoff_max_s=0.1, pace_tokens_per_s=200,
                    max_offline_tokens=MAX_OFFLINE, final_resync_s=120) | overrides  # fmt: skip
    session = EdgeSession(ClientConfig(mode="hybrid", server=sim.address, **settings))
    try:
        session.pair()  # over a clean link; the fault starts with generation
        faults = CutThenRestore(sim, session)
        session.on_event = faults
        result = run_text(session, PROMPT)
    finally:
        session.close()
        sim.stop()
    return result, faults


def verified_by_resyncs(faults: CutThenRestore) -> int:
    return sum(e.count for e in faults.events if e.kind == "verify")


@pytest.mark.parametrize("policy", ["keep", "rewind"])
def test_a_resync_that_keeps_the_text_leaves_no_token_tagged_offline(server, tmp_path, greedy, policy):
    result, faults = run(server, tmp_path, policy)
    s = result.stats
    assert faults.struck and faults.restored and faults.tries >= 3 and s.resyncs >= 1, (faults.tries, s)
    assert s.offline_tokens >= 1
    assert result.tags.count("offline") == 0, result.tags  # every kept offline token is tagged verified now
    assert verified_by_resyncs(faults) + s.retracted == s.offline_tokens  # each one kept or retracted, once
    if policy == "rewind":
        assert result.token_ids == greedy
    else:
        assert s.retracted == 0 and verified_by_resyncs(faults) == s.offline_tokens
    # The edge API's view of the same events: nothing marked offline, and the same text.
    assert not any(t.offline for t in faults.sent) or policy == "keep"
    if policy == "rewind":
        assert [t for chunk in faults.sent for t in chunk.ids] == result.token_ids


@pytest.mark.parametrize("policy", ["keep", "rewind"])
def test_one_line_per_change_of_the_links_state_whatever_the_attempts(server, tmp_path, policy):
    result, faults = run(server, tmp_path, policy)
    attempts = sum(1 for e in faults.events if e.kind == "state" and e.state == State.RESYNCING)
    assert attempts >= 3  # resync attempts that failed while the link was down, then the one that got through
    assert len(faults.lines) == 3, faults.lines
    offline, resyncing, online = faults.lines
    assert offline.startswith("offline: ") and resyncing == "resyncing" and online.startswith("online"), faults.lines
    assert offline in ("offline: server unreachable", "offline: the server closed the stream"), offline
    kept, retracted = verified_by_resyncs(faults), result.stats.retracted
    assert (f"{kept} offline tokens verified" in online) == bool(kept) and (f"{retracted} retracted" in online) == bool(
        retracted
    ), online
    for line in faults.lines:
        assert not any(raw in line for raw in ("StatusCode", "UNAVAILABLE", "ipv4", "grpc", "\n")), line


def test_rewind_ending_offline_sends_what_the_final_resync_kept_as_verified(server, tmp_path, greedy):
    """The generation is full before the link is back (max_offline_tokens 0: it drafts to the end); the final resync
    under rewind decides the held text. What it kept goes out verified, whether or not a token of the target's
    follows (none does when it kept everything: the generation is full)."""
    result, faults = run(server, tmp_path, "rewind", max_offline_tokens=0, max_new_tokens=24)
    s = result.stats
    assert faults.restored and s.resyncs >= 1 and s.offline_tokens >= 1
    assert result.tags.count("offline") == 0 and result.token_ids == greedy[: len(result.token_ids)]
    faults.release.end()
    assert not any(t.offline for t in faults.sent)
    assert [t for chunk in faults.sent for t in chunk.ids] == result.token_ids


def test_the_edge_apis_log_has_one_line_per_change_each_with_the_servers_session_id(server, tmp_path, caplog):
    """The same outage behind the edge API (rewind): its log says offline, resyncing, online and the end, each line
    naming the server's session id (the end too, after the session is closed), gRPC's own text at debug only; the
    text it sends is the session's, none of it marked offline."""
    cfg = ClientConfig(mode="hybrid", server="", max_new_tokens=N, policy="rewind", k=4, cache_dir=str(tmp_path),
                       round_timeout_s=30.0, connect_timeout_s=30.0, backoff_initial_s=0.02, backoff_max_s=0.1,
                       pace_tokens_per_s=200, max_offline_tokens=MAX_OFFLINE)  # fmt: skip
    sim = NetSimThread(("127.0.0.1", 0), server)
    sim.start()
    faults: list[CutThenRestore] = []

    def observe(session: EdgeSession, e: Event) -> None:
        if not faults:
            faults.append(CutThenRestore(sim, session))
        faults[0](e)

    backend = EdgeBackend.connect(dataclasses.replace(cfg, server=sim.address), observe=observe)

    async def answer() -> list[Tokens]:
        prompt = backend.paired.tokenizer.encode(PROMPT)
        return [chunk async for chunk in backend.generate(prompt, Sampling(temperature=0.0), N)]

    try:
        with caplog.at_level(logging.INFO, logger="tether.edge"):
            chunks = asyncio.run(answer())
            assert backend.wait_released(120)
    finally:
        sim.stop()
    session = faults[0].session
    assert faults[0].restored and faults[0].tries >= 3 and session.stats.resyncs >= 1
    assert not any(c.offline for c in chunks) and [t for c in chunks for t in c.ids] == session.tokens
    said = [r.getMessage() for r in caplog.records if r.name == "tether.edge"]
    ids = {m.split(":", 1)[0] for m in said}
    assert len(ids) == 1 and re.fullmatch(r"session [0-9a-f]{8}", ids.pop()), said
    lines = [m.split(": ", 1)[1] for m in said]
    assert len(lines) == 4 and lines[0] == "offline: server unreachable" and lines[1] == "resyncing", lines
    assert lines[2].startswith("online") and f"{N} tokens" in lines[3] and "0 of them unverified" in lines[3], lines
