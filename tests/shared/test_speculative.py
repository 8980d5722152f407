"""The speculative decoding core: tree bookkeeping, greedy verification against the target model and its KV cache,
losslessness of rejection sampling (with negative controls that prove the statistics can fail), and EAGLE-2
dynamic tree expansion against a brute-force reference."""

import dataclasses
import math

import pytest
import torch

import tether.shared.speculative as speculative
from tether.shared.config import PRESETS
from tether.shared.model import Transformer
from tether.shared.sampling import probabilities
from tether.shared.speculative import (
    DraftTree,
    GrowingTree,
    Verdict,
    accept_length_stats,
    expand_dynamic_tree,
    verify,
)

V = 6  # vocabulary of the statistical tests
N = 20_000  # trials per statistical test
ROOT = 0  # the root token never matters to the verifier: only the logits rows do


def peaked_logits(argmaxes: list[int], vocab: int = 16, seed: int = 0) -> torch.Tensor:
    """[len(argmaxes), vocab] random logits whose row i has its argmax at argmaxes[i]."""
    logits = torch.randn(len(argmaxes), vocab, generator=torch.Generator().manual_seed(seed))
    logits[torch.arange(len(argmaxes)), argmaxes] = 10.0
    return logits


# ---------------------------------------------------------------------------------------------- tree bookkeeping


def hand_tree() -> DraftTree:
    # 0 -> {1, 2}; 1 -> {3, 4}; 2 -> {5}; 4 -> {6, 7}
    return DraftTree(torch.tensor([11, 5, 7, 9, 2, 9, 3, 4]), torch.tensor([-1, 0, 0, 1, 1, 2, 4, 4]))


def test_tree_structure():
    tree = hand_tree()
    assert len(tree) == 8
    assert tree.depths.tolist() == [0, 1, 1, 2, 2, 2, 3, 3]
    assert tree.positions(10).tolist() == [10, 11, 11, 12, 12, 12, 13, 13]
    assert tree.children(0) == [1, 2] and tree.children(4) == [6, 7] and tree.children(3) == []
    assert tree.path_to(7) == [0, 1, 4, 7] and tree.path_to(5) == [0, 2, 5] and tree.path_to(0) == [0]
    mask = tree.ancestor_mask()
    expected = torch.zeros(8, 8, dtype=torch.bool)
    for i in range(8):
        expected[i, tree.path_to(i)] = True
    assert torch.equal(mask, expected)
    assert mask[6].nonzero().flatten().tolist() == [0, 1, 4, 6]


def test_chain_constructor():
    chain = DraftTree.chain(3, [8, 1, 4])
    assert chain.tokens.tolist() == [3, 8, 1, 4] and chain.parents.tolist() == [-1, 0, 1, 2]
    assert torch.equal(chain.ancestor_mask(), torch.ones(4, 4, dtype=torch.bool).tril())
    assert chain.q_ids is None and chain.depths.tolist() == [0, 1, 2, 3]
    q_ids = torch.tensor([[8, 2], [1, 0], [5, 4]])
    q_probs = torch.tensor([[0.7, 0.3], [0.5, 0.5], [0.1, 0.9]])
    sampled = DraftTree.chain(3, torch.tensor([8, 1, 4]), q_ids, q_probs)
    assert sampled.q_ids.shape == (4, 2) and torch.equal(sampled.q_ids[1:], q_ids)
    assert torch.equal(sampled.q_probs[1:], q_probs)


def test_tree_validation():
    with pytest.raises(ValueError):
        DraftTree(torch.tensor([1, 2, 3]), torch.tensor([-1, 2, 0]))  # a parent after its child
    with pytest.raises(ValueError):
        DraftTree(torch.tensor([1, 2]), torch.tensor([0, 0]))  # a root with a parent
    with pytest.raises(ValueError):
        DraftTree.chain(1, [2], torch.tensor([[2, 3]]), torch.tensor([[0.5, 0.2]]))  # q does not sum to 1
    with pytest.raises(ValueError):
        verify(DraftTree.chain(1, [2]), torch.zeros(3, V))  # one logits row per node


# ---------------------------------------------------------------------------------------------- greedy


@pytest.mark.parametrize(
    "argmaxes,path,bonus",
    [
        ([5, 2, 7, 1], [0, 1, 2, 3], 1),  # all accepted: the bonus comes from the last node's row
        ([4, 2, 7, 1], [0], 4),  # first rejected: only the bonus
        ([5, 3, 7, 1], [0, 1], 3),  # middle rejected
        ([5, 2, 0, 1], [0, 1, 2], 0),  # last rejected
    ],
)
def test_greedy_chain(argmaxes, path, bonus):
    tree = DraftTree.chain(9, [5, 2, 7])
    verdict = verify(tree, peaked_logits(argmaxes))
    assert verdict == Verdict(path, bonus)
    assert verdict.accepted == len(path) - 1 and verdict.tau == len(path)
    assert verdict.accepted_tokens(tree) == [5, 2, 7][: len(path) - 1]
    assert verdict.emitted_tokens(tree) == [5, 2, 7][: len(path) - 1] + [bonus]


def test_greedy_tree_follows_the_target_branch():
    tree = hand_tree()  # tokens 0:11 1:5 2:7 3:9 4:2 5:9 6:3 7:4
    # Second sibling at the root, then a single child, then a rejection.
    assert verify(tree, peaked_logits([7, 0, 9, 0, 0, 1, 0, 0])) == Verdict([0, 2, 5], 1)
    # First sibling, second sibling, second sibling, then the leaf's own prediction.
    assert verify(tree, peaked_logits([5, 2, 0, 0, 4, 0, 0, 13])) == Verdict([0, 1, 4, 7], 13)
    # Token 9 sits under both root children; only the branch the target took counts.
    assert verify(tree, peaked_logits([5, 9, 0, 0, 0, 6, 0, 0])) == Verdict([0, 1, 3], 0)
    assert verify(tree, peaked_logits([8, 9, 0, 0, 0, 6, 0, 0])) == Verdict([0], 8)
    # Greedy ignores the proposal distributions entirely.
    q_tree = dataclasses.replace(tree, q_ids=torch.zeros(8, 1, dtype=torch.long), q_probs=torch.ones(8, 1))
    assert verify(q_tree, peaked_logits([7, 0, 9, 0, 0, 1, 0, 0])) == Verdict([0, 2, 5], 1)


def make_target(seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(PRESETS["tiny"]).eval()
    with torch.no_grad():  # far from uniform, so greedy tokens are well separated
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    return model


@pytest.mark.parametrize("shape", ["chain", "tree"])
@torch.no_grad()
def test_greedy_speculative_decoding_equals_plain_greedy(shape):
    """Drafts that are partly right, verified through Transformer.verify and committed with KVCache.accept,
    reproduce plain greedy decoding token for token (the project-wide invariant)."""
    model = make_target()
    vocab = model.cfg.vocab_size
    prompt = torch.randint(0, vocab, (1, 8), generator=torch.Generator().manual_seed(3))
    n_new = 30
    reference = list(model.generate(prompt, n_new))
    cache = model.new_cache(1, 64)
    # The last prompt token is the first root: it goes through verify with the first draft.
    model.prefill(prompt[:, :-1], cache)
    root, emitted, verdicts = int(prompt[0, -1]), [], []
    k = 4
    while len(emitted) < n_new:
        truth = reference[len(emitted) : len(emitted) + k] + [0] * k  # padded past the end
        wrong = len(verdicts) % (k + 1)  # the first wrong draft position, rotating through every case
        draft = [t if i < wrong else (t + 1) % vocab for i, t in enumerate(truth[:k])]
        if shape == "chain":
            tree = DraftTree.chain(root, draft)
        else:
            # Each level has the right token and a wrong sibling, the right one first or second in turn.
            tokens, parents, on_path = [root], [-1], 0
            for depth, t in enumerate(draft):
                pair = [t, (t + 7) % vocab] if depth % 2 else [(t + 7) % vocab, t]
                for tok in pair:
                    tokens.append(tok)
                    parents.append(on_path)
                on_path = len(tokens) - 2 + pair.index(t)
            tree = DraftTree(torch.tensor(tokens), torch.tensor(parents))
        out = model.verify(
            tree.tokens[None], cache, tree_mask=tree.ancestor_mask(), positions=tree.positions(cache.length)
        )
        verdict = verify(tree, out.logits[0])
        cache.accept(verdict.path)
        emitted += verdict.emitted_tokens(tree)
        verdicts.append(verdict)
        root = verdict.bonus
        # Everything emitted is committed except the newest root, whose K/V the next verify computes.
        assert cache.length == prompt.shape[1] + len(emitted) - 1
    assert emitted[:n_new] == reference
    assert {v.accepted for v in verdicts} >= {0, 1, 2, 3}  # the rotation exercised early and late rejections
    # The accepted paths left the cache exactly as one prefill of the whole decided sequence would.
    fresh = model.new_cache(1, 64)
    model.prefill(torch.cat([prompt, torch.tensor([emitted[:-1]])], 1), fresh)
    assert fresh.length == cache.length
    torch.testing.assert_close(cache.k[:, :, : cache.length], fresh.k[:, :, : fresh.length], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(cache.v[:, :, : cache.length], fresh.v[:, :, : fresh.length], rtol=1e-4, atol=1e-4)
    stats = accept_length_stats(verdicts)
    assert stats["rounds"] == len(verdicts) and stats["tokens"] == len(emitted)
    assert stats["mean_tau"] == pytest.approx(len(emitted) / len(verdicts))


def test_accept_length_stats():
    stats = accept_length_stats([Verdict([0, 1, 2], 5), Verdict([0], 1), Verdict([0, 3], 2)])
    assert stats == {"rounds": 3, "mean_tau": 2.0, "tokens": 6}
    assert accept_length_stats([])["rounds"] == 0


# ---------------------------------------------------------------------------------------------- sampling


def total_variation(counts: torch.Tensor, p: torch.Tensor) -> float:
    return 0.5 * float((counts / counts.sum() - p).abs().sum())


def assert_matches(counts: torch.Tensor, p: torch.Tensor) -> None:
    """Empirical counts [C] follow p [C]: nothing where p is 0, small TV, and a chi-square statistic within
    df + 6 sqrt(2 df) (mean plus six standard deviations of the chi-square law: a 1e-4-ish false alarm)."""
    p = p.double().flatten()
    counts = counts.double().flatten()
    assert float(counts[p == 0].sum()) == 0, "emitted a token the target gives zero probability"
    assert total_variation(counts, p) < 0.02
    n, live = counts.sum(), p > 0
    chi2 = float(((counts[live] - n * p[live]) ** 2 / (n * p[live])).sum())
    df = int(live.sum()) - 1
    assert chi2 < df + 6 * math.sqrt(2 * df), f"chi-square {chi2:.1f} with {df} degrees of freedom"


def target_p(logits: torch.Tensor, temperature: float, top_p: float, top_k: int = 0) -> torch.Tensor:
    return probabilities(logits, temperature, top_p, top_k).double()


SETUPS = {
    # Random target logits; the drafter's top-3 support is the target's three LEAST likely tokens, weighted
    # against the target, so most draft tokens get rejected and most of p lies outside q's support.
    "t1": dict(seed=3, temperature=1.0, top_p=1.0, top_k=0),
    # Top-p leaves some tokens at p = 0; the drafter proposes some of those.
    "t0.7-p0.8": dict(seed=1, temperature=0.7, top_p=0.8, top_k=0),
    # Top-k alone, and top-k then top-p: more tokens at p = 0, cut by rank rather than by mass.
    "t1.5-k4": dict(seed=5, temperature=1.5, top_p=1.0, top_k=4),
    "t1.3-k5-p0.95": dict(seed=2, temperature=1.3, top_p=0.95, top_k=5),
}


def make_setup(seed: int, temperature: float, top_p: float, top_k: int):
    logits = 1.5 * torch.randn(V, generator=torch.Generator().manual_seed(seed))  # [V]
    p = target_p(logits, temperature, top_p, top_k)
    q_ids = logits.argsort()[:3]  # [3] the least likely first
    q_probs = torch.tensor([0.6, 0.3, 0.1])  # [3]
    return logits, p, q_ids, q_probs


def first_token_counts(sampler, logits, q_ids, q_probs, temperature, top_p, top_k=0, seed=0) -> torch.Tensor:
    """Draft one token from q, let `sampler` verify it, count the first emitted token over N trials."""
    g = torch.Generator().manual_seed(seed)
    draws = torch.multinomial(q_probs, N, replacement=True, generator=g).tolist()
    support = q_ids.tolist()
    trees = [DraftTree.chain(ROOT, [t], q_ids[None], q_probs[None]) for t in support]
    rows = logits[None].expand(2, V)  # [2, V] row 1 (after the draft token) never decides the first token
    counts = [0] * V  # a list: indexing a tensor would cost more than the verification
    for d in draws:
        verdict = sampler(trees[d], rows, temperature=temperature, top_p=top_p, top_k=top_k, generator=g)
        counts[support[d] if verdict.accepted else verdict.bonus] += 1
    return torch.tensor(counts)


def wrong_sampler(mistake: str, p: torch.Tensor, q_ids: torch.Tensor, q_probs: torch.Tensor):
    """A verifier for one-token drafts that is WRONG on purpose, with verify's signature (p and q fixed up front):

    accept_with_p: accepts with probability p(x) instead of min(1, p(x) / q(x)), then draws from the residual.
    resample_from_p: the right acceptance test, but a rejection draws from p instead of the residual.
    """
    q = torch.zeros(V, dtype=torch.float64).index_add(0, q_ids, q_probs.double())
    residual = (p - q).clamp(min=0)
    bonus_law = p if mistake == "resample_from_p" else residual / residual.sum()
    cdf = bonus_law.cumsum(0)
    p_list, q_list = p.tolist(), q.tolist()

    def sampler(tree, logits, *, temperature, top_p, top_k, generator):
        x = int(tree.tokens[1])
        u, v = torch.rand(2, dtype=torch.float64, generator=generator).tolist()
        accept_prob = p_list[x] if mistake == "accept_with_p" else p_list[x] / q_list[x]
        if u < accept_prob:
            return Verdict([0, 1], 0)
        return Verdict([0], int(torch.searchsorted(cdf, torch.tensor(v * float(cdf[-1])), right=True)))

    return sampler


@pytest.mark.parametrize("name", list(SETUPS))
def test_rejection_sampling_is_lossless_chain(name):
    cfg = SETUPS[name]
    logits, p, q_ids, q_probs = make_setup(**cfg)
    # The setup is as hostile as intended: q's support misses tokens p allows, and (top-p) hits tokens p forbids.
    outside = torch.ones(V, dtype=torch.bool)
    outside[q_ids] = False
    assert float(p[outside].sum()) > 0.5
    if cfg["top_p"] < 1 or cfg["top_k"]:
        assert float(p[q_ids].min()) == 0
    counts = first_token_counts(verify, logits, q_ids, q_probs, cfg["temperature"], cfg["top_p"], cfg["top_k"])
    assert_matches(counts, p)


@pytest.mark.parametrize("mistake", ["accept_with_p", "resample_from_p"])
def test_negative_control_wrong_samplers_fail(mistake):
    """The same harness and bounds reject a verifier with a classic mistake: the test has teeth."""
    cfg = SETUPS["t1"]
    logits, p, q_ids, q_probs = make_setup(**cfg)
    wrong = wrong_sampler(mistake, p, q_ids, q_probs)
    counts = first_token_counts(wrong, logits, q_ids, q_probs, cfg["temperature"], cfg["top_p"])
    assert total_variation(counts, p) > 0.05
    with pytest.raises(AssertionError):
        assert_matches(counts, p)


def test_rejection_sampling_is_lossless_two_token_chain():
    """The joint law of the first two emitted tokens is p1 x p2 (a context-independent target)."""
    temperature, top_p = 0.9, 1.0
    gen = torch.Generator().manual_seed(7)
    logits1, logits2 = 1.5 * torch.randn(2, V, generator=gen)  # [V] each
    p1, p2 = target_p(logits1, temperature, top_p), target_p(logits2, temperature, top_p)
    # q1 overlaps p1 (about half the first drafts are accepted, so the second token is usually decided at node 1
    # of the same round); q2 over-weights p2's less likely tokens.
    q1_ids, q1 = logits1.argsort(descending=True)[:3], torch.tensor([0.2, 0.5, 0.3])
    q2_ids, q2 = logits2.argsort()[2:], torch.tensor([0.4, 0.3, 0.2, 0.1])
    rows = torch.stack([logits1, logits2, logits2])  # [3, V] rows at root, after draft 1, after draft 2
    q_ids = torch.full((2, 4), int(q1_ids[0]))
    q_ids[0, :3], q_ids[1] = q1_ids, q2_ids
    q_probs = torch.zeros(2, 4)  # padding the shorter support with zero probability
    q_probs[0, :3], q_probs[1] = q1, q2
    trees = {
        (a, b): DraftTree.chain(ROOT, [int(q1_ids[a]), int(q2_ids[b])], q_ids, q_probs)
        for a in range(3)
        for b in range(4)
    }
    # When the first draft token is rejected the round ends with one token; the next round starts with a
    # one-token draft from q2 against p2. It reuses the second draft token, which the rejected round never
    # looked at, so it is still a fresh sample from q2.
    next_round = [DraftTree.chain(ROOT, [int(t)], q2_ids[None], q2[None]) for t in q2_ids]
    next_rows = logits2[None].expand(2, V)
    g = torch.Generator().manual_seed(1)
    first = torch.multinomial(q1, N, replacement=True, generator=g).tolist()
    second = torch.multinomial(q2, N, replacement=True, generator=g).tolist()
    counts, same_round = [0] * (V * V), 0
    for a, b in zip(first, second, strict=True):
        tree = trees[a, b]
        tokens = verify(tree, rows, temperature=temperature, top_p=top_p, generator=g).emitted_tokens(tree)
        same_round += len(tokens) > 1
        if len(tokens) == 1:
            follow = verify(next_round[b], next_rows, temperature=temperature, top_p=top_p, generator=g)
            tokens += follow.emitted_tokens(next_round[b])
        counts[tokens[0] * V + tokens[1]] += 1
    assert same_round > 0.4 * N
    assert_matches(torch.tensor(counts), torch.outer(p1, p2))


def sibling_first_token_counts(trees, weights, logits, temperature, top_p, seed=0) -> torch.Tensor:
    """Draw one of `trees` (root + two children) by `weights` [len(trees)] per trial; count the first emitted token."""
    g = torch.Generator().manual_seed(seed)
    rows = logits[None].expand(3, V)  # [3, V] root and two children
    counts = [0] * V
    for d in torch.multinomial(weights, N, replacement=True, generator=g).tolist():
        verdict = verify(trees[d], rows, temperature=temperature, top_p=top_p, generator=g)
        counts[verdict.emitted_tokens(trees[d])[0]] += 1
    return torch.tensor(counts)


def test_rejection_sampling_is_lossless_deterministic_siblings():
    """Two deterministic children of the root (point-mass proposals): the first emitted token still follows p."""
    cfg = SETUPS["t1"]
    logits, p, _, _ = make_setup(**cfg)
    order = logits.argsort(descending=True)
    tree = DraftTree(torch.tensor([ROOT, int(order[1]), int(order[0])]), torch.tensor([-1, 0, 0]))
    counts = sibling_first_token_counts([tree], torch.ones(1), logits, cfg["temperature"], cfg["top_p"])
    assert_matches(counts, p)


def test_rejection_sampling_is_lossless_sampled_siblings_without_replacement():
    """Two sampled siblings drawn WITHOUT replacement: the second carries q renormalised without the first's
    token, which is the contract that keeps the recursive residual lossless."""
    logits, p, q_ids, q_probs = make_setup(**SETUPS["t1"])
    trees, weights = [], []
    for a in range(3):
        rest = q_probs.clone()
        rest[a] = 0
        rest /= rest.sum()
        for b in range(3):
            if b != a:
                tokens = torch.tensor([ROOT, int(q_ids[a]), int(q_ids[b])])
                trees.append(
                    DraftTree(tokens, torch.tensor([-1, 0, 0]), q_ids.expand(3, 3), torch.stack([q_probs] * 2 + [rest]))
                )
                weights.append(float(q_probs[a] * rest[b]))  # the chance of drafting this ordered pair
    counts = sibling_first_token_counts(trees, torch.tensor(weights), logits, 1.0, 1.0)
    assert_matches(counts, p)


def test_sampling_edge_cases(monkeypatch):
    logits = torch.tensor([0.0, 3.0, 1.0, -1.0, 2.0, 0.5])
    g = torch.Generator().manual_seed(0)
    # p(x) == 0 (top-p cut it): never accepted, whatever q says.
    for _ in range(200):
        deterministic = verify(DraftTree.chain(ROOT, [4]), logits[None].expand(2, V), temperature=1.0, top_p=0.1)
        assert deterministic == Verdict([0], 1)
    # A draft token outside its own proposal's support cannot have been sampled from it.
    bad = DraftTree.chain(ROOT, [4], torch.tensor([[1, 2]]), torch.tensor([[0.5, 0.5]]))
    with pytest.raises(ValueError, match="support"):
        verify(bad, logits[None].expand(2, V), temperature=1.0, generator=g)
    # A uniform draw of exactly 1 forces a rejection where p(x) / q(x) == 1, leaving zero residual mass; the
    # bonus then falls back to p (here the single token top-p keeps) instead of dividing by zero.
    monkeypatch.setattr(speculative, "draw_uniforms", lambda n, generator=None: torch.ones(2, n, dtype=torch.float64))
    assert verify(DraftTree.chain(ROOT, [1]), logits[None].expand(2, V), temperature=1.0, top_p=0.1) == Verdict([0], 1)


# ---------------------------------------------------------------------------------------------- EAGLE-2 trees


def table_step(table: torch.Tensor, top_k: int, calls: list | None = None):
    """A fake drafter: the next-token log-probs depend only on the current token, via table [V, V]."""

    def step(frontier: list[int], tree: GrowingTree) -> tuple[torch.Tensor, torch.Tensor]:
        if calls is not None:
            calls.append((list(frontier), tree))
        rows = table[[tree.tokens[i] for i in frontier]]  # [F, V]
        logps, ids = rows.topk(top_k, dim=-1)
        return ids, logps

    return step


def log_table(vocab: int, seed: int) -> torch.Tensor:
    return (2 * torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(seed))).log_softmax(-1)


def brute_force_kept_paths(table, root, depth, top_k, total_tokens) -> set[tuple[int, ...]]:
    """EAGLE-2's candidate set by its definition, over token paths rather than ids."""
    score = {(root,): 0.0}
    frontier = [(root,)]
    candidates = []
    for _ in range(depth):
        level = []
        for path in frontier:
            logps, ids = table[path[-1]].topk(top_k)
            for lp, t in zip(logps.tolist(), ids.tolist(), strict=True):
                score[path + (t,)] = score[path] + lp
                level.append(path + (t,))
        candidates += level
        frontier = sorted(level, key=lambda s: -score[s])[:top_k]
    return set(sorted(candidates, key=lambda s: -score[s])[: total_tokens - 1])


@pytest.mark.parametrize("depth,top_k,total_tokens,seed", [(3, 2, 6, 0), (3, 3, 9, 1), (4, 2, 10, 2), (6, 8, 48, 3)])
def test_expand_dynamic_tree(depth, top_k, total_tokens, seed):
    vocab = 12
    table = log_table(vocab, seed)
    calls = []
    tree = expand_dynamic_tree(5, table_step(table, top_k, calls), depth=depth, top_k=top_k, total_tokens=total_tokens)
    grown = calls[0][1]
    assert len(tree) == total_tokens and int(tree.tokens[0]) == 5 and tree.q_ids is None
    assert [len(f) for f, _ in calls] == [1] + [top_k] * (depth - 1)
    # Each frontier is the top_k best of the previous level's new nodes, across parents.
    for level, (frontier, _) in enumerate(calls[1:], start=1):
        at_level = [i for i in range(len(grown)) if grown.depths[i] == level]
        best = sorted(at_level, key=lambda i: -grown.scores[i])[:top_k]
        assert sorted(frontier) == sorted(best)
    # source_ids maps output nodes back to the growing tree, parents and tokens included.
    src = tree.source_ids.tolist()
    assert src[0] == 0 and len(set(src)) == len(src)
    for i in range(1, len(tree)):
        assert int(tree.parents[i]) < i
        assert grown.parents[src[i]] == src[int(tree.parents[i])]
        assert grown.tokens[src[i]] == int(tree.tokens[i])
    # Closed under ancestors with the best scores: nothing dropped beats anything kept.
    kept = set(src[1:])
    dropped = [i for i in range(1, len(grown)) if i not in kept]
    if dropped:
        assert min(grown.scores[i] for i in kept) >= max(grown.scores[i] for i in dropped)
    # The verifier tries siblings best first.
    for i in range(len(tree)):
        scores = [grown.scores[src[c]] for c in tree.children(i)]
        assert scores == sorted(scores, reverse=True)
    paths = {tuple(int(tree.tokens[j]) for j in tree.path_to(i)) for i in range(1, len(tree))}
    assert paths == brute_force_kept_paths(table, 5, depth, top_k, total_tokens)


def test_expand_dynamic_tree_verifies():
    """A target that agrees with the drafter's top choices accepts the drafter's best path end to end."""
    table = log_table(10, 4)
    tree = expand_dynamic_tree(2, table_step(table, 3), depth=4, top_k=3, total_tokens=16)
    # The target's argmax after each node is the drafter's own top token there.
    verdict = verify(tree, table[tree.tokens])
    assert verdict.accepted >= 1  # the drafter's single best token always survives the reranking
    for a, b in zip(verdict.path, verdict.path[1:], strict=False):
        assert int(tree.tokens[b]) == int(table[int(tree.tokens[a])].argmax())
    assert verdict.bonus == int(table[int(tree.tokens[verdict.path[-1]])].argmax())
    # Fewer candidates than total_tokens: all are kept.
    small = expand_dynamic_tree(2, table_step(table, 2), depth=1, top_k=2, total_tokens=16)
    assert len(small) == 3
