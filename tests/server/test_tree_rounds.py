"""Tree drafts over the wire (tether.v1 DraftRound.parents, Verdict.path): real gRPC against an in-process server
with tiny models, driven by a test client that speaks the protocol directly.

- greedy: a tree whose one branch is the target's own continuation is accepted along that branch, wrong siblings
  before it or not, with the tokens, bonus and delta a chain of that branch gets; whole sessions of the torch
  drafter's dynamic trees equal plain greedy decoding, re-sent rounds answered from the record;
- sampling: tree rounds with a q row per node (sampled siblings drawn without replacement) emit tokens distributed
  as the target's own sampling: the first and second token a round emits, counted per context over many seeded
  sessions, against the target's law in that context (a chi-square summed over the contexts; fixed seeds, so the
  outcome is fixed for given code); the same statistic against another temperature fails, so it has power;
- malformed trees are refused with REASON_INVALID_REQUEST for that round alone, before any randomness is drawn;
- chain rounds without parents answer as they always have; chain and tree rounds of different sessions in one
  batcher step get the verdicts each gets alone.

    .venv/bin/python -m pytest -q tests/server/test_tree_rounds.py
"""

import collections
import math
import queue
import threading

import grpc
import pytest
import torch
from tiny_models import tiny_moa_drafter, tiny_target

from tether.server.engine_core import Engine
from tether.server.rpc_server import make_server
from tether.server.serve_config import ServiceConfig
from tether.server.service import TetherService
from tether.shared.codecs import decode_many
from tether.shared.drafter import POSITION_AXIS, DraftDelta
from tether.shared.speculative import target_probs
from tether.shared.tokenizer import Tokenizer
from tether.v1 import tether_pb2 as pb
from tether.v1 import tether_pb2_grpc

pytestmark = pytest.mark.heavy  # a long file, started first (tests/conftest.py)

FP = "f" * 64
VOCAB = 7  # small, so drafts are often right and every acceptance path runs
LIMIT = 8  # the server's max_draft_tokens: the most nodes of a tree round
INVALID = (pb.REASON_INVALID_REQUEST, grpc.StatusCode.INVALID_ARGUMENT.value[0])


@pytest.fixture(scope="module")
def served():
    target = tiny_target(vocab_size=VOCAB)
    drafter = tiny_moa_drafter(target)
    tok = Tokenizer.train(texts=["def f(x):\n    return x\n"] * 20, vocab_size=260)
    config = ServiceConfig(max_prompt_tokens=64, max_sessions=16, max_draft_tokens=LIMIT, max_new_tokens=96)
    service = TetherService(Engine(target, drafter, tok, config, model_fingerprint=FP))
    server, port = make_server(service, "127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield target, drafter, service, tether_pb2_grpc.TetherStub(channel)
    channel.close()
    server.stop(grace=None)


class Client:
    """One Session stream, driven message by message (`post` and `reply` apart, to have rounds in flight)."""

    def __init__(self, stub):
        self.outbox: queue.Queue = queue.Queue()
        self.replies = stub.Session(iter(self.outbox.get, None))

    def post(self, msg: pb.ClientMessage) -> None:
        self.outbox.put(msg)

    def reply(self) -> pb.ServerMessage:
        return next(self.replies)

    def send(self, msg: pb.ClientMessage) -> pb.ServerMessage:
        self.post(msg)
        return self.reply()

    def close(self) -> None:
        self.outbox.put(None)


def open_session(stub, prompt, sampling=None) -> tuple[Client, pb.Opened]:
    client = Client(stub)
    opened = client.send(pb.ClientMessage(open=pb.OpenSession(prompt=prompt, max_new_tokens=96, sampling=sampling,
                                                              model_fingerprint=FP))).opened  # fmt: skip
    assert opened.session_id
    return client, opened


def draft(rnd: int, root: int, tokens, parents=(), q=()) -> pb.ClientMessage:
    q = [pb.SparseDistribution(ids=ids, probs=probs) for ids, probs in q]
    return pb.ClientMessage(round=pb.DraftRound(round=rnd, root=root, tokens=tokens, parents=parents, q=q))


def plain(target, prompt, n) -> list[int]:
    return list(target.generate(torch.tensor([prompt]), n))


def wrong(token: int) -> int:
    return (token + 1) % VOCAB


def to_delta(kv: pb.KVDelta) -> DraftDelta:
    return DraftDelta(start=kv.start, tokens=list(kv.tokens), tensors=decode_many(kv.payload))


def assert_same_delta(a: pb.KVDelta, b: pb.KVDelta) -> None:
    """The same positions and tokens, and states equal to bfloat16 rounding (the two forwards had other shapes)."""
    assert (a.start, list(a.tokens)) == (b.start, list(b.tokens))
    ta, tb = decode_many(a.payload), decode_many(b.payload)
    assert ta.keys() == tb.keys()
    for name in ta:
        assert ta[name].shape[POSITION_AXIS[name]] == len(a.tokens), name
        torch.testing.assert_close(ta[name].float(), tb[name].float(), rtol=2e-2, atol=2e-2)


def test_model_info_advertises_the_tree_limit(served):
    *_, stub = served
    info = stub.GetModelInfo(pb.GetModelInfoRequest())
    assert info.max_tree_nodes == info.max_draft_tokens == LIMIT


def test_greedy_tree_is_accepted_along_the_targets_branch_as_its_chain_would_be(served):
    target, _, _, stub = served
    prompt = [1, 2, 3, 4, 5, 6, 0, 1]
    g = plain(target, prompt, 6)  # g[0] is the first token: the root of round 1
    # Node 1 is a wrong sibling before the right one (node 2); node 3 holds the right token under the wrong
    # branch; under node 2 a wrong child (4) comes before the right one (5), then node 6 continues it.
    tokens = [wrong(g[1]), g[1], g[2], wrong(g[2]), g[2], g[3]]
    tree_client, opened = open_session(stub, prompt)
    tree = tree_client.send(draft(1, g[0], tokens, parents=[0, 0, 1, 2, 2, 5])).verdict
    chain_client, _ = open_session(stub, prompt)
    chain = chain_client.send(draft(1, g[0], g[1:4])).verdict
    assert opened.first_token == g[0]
    assert list(tree.path) == [2, 5, 6] and tree.accepted == 3 and tree.bonus == g[4]
    assert (chain.accepted, chain.bonus, list(chain.path)) == (3, g[4], [])
    assert list(tree.delta.tokens) == g[:4] and tree.delta.start == len(prompt)  # the root + the path
    assert_same_delta(tree.delta, chain.delta)
    # The tree round committed exactly its path: both sessions go on alike, and as plain greedy decoding.
    after_tree = tree_client.send(draft(2, g[4], [g[5], wrong(g[5])], parents=[0, 1])).verdict
    after_chain = chain_client.send(draft(2, g[4], [g[5], wrong(g[5])])).verdict
    g = plain(target, prompt, 8)
    assert (list(after_tree.path), after_tree.bonus) == ([1], g[6]) and after_chain.bonus == g[6]
    assert_same_delta(after_tree.delta, after_chain.delta)
    tree_client.close()
    chain_client.close()


@pytest.mark.parametrize(
    "shape, expect",
    [
        ("no branch right", ([], 1)),  # every root child wrong: nothing accepted, the bonus is the target's next
        ("right then wrong", ([2], 2)),  # the right child, then only wrong grandchildren
        ("right branch is last", ([3, 4], 3)),
    ],
)
def test_greedy_tree_paths_and_bonus(served, shape, expect):
    target, _, _, stub = served
    prompt = [3, 1, 4, 1, 5]
    g = plain(target, prompt, 5)
    trees = {
        "no branch right": ([wrong(g[1]), wrong(wrong(g[1])), g[2]], [0, 0, 1]),
        "right then wrong": ([wrong(g[1]), g[1], wrong(g[2]), wrong(wrong(g[2]))], [0, 0, 2, 2]),
        "right branch is last": ([wrong(g[1]), g[2], g[1], g[2]], [0, 1, 0, 3]),
    }
    tokens, parents = trees[shape]
    client, _ = open_session(stub, prompt)
    v = client.send(draft(1, g[0], tokens, parents)).verdict
    path, accepted = expect
    assert list(v.path) == path and v.accepted == len(path) and v.bonus == g[accepted]
    assert list(v.delta.tokens) == g[:accepted]
    client.close()


def test_dynamic_tree_rounds_equal_plain_greedy_and_repeats_are_idempotent(served):
    """Whole sessions of the torch drafter's EAGLE-2 trees, sent as they are (parents[1:] is the wire's numbering):
    the text is plain greedy decoding's, each verdict's path is a root-to-node path of the tree sent, and a round
    sent again gets the recorded answer, byte for byte."""
    target, drafter, _, stub = served
    prompt = [4, 4, 1, 2, 5, 0]
    client, opened = open_session(stub, prompt)
    drafter.begin(to_delta(opened.delta))
    out, root, rnd, branched = [opened.first_token], opened.first_token, 0, 0
    while len(out) < 40:
        tree = drafter.draft_tree(root, depth=3, top_k=2, total_tokens=6)
        tokens, parents = tree.tokens[1:].tolist(), tree.parents[1:].tolist()
        branched += not tree.is_chain
        rnd += 1
        msg = draft(rnd, root, tokens, parents)
        reply = client.send(msg)
        if rnd % 3 == 0:
            assert client.send(msg).SerializeToString() == reply.SerializeToString()
        v = reply.verdict
        path = list(v.path)
        assert [parents[i - 1] for i in path] == [0, *path[:-1]] and v.accepted == len(path)
        accepted = [tokens[i - 1] for i in path]
        assert list(v.delta.tokens) == [root, *accepted]
        drafter.commit(to_delta(v.delta))
        out += [*accepted, v.bonus]
        root = v.bonus
    client.close()
    assert branched > 0  # the drafter did send trees, not only chains
    assert out == plain(target, prompt, len(out))


# ---- sampling -------------------------------------------------------------------------------------------------

# What the root's children and their children are drawn from: whatever the context (so neither is the target's
# law), over all tokens, so that every kind of path is accepted now and then.
Q_ROOT = ([0, 1, 2, 3, 4, 5, 6], [0.3, 0.2, 0.15, 0.1, 0.1, 0.1, 0.05])
Q_CHILD = ([6, 5, 4, 3, 2, 1, 0], [0.3, 0.2, 0.15, 0.1, 0.1, 0.1, 0.05])
SAMPLING = dict(temperature=1.0, top_p=0.9)  # top_p leaves some drafted tokens at target probability 0
TRIALS = 600  # sessions of one sampled tree round


def without(q, token: int):
    """q renormalised over what is left once `token` is drawn (a sibling drawn without replacement)."""
    ids, probs = q
    left = [0.0 if i == token else p for i, p in zip(ids, probs, strict=True)]
    return ids, [p / sum(left) for p in left]


def draw(q, gen: torch.Generator) -> int:
    ids, probs = q
    return ids[int(torch.multinomial(torch.tensor(probs), 1, generator=gen))]


def sampled_tree(gen: torch.Generator) -> tuple[list[int], list[int], list]:
    """Five nodes: two root children drawn from Q_ROOT without replacement; one child under the first, two under
    the second drawn from Q_CHILD without replacement. Returns tokens, parents and the q row of each node."""
    a = draw(Q_ROOT, gen)
    q_b = without(Q_ROOT, a)
    b = draw(q_b, gen)
    c, d = draw(Q_CHILD, gen), draw(Q_CHILD, gen)
    q_e = without(Q_CHILD, d)
    e = draw(q_e, gen)
    return [a, b, c, d, e], [0, 0, 1, 2, 2], [Q_ROOT, q_b, Q_CHILD, Q_CHILD, q_e]


def law(target, context: list[int], temperature: float, top_p: float) -> list[float]:
    """The target's distribution of the token after `context`, under the session's sampling rule."""
    with torch.no_grad():
        return target_probs(target(torch.tensor([context]))[0, -1], temperature, top_p).tolist()


def chi_square(counts: dict[tuple, collections.Counter], law_after) -> tuple[float, int]:
    """Pearson's statistic of the tokens seen after each context against law_after(context), summed over the
    contexts, with the cells expected fewer than 5 times pooled: (statistic, degrees of freedom)."""
    stat, df = 0.0, 0
    for context, seen in counts.items():
        p, n = law_after(context), seen.total()
        assert all(p[y] > 0 for y in seen), "emitted a token the target gives zero probability"
        big = [y for y in range(VOCAB) if n * p[y] >= 5]
        cells = [(seen[y], n * p[y]) for y in big]
        rest = (n - sum(seen[y] for y in big), n * (1 - sum(p[y] for y in big)))
        cells += [rest] if rest[1] > 1e-9 else []
        stat += sum((o - e) ** 2 / e for o, e in cells)
        df += len(cells) - 1
    return stat, df


def bound(df: int) -> float:
    return df + 6 * math.sqrt(2 * df)  # the chi-square law's mean plus six standard deviations


def test_sampled_tree_rounds_are_lossless(served):
    """Per seed: a session of one prompt, then one sampled tree round after its (sampled) first token. The first
    token the round emits follows the target's law after the prompt and that root; a second one, emitted by the same
    round below an accepted node, the law after that node's token too."""
    target, _, _, stub = served
    prompt = [1, 2, 3]
    first, second = collections.defaultdict(collections.Counter), collections.defaultdict(collections.Counter)
    paths = []
    for seed in range(TRIALS):
        client, opened = open_session(stub, prompt, pb.SamplingParams(seed=seed, **SAMPLING))
        # Drafted with a generator of its own: drafts tied to the verifier's random numbers would not be lossless.
        tokens, parents, q = sampled_tree(torch.Generator().manual_seed(10**6 + seed))
        root = opened.first_token
        v = client.send(draft(1, root, tokens, parents, q)).verdict
        client.close()
        paths.append(list(v.path))
        emitted = [tokens[i - 1] for i in v.path] + [v.bonus]
        first[(root,)][emitted[0]] += 1
        if len(emitted) > 1:
            second[root, emitted[0]][emitted[1]] += 1
    # Every kind of path ran: nothing accepted, either sibling, and a grandchild under each (both under the second).
    assert {(), (1,), (2,), (1, 3), (2, 4), (2, 5)} <= {tuple(p) for p in paths}
    for counts in (first, second):
        stat, df = chi_square(counts, lambda context: law(target, prompt + list(context), **SAMPLING))
        assert df >= 10 and stat < bound(df)
        # Power: the same statistic tells the law at another temperature apart.
        stat, df = chi_square(counts, lambda context: law(target, prompt + list(context), 0.5, 1.0))
        assert stat > bound(df)


# ---- refusals -------------------------------------------------------------------------------------------------


def test_malformed_trees_are_refused_alone_and_the_session_goes_on(served):
    """Each malformed round is refused as invalid before anything runs: a greedy session then verifies its next
    good round as plain decoding, and a sampled one gets the verdict a fresh session with its seed gets (the
    refusals drew none of its random numbers)."""
    target, _, _, stub = served
    prompt = [6, 5, 4, 3]
    g = plain(target, prompt, 4)
    structure = {
        "parent after its node": ([1, 2], [0, 2]),
        "parent is the node itself": ([1], [1]),
        "negative parent": ([1, 2], [0, -1]),
        "fewer parents than tokens": ([1, 2, 3], [0, 1]),
        "more parents than tokens": ([1, 2], [0, 1, 2]),
        "parents without tokens": ([], [0]),
        "more nodes than max_tree_nodes": ([1] * (LIMIT + 1), list(range(LIMIT + 1))),
    }
    client, opened = open_session(stub, prompt)
    for name, (tokens, parents) in structure.items():
        e = client.send(draft(1, g[0], tokens, parents)).error
        assert (e.reason, e.code, e.round) == (*INVALID, 1), name
    # A chain over the limit keeps the answer older clients have always had.
    assert client.send(draft(1, g[0], [1] * (LIMIT + 1))).error.reason == pb.REASON_TOO_LONG
    v = client.send(draft(1, g[0], [wrong(g[1]), g[1], g[2]], [0, 0, 2])).verdict
    assert (list(v.path), v.bonus) == ([2, 3], g[3])
    client.close()

    sampling = pb.SamplingParams(seed=11, **SAMPLING)
    tokens, parents, q = [0, 1, 3], [0, 0, 1], [Q_ROOT, without(Q_ROOT, 0), Q_CHILD]
    proposals = {
        "fewer q rows than nodes": q[:2],
        "more q rows than nodes": q + [Q_CHILD],
        "rows of different widths": [Q_ROOT, without(Q_ROOT, 0), (Q_CHILD[0][:3], [0.5, 0.3, 0.2])],
        "a row that is not a distribution": [Q_ROOT, (Q_ROOT[0], [0.1] * VOCAB), Q_CHILD],
        "a token without probability in its row": [Q_ROOT, without(Q_ROOT, 1), Q_CHILD],  # node 2 is token 1
        "a q id outside the vocabulary": [Q_ROOT, without(Q_ROOT, 0), ([VOCAB, *Q_CHILD[0][1:]], Q_CHILD[1])],
    }
    client, opened = open_session(stub, prompt, sampling)
    for name, rows in proposals.items():
        e = client.send(draft(1, opened.first_token, tokens, parents, rows)).error
        assert (e.reason, e.code, e.round) == (*INVALID, 1), name
    good = draft(1, opened.first_token, tokens, parents, q)
    after_refusals = client.send(good).verdict
    client.close()
    fresh, _ = open_session(stub, prompt, sampling)
    assert after_refusals.SerializeToString() == fresh.send(good).verdict.SerializeToString()
    fresh.close()


def test_chain_rounds_without_parents_answer_as_before_and_tree_rounds_repeat(served):
    """A chain sent without parents (an older client) and the same chain sent as a tree get the same verdict and
    delta, byte for byte; only the tree round's reply names its path. A re-sent tree round gets the recorded
    answer and the next round follows it."""
    target, _, _, stub = served
    prompt = [2, 2, 5, 1]
    g = plain(target, prompt, 6)
    chain = [g[1], g[2], wrong(g[3])]
    old, _ = open_session(stub, prompt)
    as_chain = old.send(draft(1, g[0], chain)).verdict
    new, _ = open_session(stub, prompt)
    as_tree = new.send(draft(1, g[0], chain, parents=[0, 1, 2])).verdict
    assert list(as_chain.path) == [] and list(as_tree.path) == [1, 2]
    del as_tree.path[:]
    assert as_tree.SerializeToString() == as_chain.SerializeToString()
    assert (as_chain.accepted, as_chain.bonus) == (2, g[3])
    tree_round = draft(2, g[3], [wrong(g[4]), g[4], g[5]], parents=[0, 0, 2])
    first = new.send(tree_round)
    assert new.send(tree_round).SerializeToString() == first.SerializeToString()
    assert list(first.verdict.path) == [2, 3]
    third = new.send(draft(3, first.verdict.bonus, [])).verdict
    assert third.bonus == plain(target, prompt, 8)[7]
    old.close()
    new.close()


# ---- batching -------------------------------------------------------------------------------------------------


def test_chain_and_tree_rounds_in_one_step_get_their_verdicts_alone(served, monkeypatch):
    """Greedy and sampled chains and trees from four sessions wait while the batcher's step is held, so they run
    as its next step together; each verdict equals the one its round gets in a session of its own."""
    import tether.server.batcher as batcher_module

    target, _, service, stub = served
    sampled = pb.SamplingParams(seed=5, **SAMPLING)
    gen = torch.Generator().manual_seed(3)
    tree_tokens, tree_parents, tree_q = sampled_tree(gen)
    chain_q = [Q_ROOT, Q_CHILD]
    chain_tokens = [draw(Q_ROOT, gen), draw(Q_CHILD, gen)]
    prompts = {"greedy chain": [1, 3, 5], "greedy tree": [2, 4, 6, 1], "sampled chain": [0, 5, 3],
               "sampled tree": [6, 6, 2]}  # fmt: skip

    gc, gt = plain(target, prompts["greedy chain"], 3), plain(target, prompts["greedy tree"], 3)

    def round_of(name: str, root: int) -> pb.ClientMessage:
        return {
            "greedy chain": lambda: draft(1, root, [gc[1], wrong(gc[2])]),
            "greedy tree": lambda: draft(1, root, [wrong(gt[1]), gt[1], gt[2]], [0, 0, 2]),
            "sampled chain": lambda: draft(1, root, chain_tokens, q=chain_q),
            "sampled tree": lambda: draft(1, root, tree_tokens, tree_parents, tree_q),
        }[name]()

    def sampling(name: str):
        return sampled if name.startswith("sampled") else None

    alone = {}
    for name, prompt in prompts.items():
        client, opened = open_session(stub, prompt, sampling(name))
        alone[name] = client.send(round_of(name, opened.first_token)).verdict
        client.close()

    steps, entered, release = [], threading.Event(), threading.Event()
    real = batcher_module.verify_batch

    def held_first_step(target, items, **kwargs):
        steps.append(len(items))
        if len(steps) == 1:
            entered.set()
            assert release.wait(60), "the test never released the held step"
        return real(target, items, **kwargs)

    monkeypatch.setattr(batcher_module, "verify_batch", held_first_step)
    hold, hold_opened = open_session(stub, [1, 1, 1])
    clients, first = {}, {}
    for name, prompt in prompts.items():
        clients[name], opened = open_session(stub, prompt, sampling(name))
        first[name] = opened.first_token
    hold.post(draft(1, hold_opened.first_token, [1]))
    assert entered.wait(60)
    for name, client in clients.items():
        client.post(round_of(name, first[name]))
    for _ in range(6000):  # until all four wait in the batcher's inbox (bounded: 60 s at most)
        if service.engine.batcher.inbox.qsize() == len(prompts):
            break
        threading.Event().wait(0.01)
    release.set()
    assert hold.reply().verdict.round == 1
    together = {name: c.reply().verdict for name, c in clients.items()}
    assert steps[:2] == [1, len(prompts)]  # the four rounds ran as one step
    for name in prompts:
        a, b = together[name], alone[name]
        assert (a.accepted, a.bonus, list(a.path)) == (b.accepted, b.bonus, list(b.path)), name
        assert_same_delta(a.delta, b.delta)
    assert list(together["greedy tree"].path) == [2, 3]
    for c in (hold, *clients.values()):
        c.close()
