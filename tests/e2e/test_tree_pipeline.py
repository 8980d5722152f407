"""Tree rounds and rounds drafted ahead end to end: the shipped models served on loopback, the edge client over gRPC.

- greedy, chains or trees, drafting ahead or not, sending rounds drafted ahead before the verdict they depend on
  (overlapping) or after it, onnxruntime or torch: the text is plain greedy decoding's, token for token, every token
  verified; tree rounds go out as trees, and a greedy run sends rounds drafted ahead, whose rows either drafter
  keeps once a verdict bears them out;
- a draft ahead cut short by its verdict's arrival changes no token and no round, greedy or sampled;
- two overlapping rounds queued behind the one in flight (greedy's default) give plain greedy's text too, and a miss
  throws both away;
- trees accept at least as many tokens per round as chains on the same prompt;
- sampled runs repeat for a seed (the rounds drafted ahead included) and draft rounds ahead: sent, for chains (a
  sampled tree is seldom accepted down its whole main branch, so the rounds drafted after one are thrown away);
- the link cut or stalled while a round drafted ahead is in flight, under rewind: the text is still plain greedy's;
- sampling stays lossless: with rounds drafted ahead, and with trees (which carry no q), every emitted token follows
  the target's own law after the tokens before it (a log-likelihood z-statistic over fixed seeds);
- a server that takes chains only (ModelInfo.max_tree_nodes 0, as from one older than trees) gets chains under
  tree="tree" and "auto".

Faults strike on events (the verified tokens of a round whose successor was sent drafted ahead), never on the clock;
deadlines elsewhere are generous, so a busy machine never makes a slow round look like an outage.

    .venv/bin/python -m pytest -q tests/e2e/test_tree_pipeline.py
"""

import pytest
import torch
from edge_text import run_text

from tether.client.rounds import Rounds
from tether.client.session import ClientConfig, EdgeSession, Event, State
from tether.client.transport import SessionStream
from tether.netsim.proxy import NetSimThread
from tether.shared.speculative import target_probs

pytestmark = pytest.mark.heavy  # a long file, started first (tests/conftest.py)

PROMPT = "def write_lines(path, lines):\n    "
N_NEW = 64
PATIENT = {"round_timeout_s": 120.0, "connect_timeout_s": 120.0, "mode": "hybrid"}  # rounds, not a stream
MAX_OFFLINE = 8  # tokens the client writes alone in one outage before it waits for the link


def generate(address: str, cache: str, early: bool | None = None, **fields):
    """One generation. `early`: whether every verdict counts as in before the draft ahead of it is done (True: it
    is cut after its first token; False: never cut; None: as the verdicts really come)."""
    session = EdgeSession(ClientConfig(server=address, max_new_tokens=N_NEW, cache_dir=cache, **PATIENT | fields))
    try:
        with pytest.MonkeyPatch.context() as mp:
            if early is not None:
                mp.setattr(SessionStream, "has_reply", lambda self, stale=0: early)
            return run_text(session, PROMPT)
    finally:
        session.close()


@pytest.fixture(scope="module")
def runs(served, cache):
    """Greedy results by (tree, pipeline), each generated once per module."""
    done: dict = {}

    def get(tree: str, pipeline: bool, overlap: bool = True):
        if (tree, pipeline, overlap) not in done:
            done[tree, pipeline, overlap] = generate(served[0], cache, False, tree=tree, pipeline=pipeline,
                                                     overlap=overlap)  # fmt: skip
        return done[tree, pipeline, overlap]

    return get


@pytest.mark.parametrize(
    "pipeline, overlap", [(False, False), (True, False), (True, True)], ids=["alone", "ahead", "overlapping"]
)
@pytest.mark.parametrize("tree", ["chain", "tree"])
def test_greedy_equals_plain_greedy(served, runs, tree, pipeline, overlap):
    result = runs(tree, pipeline, overlap)
    s = result.stats
    assert result.token_ids == served[2]
    assert set(result.tags) == {"verified"} and s.outages == 0
    if tree == "tree":
        assert s.tree_rounds >= s.rounds - 1 > 0  # the last round may have room for one token only: a chain
    else:
        assert s.tree_rounds == 0
    if pipeline:
        assert s.pipeline_hits > 0
        # Every round drafted ahead is a hit or thrown away, once; a verdict's round drafts at most the queue's
        # depth of them (two overlapping rounds by default, one otherwise).
        assert s.pipeline_hits + s.pipeline_discarded <= (2 if overlap else 1) * s.rounds
    else:
        assert s.pipeline_hits == s.pipeline_discarded == 0
    # Overlapping: every hit went out before the verdict it depended on, and the misses' rounds, sent too, came
    # back refused as stale and were passed over (the run would have ended in an error otherwise).
    assert s.overlapped == (s.pipeline_hits if overlap else 0)
    if overlap and tree == "chain":
        assert s.pipeline_discarded > 0


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_draft_ahead_cut_short_by_its_verdict_changes_no_token(served, cache, temperature):
    """A verdict that comes in while the next round is drafted ahead stops that draft (a miss then costs no more of
    it; a hit finishes it): the same tokens and the same rounds as drafts never cut, sampled too."""
    fields = {"temperature": temperature, "top_p": 0.95, "seed": 5, "tree": "chain", "pipeline": True,
              "overlap_depth": 1}  # fmt: skip
    cut, whole = (generate(served[0], cache, early, **fields) for early in (True, False))
    assert cut.token_ids == whole.token_ids and len(cut.token_ids) == N_NEW
    if temperature == 0:
        assert cut.token_ids == served[2]
    figures = ("rounds", "accepted", "drafted", "pipeline_hits", "pipeline_discarded")
    assert [getattr(cut.stats, f) for f in figures] == [getattr(whole.stats, f) for f in figures]
    assert cut.stats.pipeline_hits > 0 and cut.stats.overlapped == 0  # cut short: sent once its verdict bore it out
    assert cut.stats.pipeline_discarded > 0  # misses cut their drafts short: later draws must not move for it
    assert whole.stats.overlapped == whole.stats.pipeline_hits > 0


@pytest.mark.parametrize("tree", ["chain", "tree"])
def test_rounds_queued_two_deep_give_plain_greedy_text(served, cache, runs, tree):
    """Greedy, two overlapping rounds queued behind the one in flight (the default): the text is plain greedy's, and
    a miss makes both queued rounds stale, their refusals passed over (more rounds thrown away than one deep)."""
    two = runs(tree, True, True)
    one = generate(served[0], cache, False, tree=tree, pipeline=True, overlap_depth=1)
    assert two.token_ids == one.token_ids == served[2]
    assert two.stats.overlapped == two.stats.pipeline_hits > 0
    assert two.stats.pipeline_discarded > one.stats.pipeline_discarded > 0
    assert one.stats.pipeline_hits + one.stats.pipeline_discarded <= one.stats.rounds


def test_a_round_cut_short_behind_a_queued_one_is_finished_on_a_hit(served, cache, monkeypatch):
    """Two queued, and each verdict comes in while the second queued round is drafted (after its first token): that
    round is kept unsent, finished from the same rows on a hit and sent, thrown away on a miss; the text is plain
    greedy's and the rounds still overlap."""
    finished = []
    real_rest = Rounds.draft_rest

    def draft_rest(self, d):
        finished.append(d.msg.round)
        return real_rest(self, d)

    calls = {"n": 0}

    def has_reply(self, stale=()):
        session = owner[0]
        if not session.rounds.queued:
            return False  # the first round drafted ahead is never cut here
        calls["n"] += 1
        return calls["n"] % 2 == 0  # the check before the second draft says no, its first stop check yes

    owner: list = []
    monkeypatch.setattr(Rounds, "draft_rest", draft_rest)
    monkeypatch.setattr(SessionStream, "has_reply", has_reply)
    session = EdgeSession(ClientConfig(server=served[0], max_new_tokens=N_NEW, cache_dir=cache, tree="chain",
                                       pipeline=True, **PATIENT))  # fmt: skip
    owner.append(session)
    try:
        result = run_text(session, PROMPT)
    finally:
        session.close()
    s = result.stats
    assert result.token_ids == served[2] and set(result.tags) == {"verified"}
    assert finished, "no round cut short behind a queued one was finished"
    assert s.overlapped == s.pipeline_hits > 0 and s.pipeline_discarded > 0


def test_trees_accept_at_least_as_much_per_round_as_chains(runs):
    chain, tree = runs("chain", False).stats, runs("tree", False).stats
    assert tree.tau >= chain.tau and tree.rounds <= chain.rounds
    assert tree.drafted > chain.drafted  # paid for with more draft tokens on the wire


def test_the_torch_backend_drafts_trees_ahead_too(served, cache):
    result = generate(served[0], cache, backend="torch", tree="tree", pipeline=True)
    s = result.stats
    assert result.token_ids == served[2]
    assert s.tree_rounds >= s.rounds - 1 > 0 and s.pipeline_hits > 0


def test_the_torch_backend_keeps_the_rows_drafted_ahead_as_onnxruntime_does(served, runs, cache):
    """One drafting loop runs both drafters: after a verdict that bears out the rounds drafted ahead of it, the
    torch drafter keeps their rows (commit(keep_drafts=True)) as the onnxruntime one does, and the text is plain
    greedy's."""
    result = generate(served[0], cache, False, backend="torch", tree="chain", pipeline=True)
    assert result.token_ids == served[2]
    assert result.stats.rows_kept > 0 and runs("chain", True).stats.rows_kept > 0


@pytest.mark.parametrize("tree", ["chain", "tree"])
def test_sampled_runs_repeat_for_a_seed_and_send_rounds_drafted_ahead(served, cache, tree):
    sampled = {"temperature": 0.8, "top_p": 0.95, "tree": tree, "pipeline": True}
    first, again = (generate(served[0], cache, seed=11, **sampled) for _ in range(2))
    other = generate(served[0], cache, seed=12, **sampled)
    assert first.token_ids == again.token_ids and len(first.token_ids) == N_NEW
    assert set(first.tags) == {"verified"}
    s, t = first.stats, again.stats
    figures = ("rounds", "accepted", "tree_rounds", "pipeline_hits", "pipeline_discarded")
    assert [getattr(s, f) for f in figures] == [getattr(t, f) for f in figures]
    assert s.pipeline_hits > 0 if tree == "chain" else s.pipeline_discarded > 0
    assert other.token_ids != first.token_ids  # the seed decides the text


@pytest.mark.parametrize("fault", ["cut", "stall"])
def test_the_link_failing_with_a_round_drafted_ahead_in_flight_ends_as_plain_greedy(served, cache, fault):
    address, service, plain = served
    port = int(address.rsplit(":", 1)[1])
    sim = NetSimThread(("127.0.0.1", 0), ("127.0.0.1", port))
    sim.start()
    cfg = ClientConfig(server=sim.address, max_new_tokens=N_NEW, cache_dir=cache, policy="rewind", tree="tree",
                       mode="hybrid", pipeline=True, round_timeout_s=1.0, connect_timeout_s=5.0, backoff_initial_s=0.05,
                       backoff_max_s=0.4, max_offline_tokens=MAX_OFFLINE, final_resync_s=60)  # fmt: skip
    session = EdgeSession(cfg)
    seen = {"hits": 0, "struck": 0, "offline": 0}

    def on_event(e: Event) -> None:
        s = session.stats
        if e.kind == "tokens" and e.tag == "offline":
            seen["offline"] += len(e.tokens)
        if e.kind == "tokens" and e.tag == "verified" and session.state == State.ONLINE:
            # These tokens' round was answered as guessed: the next round left drafted ahead, before them.
            sent_ahead, seen["hits"] = s.pipeline_hits > seen["hits"], s.pipeline_hits
            room = len(session.tokens) + cfg.tree_depth + 1 + MAX_OFFLINE < N_NEW
            if not seen["struck"] and sent_ahead and s.rounds >= 2 and room:
                seen["struck"] = 1
                sim.cut() if fault == "cut" else sim.stall()
        elif e.kind == "state" and e.state == State.RESYNCING and seen["struck"] == 1:
            if fault == "stall" or seen["offline"] >= MAX_OFFLINE or session.done:
                sim.restore()
                seen["struck"] = 2

    try:
        session.pair()  # the weights come over a clean link; the fault comes with generation
        session.on_event = on_event
        result = run_text(session, PROMPT)
    finally:
        session.close()
        sim.stop()
    s = result.stats
    assert seen["struck"] == 2 and s.outages == 1 and s.resyncs >= 1
    assert s.pipeline_discarded >= 1  # the round drafted ahead of the one lost went with it
    assert s.offline_tokens > 0
    assert result.token_ids == plain


@pytest.fixture(scope="module")
def chains_only(start_server):
    """A server that verifies chains only: max_tree_nodes 0, what one older than tree rounds says too."""

    def no_trees(service):
        service.engine.model_info.max_tree_nodes = 0

    return start_server(no_trees)[0]


@pytest.mark.parametrize("tree", ["tree", "auto"])
def test_a_server_without_trees_gets_chains(chains_only, served, cache, tree):
    result = generate(chains_only, cache, tree=tree, pipeline=True)
    assert result.token_ids == served[2]
    assert result.stats.tree_rounds == 0 and result.stats.rounds > 0 and result.stats.pipeline_hits > 0


# ---- sampling stays lossless ------------------------------------------------------------------------------------

SPREAD = "    def __init__(self, "  # at T=1 its next tokens spread over several likely ones
SAMPLES = 160  # generations per test
EMITTED = 5  # with chains of one token: the second round decides tokens 3 and 4, and no round is drafted after it
Z_MAX = 5.0  # |z| bound: five standard deviations


class LogLikelihood:
    """A z-statistic of tokens against the laws they should follow: the sum over tokens of log p(token), centred by
    each law's mean and scaled by the root of the summed variances. Any mix of contexts adds up; a sampler that
    favours likely tokens (or shuns them) moves it by many standard deviations."""

    def __init__(self):
        self.sum = self.mean = self.var = 0.0
        self.n = 0

    def add(self, p: torch.Tensor, token: int) -> None:
        assert p[token] > 0, "emitted a token the target gives zero probability"
        logp = torch.where(p > 0, p.log(), torch.zeros_like(p))
        mean = float((p * logp).sum())
        self.sum += float(logp[token])
        self.mean += mean
        self.var += float((p * logp**2).sum()) - mean**2
        self.n += 1

    @property
    def z(self) -> float:
        return (self.sum - self.mean) / self.var**0.5


@pytest.mark.parametrize(
    "shape",
    [{"tree": "chain", "k": 1}, {"tree": "tree", "tree_depth": 2, "tree_top_k": 2, "tree_nodes": 4}],
    ids=["chains_of_one", "small_trees"],
)
def test_sampled_rounds_drafted_ahead_and_trees_follow_the_targets_law(served, paired_once, shape):
    """Every emitted token follows the target's own law at T=1 after the tokens before it. Chains of one token make
    the second round (tokens 3 and 4) one drafted ahead whenever the first was accepted with the guessed bonus.
    Trees go without q (point-mass proposals). Fixed seeds, so the outcome is fixed for given code; the same
    statistic tells the target's law at T=0.7 apart (power)."""
    address, service, _ = served
    target, prompt = service.engine.target, service.engine.tokenizer.encode(SPREAD)
    every, cooler, ahead = LogLikelihood(), LogLikelihood(), 0
    for seed in range(SAMPLES):
        cfg = ClientConfig(server=address, max_new_tokens=EMITTED, temperature=1.0, seed=seed, pipeline=True,
                           cache_dir=paired_once, **PATIENT | shape)  # fmt: skip
        session = EdgeSession(cfg)
        try:
            result = run_text(session, SPREAD)
        finally:
            session.close()
        assert set(result.tags) == {"verified"}
        with torch.inference_mode():
            logits = target(torch.tensor([prompt + result.token_ids]))[0, len(prompt) - 1 : -1]  # [n, V]
        laws, cool = target_probs(logits, 1.0), target_probs(logits, 0.7)
        for i, token in enumerate(result.token_ids):
            every.add(laws[i], token)
            cooler.add(cool[i], token)
        ahead += result.stats.pipeline_hits
    assert abs(every.z) < Z_MAX, every.z
    assert abs(cooler.z) > 2 * Z_MAX, cooler.z
    if shape["tree"] == "chain":
        assert ahead >= SAMPLES // 5, ahead  # rounds drafted ahead decide a good part of the tokens tested
