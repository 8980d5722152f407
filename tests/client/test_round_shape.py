"""A round's shape and what drafting ahead leaves behind (tether.client.round_plan, tether.client.rounds), without a
server process.

- `use_tree`: the auto rule is a pure function of the measured figures: chains until MIN_ROUNDS verdicts, a tree
  once the wait dominates drafting and rounds get as far as a whole chain often, never a tree where the server takes
  chains only (max_tree_nodes 0) or one would have under two nodes; `Measured` averages as documented.
- A round's shape (`plan_round`, pure) follows the room left and the server's limits, and the wait is weighed against
  a whole chain's drafting even when the end of the text leaves room for a shorter one.
- `main_branch` follows first children; `lookahead_rows` covers what a tree expands.
- A verdict's path is taken only as a walk down the tree sent, `accepted` nodes long; a chain's verdict names no
  nodes.
- The drafter (onnxruntime, MoA and EAGLE; tiny random models exported to ONNX): after a chain drafted past (a
  round drafted ahead) or a tree, dropping the drafted rows and adopting the delta leaves exactly the caches of a
  drafter that never drafted and adopted the same deltas, so a tree's accepted path ends as a chain of the same
  tokens would; a tree grown after a drafted chain starts where a chain step there would (the root's own logits),
  and the torch drafter grows the same tree there. A commit that keeps drafts (a round drafted ahead, borne out)
  gives the verified positions the delta's states alone and leaves the rows drafted after them as they were, in the
  torch drafters as in the ONNX one (one drafting loop, tether.shared.draft_loop).
- Drafting ahead after a verdict that bore out a queued round, whose rows and guess are all held already (the
  guess after it was end-of-text), drafts from that kept guess and feeds nothing (it once drafted after None).

    .venv/bin/python -m pytest -q tests/client/test_round_shape.py
"""

import copy
import dataclasses
import threading

import numpy as np
import pytest
import torch
from tiny_models import tiny_pair

from tether.client.errors import Problem
from tether.client.onnx_drafter import OnnxDrafter
from tether.client.reply_check import ReplyCheck
from tether.client.round_plan import (
    EWMA_WEIGHT,
    MIN_ROUNDS,
    RTT_DOMINANCE,
    WHOLE_OFTEN,
    Limits,
    Measured,
    Shape,
    lookahead_rows,
    main_branch,
    plan_round,
    use_tree,
)
from tether.client.rounds import Drafted, Rounds, check_verdict
from tether.client.session_output import SessionOutput
from tether.client.session_text import SessionText
from tether.client.session_types import ClientConfig, State
from tether.client.transport import BadMessage
from tether.server.onnx_export import export_client_onnx
from tether.server.verifier import target_states
from tether.shared.speculative import DraftTree
from tether.v1 import tether_pb2 as pb

VOCAB = 7
PROMPT = [1, 2, 3, 4, 5, 6, 0, 1, 3]


def measured(wait_s: float, step_s: float, whole: float, rounds: int = MIN_ROUNDS) -> Measured:
    return Measured(wait_s=wait_s, step_s=step_s, whole=whole, rounds=rounds, steps=10)


# ---- the auto rule -------------------------------------------------------------------------------------------


def test_auto_picks_a_tree_only_when_the_wait_dominates_drafting_and_chains_are_accepted_whole():
    k, step = 5, 0.002
    dominant = RTT_DOMINANCE * k * step
    shape = {"k": k, "nodes": 16, "depth": 6}
    assert use_tree("auto", measured(dominant, step, WHOLE_OFTEN), **shape)
    assert use_tree("auto", measured(10 * dominant, step, 1.0), **shape)
    assert not use_tree("auto", measured(0.9 * dominant, step, 1.0), **shape)  # drafting is a good part of a round
    assert not use_tree("auto", measured(10 * dominant, step, 0.9 * WHOLE_OFTEN), **shape)  # chains fall short
    assert not use_tree("auto", measured(10 * dominant, step, 1.0, rounds=MIN_ROUNDS - 1), **shape)  # not measured


def test_fixed_shapes_and_servers_that_take_chains_only():
    fast_link = measured(0.0, 0.01, 0.0)
    slow_link = measured(1.0, 0.001, 1.0)
    assert use_tree("tree", fast_link, k=5, nodes=16, depth=6)
    assert not use_tree("chain", slow_link, k=5, nodes=16, depth=6)
    for mode in ("tree", "auto"):
        assert not use_tree(mode, slow_link, k=5, nodes=0, depth=0)  # max_tree_nodes 0: chains only
        assert not use_tree(mode, slow_link, k=1, nodes=1, depth=1)  # a one-node tree is a chain
        assert not use_tree(mode, slow_link, k=0, nodes=16, depth=0)  # no token left to draft


def test_measured_figures_start_at_the_first_and_then_move_by_the_weight():
    m = Measured()
    m.drafted(0.010, 5)
    m.answered(0.100, whole=True)
    assert (m.step_s, m.wait_s, m.whole, m.rounds, m.steps) == (0.002, 0.100, 1.0, 1, 5)
    m.drafted(0.012, 3)
    m.answered(0.200, whole=False)
    assert m.step_s == pytest.approx(0.002 + EWMA_WEIGHT * (0.004 - 0.002))
    assert m.wait_s == pytest.approx(0.100 + EWMA_WEIGHT * 0.100)
    assert m.whole == pytest.approx(1.0 - EWMA_WEIGHT)
    m.drafted(1.0, 0)  # nothing drafted: nothing to learn
    assert m.steps == 8
    wait, whole = m.wait_s, m.whole
    m.answered(None, whole=True)  # an overlapping round's verdict: its acceptance counts, its wait does not
    assert (m.wait_s, m.waits, m.rounds) == (wait, 2, 3) and m.whole == pytest.approx(whole + EWMA_WEIGHT * (1 - whole))


def test_main_branch_and_lookahead_rows():
    # root -> 1 -> 3 -> 5; 2 and 4 are second children
    assert main_branch([0, 0, 1, 1, 3]) == [1, 3, 5]
    assert main_branch([0, 1, 2]) == [1, 2, 3]  # a chain
    assert main_branch([0, 0, 0]) == [1]
    assert main_branch([]) == []
    cfg = ClientConfig(k=5, tree_depth=6, tree_top_k=4)
    assert lookahead_rows(cfg) == 1 + 5 * 4 + 2
    assert lookahead_rows(ClientConfig(k=5, tree="chain")) == 5 + 2
    assert lookahead_rows(ClientConfig(k=30, tree_depth=2, tree_top_k=2)) == 30 + 2


def planner(cfg: ClientConfig, m: Measured, max_tree_nodes: int = 64, max_positions: int = 1024):
    """plan_round over a server's limits: (emitted, length) -> Shape."""
    limits = Limits(max_positions=max_positions, max_draft_tokens=64, max_tree_nodes=max_tree_nodes)
    return lambda emitted, length: plan_round(cfg, m, limits, emitted=emitted, length=length)


def test_a_rounds_shape_follows_the_room_left_and_the_servers_limits():
    cfg = ClientConfig(max_new_tokens=100, k=5, tree_nodes=16, tree_depth=6, tree_top_k=4)
    step = 0.001
    below = measured(0.99 * RTT_DOMINANCE * cfg.k * step, step, 1.0)  # just short of a tree, whatever the room
    plan = planner(cfg, below)
    assert plan(10, 50) == Shape(5, 5)
    assert plan(98, 138) == Shape(1, 1)  # one token of room: still weighed against a whole chain's drafting
    assert plan(99, 139) == Shape(0, 0)
    trees = dataclasses.replace(cfg, tree="tree")
    tree = planner(trees, below)
    assert tree(10, 50) == Shape(6, 5, True, 16, 4)
    assert tree(97, 137) == Shape(2, 2, True, 16, 4)  # as deep as the room left, as wide as allowed
    assert tree(99, 139) == Shape(0, 0)
    assert planner(trees, below, max_tree_nodes=8)(10, 50).nodes == 8
    assert planner(trees, below, max_tree_nodes=0)(10, 50) == Shape(5, 5)
    # Near the model's context a tree's nodes need positions too, though only its path stays.
    assert planner(trees, below, max_positions=53)(10, 50) == Shape(3, 3, True, 3, 4)


# ---- verdicts ------------------------------------------------------------------------------------------------


def generating(vocab_size: int = 100) -> ReplyCheck:
    """The session's checks once generating: refusals are BadMessage (lost rounds)."""
    output = SessionOutput(ClientConfig(), SessionText(), None, 0.0, save=lambda: None)
    output.set_state(State.ONLINE)
    return ReplyCheck(output, vocab_size)


def verdict(accepted: int, path=(), round_no: int = 1) -> pb.ServerMessage:
    delta = pb.KVDelta(start=9, tokens=list(range(accepted + 1)))
    return pb.ServerMessage(verdict=pb.Verdict(round=round_no, accepted=accepted, bonus=7, delta=delta, path=path))


def test_a_tree_verdict_must_walk_down_the_tree_sent():
    parents = [0, 0, 1, 1, 3]  # nodes 1..5
    tree = Drafted(pb.DraftRound(round=1, root=4, tokens=[10, 11, 12, 13, 14], parents=parents), parents, 5, 0)
    judge = generating()
    assert check_verdict(verdict(3, [1, 3, 5]), tree, judge)[1] == [1, 3, 5]
    assert check_verdict(verdict(2, [1, 4]), tree, judge)[1] == [1, 4]
    assert check_verdict(verdict(1, [2]), tree, judge)[1] == [2]
    assert check_verdict(verdict(0), tree, judge)[1] == []
    for accepted, path in [(2, [2, 3]), (2, [1, 5]), (1, [3]), (2, [1]), (1, [1, 3]), (1, [6]), (1, [0])]:
        with pytest.raises(BadMessage) as refused:
            check_verdict(verdict(accepted, path), tree, judge)
        assert refused.value.problem == Problem.VERDICT, (accepted, path)


def test_a_chain_verdict_names_no_nodes():
    chain = Drafted(pb.DraftRound(round=1, root=4, tokens=[10, 11, 12]), None, 3, 3)
    judge = generating()
    assert check_verdict(verdict(2), chain, judge)[1] == [1, 2]
    with pytest.raises(BadMessage):
        check_verdict(verdict(2, [1, 2]), chain, judge)
    with pytest.raises(BadMessage):
        check_verdict(verdict(4), chain, judge)  # more than was sent
    with pytest.raises(BadMessage):
        check_verdict(verdict(1, round_no=2), chain, judge)


# ---- the drafter's caches --------------------------------------------------------------------------------------


def tiny(kind: str, tli: int = 1):
    return tiny_pair(kind, VOCAB, tli)


@pytest.fixture(scope="module", params=["moa", "eagle"])
def models(request, tmp_path_factory):
    target, drafter = tiny(request.param)
    out = tmp_path_factory.mktemp(request.param)
    export_client_onnx(drafter, out)
    return target, drafter, out


class Target:
    """The target's side of rounds whose accepted path the test chooses: real states for those positions."""

    def __init__(self, target, drafter):
        self.target, self.drafter = target, drafter
        self.cache = target.new_cache(1, 256)

    def _run(self, tokens, **kw):
        layers = (self.target.cfg.n_layers,)
        return self.target.verify(tokens[None], self.cache, hidden_layers=layers, return_kv=True, **kw)

    @torch.inference_mode()
    def open(self, prompt: list[int]):
        out = self._run(torch.tensor(prompt))
        self.cache.advance(len(prompt))
        return int(out.logits[0, -1].argmax()), self.drafter.server_delta(target_states(out), 0, prompt)

    @torch.inference_mode()
    def verify(self, tree: DraftTree, path: list[int]):
        start = self.cache.length
        out = self._run(tree.tokens, tree_mask=tree.ancestor_mask(), positions=tree.positions(start))
        self.cache.accept(path)
        delta = self.drafter.server_delta(target_states(out).select(path), start, tree.tokens[path].tolist())
        return int(out.logits[0, path[-1]].argmax()), delta


def held(drafter) -> dict[str, np.ndarray | tuple]:
    """Copies of every cache row the drafter (ONNX, or a torch module) holds, and its lengths: [rows, ...] arrays,
    TLI [N, rows, ...]; EAGLE's last exact feature and the one its next step reads, [1, dim]."""
    if isinstance(drafter, OnnxDrafter):
        d = drafter.backend
        if d.kind == "moa":
            n, s, t = lengths = d.n_ctx, d.sa_len, d.tli_len
            rows = {"sa_k": d.sa_k[:s], "sa_v": d.sa_v[:s], "ctx_k": d.ctx_k[:n], "ctx_v": d.ctx_v[:n],
                    "tli_k": d.tli_k[:, :t], "tli_v": d.tli_v[:, :t]}  # fmt: skip
        else:
            lengths = d.n_verified, d.length
            rows = {"k": d.k[: d.length], "v": d.v[: d.length], "last": d.last_feat, "next": d.prev_feat}
    elif drafter.dcfg.kind == "moa":
        d, sa, tli = drafter, drafter.sa_cache, drafter.tli_cache
        n, s, t = lengths = d.n_ctx, sa.length, tli.length
        rows = {"sa_k": sa.k[0, 0, :s], "sa_v": sa.v[0, 0, :s], "ctx_k": d.ctx_k[0, :n], "ctx_v": d.ctx_v[0, :n],
                "tli_k": tli.k[:, 0, :t], "tli_v": tli.v[:, 0, :t]}  # fmt: skip
    else:
        c = drafter.cache
        lengths = drafter.n_verified, c.length
        rows = {"k": c.k[0, 0, : c.length], "v": c.v[0, 0, : c.length], "last": drafter.last_feat[0],
                "next": drafter.prev_feat[0]}  # fmt: skip
    copies = {name: np.array(x.numpy() if isinstance(x, torch.Tensor) else x) for name, x in rows.items()}
    return copies | {"lengths": lengths}


def held_rows(drafter) -> int:
    return drafter.backend.rows() if isinstance(drafter, OnnxDrafter) else drafter.held_rows()


def assert_same(a: OnnxDrafter, b: OnnxDrafter) -> None:
    x, y = held(a), held(b)
    assert x["lengths"] == y["lengths"]
    for name in x:
        assert np.array_equal(x[name], y[name]), name


def settle(d: OnnxDrafter, delta) -> None:
    """What the session does with a verdict's delta: drop every drafted row, then adopt it."""
    d.discard_drafts()
    d.commit(delta)


def test_caches_after_rounds_drafted_ahead_and_trees_are_the_deltas_alone(models):
    target, ref, out = models
    drafter, clean = OnnxDrafter.load(out), OnnxDrafter.load(out)
    server = Target(target, ref)
    root, delta = server.open(PROMPT)
    drafter.begin(delta, capacity=128)
    clean.begin(delta, capacity=128)
    rng = np.random.default_rng(0)

    # A sampled chain, the next round drafted ahead after a guessed bonus; the chain accepted whole.
    drafts, _, _ = drafter.draft(root, 3, temperature=1.0, generator=rng)
    (guess,), _, _ = drafter.draft(drafts[-1], 1)
    drafter.draft(guess, 3, temperature=1.0, generator=rng)
    root, delta = server.verify(DraftTree.chain(root, drafts), [0, 1, 2, 3])
    settle(drafter, delta)
    clean.commit(delta)
    assert_same(drafter, clean)

    # A tree accepted along its deepest path: the same caches as a chain of those tokens accepted whole.
    tree = DraftTree.from_lists(drafter.draft_tree(root, depth=3, top_k=2, total_tokens=6))
    assert drafter.backend.rows() == drafter.verified_length()  # the tree's own rows are dropped
    path = tree.path_to(int(tree.depths.argmax()))
    root, delta = server.verify(tree, path)
    settle(drafter, delta)
    clean.commit(delta)
    assert_same(drafter, clean)

    # A tree grown ahead, after a chain and a guessed bonus, never answered; then a chain accepted in part.
    drafts, _, _ = drafter.draft(root, 2)
    drafter.draft_tree(drafts[-1], depth=2, top_k=2, total_tokens=4)
    root, delta = server.verify(DraftTree.chain(root, drafts), [0, 1])
    settle(drafter, delta)
    clean.commit(delta)
    assert_same(drafter, clean)
    assert drafter.verified_length() == server.cache.length


def test_a_tree_after_a_drafted_chain_starts_where_a_chain_step_would(models):
    target, ref, out = models
    drafter = OnnxDrafter.load(out)
    root, delta = Target(target, ref).open(PROMPT)
    drafter.begin(delta, capacity=64)
    ref.begin(delta, capacity=64)
    prefix, _, _ = drafter.draft(root, 2)
    held_before = drafter.backend.rows()
    tree = drafter.draft_tree(prefix[-1], depth=3, top_k=2, total_tokens=6)
    assert drafter.backend.rows() == held_before  # the prefix stays, the tree's rows go
    (step,), _, _ = drafter.draft(prefix[-1], 1)
    assert tree.tokens[1] == step  # the root's favourite child is what a chain step there drafts
    if drafter.kind == "moa":  # the torch MoA drafter grows the same tree after the same prefix
        assert ref.draft(root, 2)[0] == prefix
        want = ref.draft_tree(prefix[-1], depth=3, top_k=2, total_tokens=6)
        assert (tree.tokens, tree.parents) == (want.tokens.tolist(), want.parents.tolist())


@pytest.mark.parametrize("backend", ["onnx", "torch"])
def test_a_commit_that_keeps_drafts_takes_the_deltas_states_and_keeps_the_rows_after(models, backend):
    """The rule is the drafting loop's, so the torch drafters keep drafts as the ONNX one does."""
    target, ref, out = models
    if backend == "onnx":
        drafter, clean = OnnxDrafter.load(out), OnnxDrafter.load(out)
    else:  # shallow copies share the weights; begin() gives each caches of its own
        drafter, clean = copy.copy(ref), copy.copy(ref)
    kind = ref.dcfg.kind
    server = Target(target, ref)
    root, delta = server.open(PROMPT)
    for d in (drafter, clean):
        d.begin(delta, capacity=128)
    end = drafter.verified_length() + 4  # verified once round r (a root and 3 drafts) is accepted whole

    # Round r, then r + 1 drafted ahead after a guessed bonus, as the session drafts them.
    drafts, _, _ = drafter.draft(root, 3)
    (guess,), _, _ = drafter.draft(drafts[-1], 1)
    ahead, _, _ = drafter.draft(guess, 2)
    before = held(drafter)
    next_root, delta = server.verify(DraftTree.chain(root, drafts), [0, 1, 2, 3])
    assert drafter.commit(delta, keep_drafts=True)
    clean.commit(delta)
    assert drafter.verified_length() == clean.verified_length() == end
    assert held_rows(drafter) == end + 2  # the bonus guess and the first draft of r + 1
    kept, fresh = held(drafter), held(clean)
    # Verified rows are the delta's alone, as after a plain commit; the rows after them are as they were drafted.
    rows = ["sa_k", "sa_v"] if kind == "moa" else ["k", "v"]
    for name in rows:
        assert np.array_equal(kept[name][:end], fresh[name]), name
        assert np.array_equal(kept[name][end:], before[name][end:]), name
    if kind == "moa":
        for name in ("tli_k", "tli_v"):
            assert np.array_equal(kept[name][:, :end], fresh[name]), name
            assert np.array_equal(kept[name][:, end:], before[name][:, end:]), name
        for name in ("ctx_k", "ctx_v"):  # verified positions only
            assert np.array_equal(kept[name], fresh[name]), name
    else:
        assert np.array_equal(kept["last"], fresh["last"])
        assert np.array_equal(kept["next"], before["next"])  # from the feature the kept chain predicted
    drafter.draft(ahead[-1], 1)  # drafting goes on after the kept rows
    assert held_rows(drafter) == end + 3

    # With nothing drafted past a delta there is nothing to keep: a plain commit.
    for d in (drafter, clean):
        d.discard_drafts()
    more, _, _ = clean.draft(next_root, 2)
    assert drafter.draft(next_root, 2)[0] == more
    _, delta = server.verify(DraftTree.chain(next_root, more), [0, 1])
    for d in (drafter, clean):
        d.discard_drafts()
    assert not drafter.commit(delta, keep_drafts=True)
    clean.commit(delta)
    assert_same(drafter, clean)


# ---- drafting ahead behind queued rounds ---------------------------------------------------------------------

EOT = 6


class ScriptedDrafter:
    """Guesses from a script, drafts k 2s: enough to drive which rounds are fed when."""

    def __init__(self, guesses: list[int]):
        self.guesses, self.fed = list(guesses), []

    def feed(self, tokens, processing=None):
        if not tokens:
            return None
        self.fed.append(list(tokens))
        return self.guesses.pop(0)

    def draft(self, root, k, **_):
        if not isinstance(root, int):  # as the real drafters' gate refuses it
            raise TypeError(f"root {root!r}")
        return [2] * k, None, None


class Replies:
    """The stream's side Rounds drafts ahead against: sends recorded, a verdict in only when the test says so."""

    def __init__(self):
        self.sent, self.verdict_in = [], False

    def send(self, msg):
        self.sent.append(msg.round)

    def has_reply(self, stale=()):
        return self.verdict_in


@dataclasses.dataclass
class Link:
    """The server link as Rounds uses it while drafting ahead: the stream, and the server's ModelInfo."""

    stream: Replies
    info: pb.ModelInfo


def drafting_ahead(drafter: ScriptedDrafter) -> Rounds:
    """Rounds over a scripted drafter, greedy, two rounds sent behind the one in flight; no stop id but EOT."""
    cfg = ClientConfig(max_new_tokens=100, k=2, overlap_depth=2)
    text = SessionText()
    text.start(PROMPT, verified=len(PROMPT))
    check = generating(VOCAB)
    check.output.stop_ids = frozenset({EOT})
    link = Link(Replies(), pb.ModelInfo(max_draft_tokens=64, max_tree_nodes=0, overlapping_rounds=True))
    return Rounds(cfg, text, link, check.output, check, drafter, controls=cfg.controls(),
                  limits=Limits(max_positions=1024, max_draft_tokens=64, max_tree_nodes=0),
                  streams=lambda n: None, stopping=threading.Event())  # fmt: skip


def test_a_draft_ahead_with_every_pending_round_fed_drafts_after_the_guess_kept():
    # Round 1 in flight; round 2 drafted ahead on the guess 5 and sent; the guess after round 2 is end-of-text, so
    # nothing is drafted behind it. The verdict bears round 2 out and keeps the rows (greedy): round 2 is in flight,
    # every row it needs is held, and drafting ahead again must stop at that same guess, feeding nothing.
    drafter = ScriptedDrafter([5, EOT])
    rounds = drafting_ahead(drafter)
    first = rounds.draft(1, rounds.text.sequence, Shape(2, 2))
    rounds.send(first)
    assert rounds.fill_overlap() is None
    assert [a.bonus for a in rounds.queued] == [5]
    assert drafter.fed == [[first.msg.tokens[-1]], [rounds.queued[0].round.msg.tokens[-1]]]
    second = rounds.queued.pop(0).round  # borne out, rows kept: what Rounds.step does on such a verdict
    rounds.inflight = second
    assert rounds.fill_overlap() is None  # the end-of-text guess kept: nothing drafted, nothing fed
    assert drafter.fed == [[first.msg.tokens[-1]], [second.msg.tokens[-1]]]
    assert rounds.queued == [] and [m.round for m in rounds.link.stream.sent] == [1, 2]
