"""Batched acceptance (tether.shared.acceptance) against the scalar reference `speculative.verify`: the same
verdict for every row of a batch (greedy and sampled, chains and trees, q given sparsely with duplicates and
zero-probability padding or not at all, top-p, padding), the same generator consumption, the target's law for
sampled output (with a negative control), padding never accepted, errors confined to their row, and the same on
CUDA without a host sync."""

import random

import pytest
import torch
from test_speculative import ROOT, SETUPS, N, V, assert_matches, make_setup, total_variation

import tether.shared.speculative as speculative
from tether.shared.acceptance import _pad_rows, accept, verify_rows
from tether.shared.speculative import DraftTree, Verdict, draw_uniforms, verify

VOCAB = 37  # small (so drafts get accepted) and not a power of two
KINDS = ["greedy_chain", "greedy_tree", "sampled_chain", "sampled_tree", "point_mass", "top_p", "top_k", "top_k_p"]


# ---------------------------------------------------------------------------------------------- random cases


def random_parents(rng: random.Random, n: int, chain: bool) -> list[int]:
    # Mostly deep (parent = the previous node) so long paths exist, with branching to make siblings.
    return [-1] + [i - 1 if chain or rng.random() < 0.5 else rng.randrange(i) for i in range(1, n)]


def children_of(parents: list[int]) -> list[list[int]]:
    kids: list[list[int]] = [[] for _ in parents]
    for i, p in enumerate(parents[1:], start=1):
        kids[p].append(i)
    return kids


def sparse_q(rng: random.Random, token: int, k: int, K: int) -> tuple[list[int], list[float]]:
    """A sparse q of k live entries with `token` in its support, sometimes split over duplicate ids, padded to
    width K with zero-probability entries that point anywhere (the token itself included)."""
    ids = [token] + rng.sample([t for t in range(VOCAB) if t != token], k - 1)
    probs = [rng.uniform(0.05, 1.0) for _ in range(k)]
    if k >= 3 and rng.random() < 0.4:
        ids[1] = token  # duplicate id: the two entries add up
    total = sum(probs)
    pad = [rng.choice([token, rng.randrange(VOCAB)]) for _ in range(K - k)]
    return ids + pad, [pr / total for pr in probs] + [0.0] * (K - k)


def random_case(rng: random.Random, kind: str) -> tuple[DraftTree, torch.Tensor, float, float, int]:
    """One tree of `kind`, target logits [n, V] correlated with its drafts, temperature, top_p and top_k."""
    n = rng.randint(1, 10)
    chain = kind.endswith("chain")
    parents = random_parents(rng, n, chain)
    kids = children_of(parents)
    tokens = [rng.randrange(VOCAB) for _ in range(n)]
    q_ids = q_probs = None
    if kind == "greedy_tree":
        for sibs in kids:  # duplicate sibling tokens: the first one is the one taken
            for a, b in zip(sibs, sibs[1:], strict=False):
                if rng.random() < 0.4:
                    tokens[b] = tokens[a]
    elif kind in ("sampled_chain", "sampled_tree", "top_p", "top_k", "top_k_p"):
        K = 6
        q_ids = [[tokens[0]] * K] + [[0] * K for _ in range(n - 1)]
        q_probs = [[1.0] + [0.0] * (K - 1)] + [[0.0] * K for _ in range(n - 1)]
        for sibs in kids:
            if not sibs:
                continue
            if len(sibs) == 1 or kind == "sampled_chain":
                for c in sibs:
                    q_ids[c], q_probs[c] = sparse_q(rng, tokens[c], rng.randint(1, K), K)
                continue
            # Siblings drawn without replacement from one base q: each carries the base renormalised over
            # what its earlier siblings left (the contract that keeps the recursive residual lossless).
            support = rng.sample(range(VOCAB), K)
            base = [rng.uniform(0.05, 1.0) for _ in range(K)]
            picks = rng.sample(range(K), len(sibs)) if len(sibs) < K else list(range(K))[: len(sibs)]
            left = list(base)
            for c, k in zip(sibs, picks, strict=False):
                total = sum(left)
                q_ids[c], q_probs[c] = list(support), [w / total for w in left]
                tokens[c] = support[k]
                left[k] = 0.0
            for c in sibs[len(picks) :]:  # more siblings than support: repeat the last one's q and token
                q_ids[c], q_probs[c], tokens[c] = q_ids[sibs[K - 1]], q_probs[sibs[K - 1]], tokens[sibs[K - 1]]
        q_ids, q_probs = torch.tensor(q_ids), torch.tensor(q_probs)
    tree = DraftTree(torch.tensor(tokens), torch.tensor(parents), q_ids, q_probs)

    scale = rng.choice([0.5, 1.0, 2.0])
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    logits = scale * torch.randn(n, VOCAB, generator=gen)  # [n, V]
    for i in range(1, n):  # the target often likes the draft, so paths run deep
        if rng.random() < 0.6:
            logits[parents[i], tokens[i]] += rng.uniform(1.0, 6.0)
    if kind in ("greedy_chain", "greedy_tree"):
        return tree, logits, 0.0, 1.0, 0
    temperature = rng.choice([0.3, 0.7, 1.0, 1.6])
    top_p = rng.choice([0.3, 0.6, 0.9, 0.97]) if kind in ("top_p", "top_k_p") else 1.0
    return tree, logits, temperature, top_p, (rng.choice([1, 3, 8, 20]) if kind in ("top_k", "top_k_p") else 0)


def random_batch(seed: int, kinds: list[str], dtype=torch.float32):
    """B rows of random kinds and sizes, padded to T with garbage logits (which must never matter)."""
    rng = random.Random(seed)
    cases = [random_case(rng, rng.choice(kinds)) for _ in range(rng.randint(1, 8))]
    T = max(len(tree) for tree, *_ in cases) + rng.randint(0, 3)
    logits = 8 * torch.randn(len(cases), T, VOCAB, generator=torch.Generator().manual_seed(seed))  # [B, T, V]
    for b, (tree, row, *_) in enumerate(cases):
        logits[b, : len(tree)] = row
    trees, _, temps, top_ps, top_ks = zip(*cases, strict=True)
    return list(trees), logits.to(dtype), list(temps), list(top_ps), list(top_ks)


def reference(trees, logits, temps, top_ps, generators, top_ks=None) -> list:
    top_ks = top_ks or [0] * len(trees)
    out = []
    for b, tree in enumerate(trees):
        try:
            out.append(
                verify(
                    tree,
                    logits[b, : len(tree)],
                    temperature=temps[b],
                    top_p=top_ps[b],
                    top_k=top_ks[b],
                    generator=generators[b],
                )
            )
        except ValueError as e:
            out.append(e)
    return out


def seeded(seed: int, B: int) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(1000 * seed + b) for b in range(B)]


def assert_same(got: list, want: list) -> None:
    assert len(got) == len(want)
    for b, (g, w) in enumerate(zip(got, want, strict=True)):
        if isinstance(w, ValueError):
            assert isinstance(g, ValueError), f"row {b}: reference raised {w!r}, batched gave {g}"
        else:
            assert g == w, f"row {b}: batched {g} != reference {w}"


def check_batches(kinds: list[str], seeds: range, device: str = "cpu", dtype=torch.float32) -> list[tuple]:
    """verify_rows equals verify on every row of every seed's batch, generators left in the same state."""
    seen = []
    for seed in seeds:
        trees, logits, temps, top_ps, top_ks = random_batch(seed, kinds, dtype)
        want_gens, got_gens = seeded(seed, len(trees)), seeded(seed, len(trees))
        want = reference(trees, logits, temps, top_ps, want_gens, top_ks)
        got = verify_rows(trees, logits.to(device), temps, top_ps, got_gens, top_ks)
        assert_same(got, want)
        for gw, gg in zip(want_gens, got_gens, strict=True):  # the same number of uniforms consumed
            assert torch.equal(gw.get_state(), gg.get_state())
        seen += [(v, tree, t) for v, tree, t in zip(want, trees, temps, strict=True)]
    return seen


# ---------------------------------------------------------------------------------------------- equality


@pytest.mark.parametrize("kind", KINDS)
def test_verify_rows_equals_verify(kind):
    seen = check_batches([kind], range(80))
    verdicts = [v for v, _, _ in seen if isinstance(v, Verdict)]
    assert len(verdicts) == len(seen)  # well-formed drafts: no errors
    # Not a vacuous agreement: deep paths and rejections both happen (bonus tokens and residuals exercised).
    assert max(v.accepted for v in verdicts) >= 3
    assert sum(v.accepted == 0 for v in verdicts) >= 10
    assert sum(0 < v.accepted < len(tree) - 1 for v, tree, _ in seen) >= 10  # stopped mid-tree, not at a leaf


def test_verify_rows_equals_verify_mixed_batches():
    """Greedy and sampled rows of every kind and size in one batch, 200 batches."""
    seen = check_batches(KINDS, range(200))
    greedy = {t == 0 for _, _, t in seen}
    assert greedy == {True, False}


def test_verify_rows_bf16_logits():
    check_batches(KINDS, range(30), dtype=torch.bfloat16)


def test_shared_generator_advances_as_sequential_verify():
    """Rows sharing one generator: each draws its uniforms in row order, exactly as B calls of verify would."""
    for seed in range(30):
        trees, logits, temps, top_ps, top_ks = random_batch(seed, KINDS)
        g_want, g_got = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
        want = reference(trees, logits, temps, top_ps, [g_want] * len(trees), top_ks)
        assert_same(verify_rows(trees, logits, temps, top_ps, [g_got] * len(trees), top_ks), want)
        assert torch.equal(g_want.get_state(), g_got.get_state())


def test_greedy_duplicate_siblings_first_wins():
    # 0 -> {1, 2, 3} with tokens 5, 5, 6; 1 -> {4}; 2 -> {5}. Both 1 and 2 match; 1 comes first.
    tree = DraftTree(torch.tensor([0, 5, 5, 6, 7, 8]), torch.tensor([-1, 0, 0, 0, 1, 2]))
    logits = torch.zeros(1, 6, 10)
    logits[0, 0, 5] = logits[0, 1, 7] = logits[0, 2, 8] = logits[0, 4, 3] = 1.0
    assert verify_rows([tree], logits, [0.0], [1.0], [None]) == [Verdict([0, 1, 4], 3)] == [verify(tree, logits[0])]


def fixed_uniforms(monkeypatch, tree, logits, temperature, top_p, uniforms) -> tuple[Verdict, Verdict]:
    """The verdicts of verify and of accept when both see the given uniforms [2, n] instead of random ones."""
    monkeypatch.setattr(speculative, "draw_uniforms", lambda n, generator=None: uniforms)
    want = verify(tree, logits, temperature=temperature, top_p=top_p)
    n = len(tree)
    got = accept(
        logits[None],
        tree.tokens[None],
        tree.parents[None],
        torch.tensor([n]),
        torch.tensor([temperature]),
        torch.tensor([top_p]),
        tree.q_ids if tree.q_ids is None else tree.q_ids[None],
        tree.q_probs if tree.q_probs is None else tree.q_probs[None],
        uniforms[None],
    )
    assert not got.bad.any()
    path = torch.nonzero(got.on_path[0]).flatten().tolist()
    assert path[-1] == int(got.leaf[0])
    return want, Verdict(path, int(got.bonus[0]))


def test_uniform_of_one_forces_rejection_and_falls_back_to_p(monkeypatch):
    """All ones reject even at p / q == 1 (zero residual mass), and the bonus (u * total rounds to the total)
    falls back to the last token with mass."""
    logits = torch.tensor([0.0, 3.0, 1.0, -1.0, 2.0, 0.5])[None].expand(2, 6)  # [2, V]
    ones = torch.ones(2, 2, dtype=torch.float64)
    want, got = fixed_uniforms(monkeypatch, DraftTree.chain(ROOT, [1]), logits, 1.0, 0.1, ones)
    assert want == got == Verdict([0], 1)


def test_bonus_at_uniform_zero_skips_zero_probability_tokens(monkeypatch):
    """u = 0 targets a cumulative mass of 0: the first token WITH mass is drawn, not a leading token top-p cut."""
    logits = torch.tensor([[-1.0, 3.0, 1.0, 0.0, 2.0, 0.5]])  # [1, V] token 0 is the least likely
    zeros = torch.zeros(2, 1, dtype=torch.float64)
    want, got = fixed_uniforms(monkeypatch, DraftTree.chain(ROOT, []), logits, 1.0, 0.5, zeros)
    assert want == got == Verdict([0], 1)


def test_rounding_residual_keeps_p(monkeypatch):
    """q is the target's own distribution rounded to float32; a forced rejection leaves a residual of rounding
    noise (mass far below _RESIDUAL_EPS), and the bonus must come from p, not from that noise."""
    logits = 2 * torch.randn(VOCAB, generator=torch.Generator().manual_seed(5))  # [V]
    p = speculative.target_probs(logits, 1.0)  # [V] float64
    q = p.float()  # [V] the same law at float32 precision
    seen = q.double() / q.double().sum()  # [V] q as the verifier reads it (renormalised in float64)
    x = int((p < seen).nonzero()[0])  # a token where p / q < 1, so u = 1 rejects it
    residual = (p - seen).clamp(min=0)
    assert 0 < float(residual.sum()) < speculative._RESIDUAL_EPS
    u = torch.tensor([[0.0, 1.0], [0.5, 0.5]], dtype=torch.float64)  # reject node 1, bonus at u = 0.5
    tree = DraftTree.chain(ROOT, [x], torch.arange(VOCAB)[None], q[None])
    want, got = fixed_uniforms(monkeypatch, tree, logits[None].expand(2, VOCAB), 1.0, 1.0, u)
    from_p = speculative._draw(p.numpy(), 0.5)
    assert from_p != speculative._draw((residual / residual.sum()).numpy(), 0.5)  # the two laws disagree here
    assert want == got == Verdict([0], from_p)


# ---------------------------------------------------------------------------------------------- errors, padding


def test_token_outside_support_fails_only_its_row():
    trees, logits, temps, top_ps, _ = random_batch(7, ["sampled_tree", "greedy_tree", "point_mass"])
    outside = DraftTree.chain(ROOT, [4], torch.tensor([[1, 2]]), torch.tensor([[0.5, 0.5]]))
    bad_top_p = DraftTree.chain(ROOT, [3])
    trees = trees[:2] + [outside] + trees[2:] + [bad_top_p]
    T = max(logits.shape[1], 2)
    padded = torch.randn(len(trees), T, VOCAB)
    padded[:2, : logits.shape[1]], padded[3:-1, : logits.shape[1]] = logits[:2], logits[2:]
    temps, top_ps = temps[:2] + [1.0] + temps[2:] + [0.8], top_ps[:2] + [1.0] + top_ps[2:] + [0.0]
    want = reference(trees, padded, temps, top_ps, seeded(0, len(trees)))
    got = verify_rows(trees, padded, temps, top_ps, seeded(0, len(trees)))
    assert [b for b, v in enumerate(got) if isinstance(v, ValueError)] == [2, len(trees) - 1]
    assert "support" in str(got[2])
    assert_same(got, want)
    with pytest.raises(ValueError, match="support"):
        verify(outside, padded[2, :2], temperature=1.0)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_padding_nodes_are_never_accepted(temperature):
    """Padding nodes hang off the real leaf with exactly the token the target wants there, and every acceptance
    uniform is 0 (accept whatever has p > 0): still never accepted, because they are past the row's size."""
    n, T = 3, 7
    logits = torch.full((2, T, VOCAB), -5.0)
    tokens = torch.tensor([[9, 4, 6, 2, 2, 2, 2]] * 2)  # [2, T]; row 1 is the same tree with no padding
    parents = torch.tensor([[-1, 0, 1, 2, 3, 4, 5]] * 2)  # padding parents continue the chain from the leaf
    for i in range(1, T):  # the target wants each node's token after its parent
        logits[:, int(parents[0, i]), int(tokens[0, i])] = 5.0
    sizes = torch.tensor([n, T])
    uniforms = torch.zeros(2, 2, T, dtype=torch.float64)
    got = accept(logits, tokens, parents, sizes, torch.tensor([temperature] * 2), uniforms=uniforms)
    assert got.on_path[0].tolist() == [True] * n + [False] * (T - n)
    assert got.leaf.tolist() == [n - 1, T - 1]  # the unpadded row does go all the way: the setup would accept
    assert not got.bad.any()
    # Through the wrapper, trees shorter than T: the padding columns are whatever the batch holds.
    trees = [DraftTree(tokens[0, :n], parents[0, :n]), DraftTree(tokens[0], parents[0])]
    verdicts = verify_rows(trees, logits, [temperature] * 2, [1.0] * 2, seeded(1, 2))
    assert verdicts[0].path == [0, 1, 2] and verdicts[1].path == list(range(T))
    assert verdicts == reference(trees, logits, [temperature] * 2, [1.0] * 2, seeded(1, 2))


def test_pad_rows_layout():
    """The uniforms a row gets are exactly draw_uniforms(len(tree), its generator), padded with zeros."""
    trees = [DraftTree.chain(ROOT, [1, 2]), DraftTree.chain(ROOT, [3]), DraftTree.chain(ROOT, [4, 5, 6])]
    rows = _pad_rows(trees, 5, [1.0, 0.0, 0.5], [1.0, 1.0, 0.9], seeded(2, 3))
    assert rows.sampled and rows.errors == [None] * 3
    assert torch.equal(rows.uniforms[0, :, :3], draw_uniforms(3, seeded(2, 3)[0]))
    assert not rows.uniforms[0, :, 3:].any() and not rows.uniforms[1].any()  # greedy rows draw nothing
    assert torch.equal(rows.uniforms[2, :, :4], draw_uniforms(4, seeded(2, 3)[2]))
    assert rows.top_p.tolist() == [1.0, 1.0, 0.9] and rows.sizes.tolist() == [3, 2, 4]
    assert rows.parents[1].tolist() == [-1, 0, 0, 0, 0] and rows.tokens[1].tolist() == [ROOT, 3, 0, 0, 0]


# ---------------------------------------------------------------------------------------------- the target's law


def sibling_trees(name: str):
    """Root with two sampled siblings (drawn without replacement) that each have one sampled child, and the
    chance of drafting each tree. q's support is the target's 3rd to 5th most likely tokens, weighted against
    the target (with top-p some have p = 0), so acceptance is partial, the residual spreads over several tokens
    and the two most likely tokens are only reachable as the bonus."""
    logits, p, _, _ = make_setup(**SETUPS[name])
    q_ids = logits.argsort(descending=True)[2:5]  # [3]
    q_probs = torch.tensor([0.6, 0.3, 0.1])  # [3]
    trees, weights = [], []
    for a in range(3):
        rest = q_probs.clone()
        rest[a] = 0
        rest /= rest.sum()
        for b in range(3):
            if b != a:
                tokens = torch.tensor([ROOT, int(q_ids[a]), int(q_ids[b]), int(q_ids[0]), int(q_ids[1])])
                qs = torch.stack([q_probs, q_probs, rest, q_probs, q_probs])  # [5, 3]
                trees.append(DraftTree(tokens, torch.tensor([-1, 0, 0, 1, 2]), q_ids.expand(5, 3), qs))
                weights.append(float(q_probs[a] * rest[b]))
    return logits, p, trees, torch.tensor(weights)


def first_token_counts(name: str, uniforms_fn=None) -> tuple[torch.Tensor, torch.Tensor]:
    """N trials in one batch: draw a tree by weight, verify all at once, count the first emitted token.
    uniforms_fn, if given, rewrites the uniforms before `accept` sees them. Returns (counts [V], p [V])."""
    logits, p, trees, weights = sibling_trees(name)
    temperature, top_p, top_k = (SETUPS[name][k] for k in ("temperature", "top_p", "top_k"))
    g = torch.Generator().manual_seed(0)
    batch = [trees[d] for d in torch.multinomial(weights, N, replacement=True, generator=g).tolist()]
    rows = logits[None, None].expand(N, 5, V)  # a context-independent target: every row is `logits`
    temps, top_ps, top_ks = [temperature] * N, [top_p] * N, [top_k] * N
    if uniforms_fn is None:
        verdicts = verify_rows(batch, rows, temps, top_ps, [g] * N, top_ks)
        assert sum(v.accepted > 0 for v in verdicts) > N / 10  # acceptance is partial, not all or nothing
        assert sum(v.accepted == 0 for v in verdicts) > N / 10
    else:
        padded = _pad_rows(batch, 5, temps, top_ps, [g] * N, top_ks)
        res = accept(rows, **(padded.tensors() | {"uniforms": uniforms_fn(padded.uniforms)}))
        bonus = res.bonus.tolist()
        verdicts = [
            Verdict([i for i, on in enumerate(row) if on], bonus[b]) for b, row in enumerate(res.on_path.tolist())
        ]
    counts = [0] * V
    for tree, v in zip(batch, verdicts, strict=True):
        counts[int(tree.tokens[v.path[1]]) if v.accepted else v.bonus] += 1
    return torch.tensor(counts), p


@pytest.mark.parametrize("name", list(SETUPS))
def test_verify_rows_is_lossless(name):
    counts, p = first_token_counts(name)
    assert_matches(counts, p)


@pytest.mark.parametrize("name", list(SETUPS))
def test_negative_control_reused_uniform_fails(name):
    """Bonus drawn with the uniform that just rejected the first child (instead of its own row-1 uniform): the
    same harness rejects it, so the statistical test can fail."""

    def reuse(u):  # [B, 2, T]
        u = u.clone()
        u[:, 1, 0] = u[:, 0, 1]
        return u

    counts, p = first_token_counts(name, reuse)
    assert total_variation(counts, p) > 0.05
    with pytest.raises(AssertionError):
        assert_matches(counts, p)


# ---------------------------------------------------------------------------------------------- CUDA


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_equals_verify_without_host_sync():
    check_batches(KINDS, range(100), device="cuda")
    check_batches(KINDS, range(20), device="cuda", dtype=torch.bfloat16)
    # accept itself never waits for the device: any synchronising call raises in this mode.
    trees, logits, temps, top_ps, top_ks = random_batch(3, KINDS)
    rows = _pad_rows(trees, logits.shape[1], temps, top_ps, seeded(3, len(trees)), top_ks)
    moved = {k: None if v is None else v.cuda() for k, v in rows.tensors().items()}
    logits = logits.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        accept(logits, **moved, sampled=rows.sampled)
    finally:
        torch.cuda.set_sync_debug_mode("default")
