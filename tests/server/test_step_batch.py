"""tether.server.rounds.step_batch builds every row as a chain with whole-batch numpy operations and rewrites only
the rows that are not chains; these tests hold it, field for field (values, dtypes, shapes), to the row-by-row
build it replaced, kept here as the reference, on random batches of awkward shapes: chains and trees of different
sizes (padding), caches of different lengths and block-table widths, blocks scattered through the pool, block
sizes of one row and of odd sizes, and a batch of one."""

import dataclasses
import random

import numpy as np
import pytest
import torch

from tether.server import rounds
from tether.server.kv_pool import KVPool, PoolExhausted
from tether.server.step import StepBatch
from tether.shared.config import PRESETS
from tether.shared.speculative import DraftTree

CFG = PRESETS["tiny"]


def reference_step_batch(caches, trees) -> StepBatch:
    """step_batch as it was before it was vectorised: one pass of numpy writes per row."""
    B, T = len(trees), max(len(t) for t in trees)
    bs = caches[0].pool.block_size
    for c, t in zip(caches, trees, strict=True):
        c.reserve(len(t))
    tokens = np.zeros((B, T), np.int64)
    positions = np.zeros((B, T), np.int64)
    parents = np.zeros((B, T), np.int64)
    mask = np.zeros((B, T, T), np.bool_)
    slots = np.full((B, T), -1, np.int64)
    lens = np.zeros(B, np.int64)
    q_lens = np.zeros(B, np.int64)
    table = np.full((B, max(len(c.blocks) for c in caches)), -1, np.int64)
    causal = np.tri(T, dtype=np.bool_)
    for i, (c, t) in enumerate(zip(caches, trees, strict=True)):
        n, L = len(t), c.length
        blocks = np.asarray(c.blocks, np.int64)
        table[i, : len(blocks)] = blocks
        tokens[i, :n] = t._tokens
        parents[i, :n] = t._parents
        if t.is_chain:
            positions[i, :n] = np.arange(L, L + n)
            mask[i, :n, :n] = causal[:n, :n]
        else:
            positions[i, :n] = L + t.depths.numpy()
            mask[i, :n, :n] = t.ancestor_mask().numpy()
        pos = np.arange(L, L + n)
        slots[i, :n] = blocks[pos // bs] * bs + pos % bs
        lens[i], q_lens[i] = L + n, n
    return StepBatch(tokens, positions, parents, mask, slots, table, lens, q_lens)


def assert_same(got: StepBatch, want: StepBatch) -> None:
    for f in dataclasses.fields(StepBatch):
        a, b = getattr(got, f.name), getattr(want, f.name)
        assert a.dtype == b.dtype and a.shape == b.shape, (f.name, a.dtype, a.shape, b.dtype, b.shape)
        assert a.flags.c_contiguous, f.name
        np.testing.assert_array_equal(a, b, err_msg=f.name)


def random_tree(rng: random.Random, n: int, kind: str) -> DraftTree:
    tokens = [rng.randrange(CFG.vocab_size) for _ in range(n)]
    if kind == "chain":  # as clients send them: plain lists, the fast path's precomputed _tokens and _parents
        return DraftTree.chain(tokens[0], tokens[1:])
    if kind == "tensor chain":  # _tokens read back from the tensor
        return DraftTree.chain(tokens[0], torch.tensor(tokens[1:], dtype=torch.long))
    if kind == "chain-shaped tree":  # a chain not built by DraftTree.chain: is_chain is worked out
        parents = list(range(-1, n - 1))
    else:
        parents = [-1] + [rng.randrange(i) for i in range(1, n)]
    return DraftTree(torch.tensor(tokens), torch.tensor(parents))


def scenario(seed: int, block_size: int, shape: str, kinds: tuple[str, ...]):
    """A pool, caches and trees, the same for the same arguments (so two calls give twin pools).

    shape: "ragged" (every row its own size and length), "same size" (one size, lengths differ), "uniform" (one
    size, one length: every row's table is as wide) or "one" (a batch of one)."""
    rng = random.Random(seed)
    pool = KVPool(CFG, num_blocks=4096, block_size=block_size)
    rows = 1 if shape == "one" else rng.randint(2, 24)
    T = rng.choice([1, 2, 5, 6, 8, 13])
    L0 = rng.randrange(0, 70)
    lengths = [L0 if shape == "uniform" else rng.randrange(0, 70) for _ in range(rows)]
    if shape == "ragged" and rng.random() < 0.3:
        lengths[rng.randrange(rows)] = 0  # a fresh sequence
    sizes = [T if shape in ("same size", "uniform") else rng.randint(1, T) for _ in range(rows)]
    caches = [pool.sequence(256) for _ in range(rows)]
    # Grow the sequences a few rows at a time in random order, with other sessions coming and going, so each
    # one's blocks are scattered through the pool rather than consecutive.
    others = []
    while any(c.length < L for c, L in zip(caches, lengths, strict=True)):
        i = rng.randrange(rows)
        step = min(rng.randint(1, 9), lengths[i] - caches[i].length)
        if step:
            caches[i].reserve(step)
            caches[i].commit(step)
        if rng.random() < 0.3:
            other = pool.sequence(256)
            other.reserve(rng.randint(1, 3 * block_size))
            others.append(other)
        if others and rng.random() < 0.2:
            others.pop(rng.randrange(len(others))).release()
    if shape != "uniform":
        for c in caches:
            if rng.random() < 0.2:
                c.reserve(rng.randint(1, 40))  # blocks held past what this step needs (a wider table row)
    trees = [random_tree(rng, n, rng.choice(kinds)) for n in sizes]
    return pool, caches, trees


KINDS = {
    "chains": ("chain",),
    "trees": ("tree",),
    "mixed": ("chain", "tensor chain", "chain-shaped tree", "tree"),
}


@pytest.mark.parametrize("block_size", [1, 3, 4, 16])
@pytest.mark.parametrize("shape", ["ragged", "same size", "uniform", "one"])
@pytest.mark.parametrize("kinds", list(KINDS))
def test_random_batches_match_the_row_by_row_build(block_size, shape, kinds):
    for seed in range(12):
        _, caches, trees = scenario(seed, block_size, shape, KINDS[kinds])
        _, twins, twin_trees = scenario(seed, block_size, shape, KINDS[kinds])
        got = rounds.step_batch(caches, trees)
        want = reference_step_batch(twins, twin_trees)
        assert_same(got, want)
        # The same blocks were reserved: the table above is read after reserve, not before.
        assert [c.blocks for c in caches] == [c.blocks for c in twins]
        if shape == "uniform":  # the branch where no row is padded and every table row is as wide
            assert len({len(t) for t in trees}) == 1 and len({len(c.blocks) for c in caches}) == 1


def test_a_batch_can_be_written_to_without_changing_the_next():
    """step_batch shares per-size constants between calls; no array it returns may be one of them (or a view)."""
    for shape in ("uniform", "ragged"):
        _, caches, trees = scenario(3, 4, shape, KINDS["mixed"])
        first = rounds.step_batch(caches, trees)
        for f in dataclasses.fields(StepBatch):
            arr = getattr(first, f.name)
            arr[...] = 1 if arr.dtype == np.bool_ else 12345
        assert_same(rounds.step_batch(caches, trees), reference_step_batch(caches, trees))


def test_padding_rows_and_columns():
    """Rows of 1, 4 and 2 nodes after caches of 0, 5 and 8 rows (block size 4): padding is 0, False and slot -1."""
    pool = KVPool(CFG, num_blocks=16, block_size=4)
    caches = [pool.sequence(64) for _ in range(3)]
    for c, L in zip(caches, (0, 5, 8), strict=True):
        if L:
            c.reserve(L)
            c.commit(L)
    tree = DraftTree(torch.tensor([7, 8, 9, 10]), torch.tensor([-1, 0, 0, 1]))
    batch = rounds.step_batch(caches, [DraftTree.chain(1, []), tree, DraftTree.chain(2, [3])])
    assert batch.tokens.tolist() == [[1, 0, 0, 0], [7, 8, 9, 10], [2, 3, 0, 0]]
    assert batch.positions.tolist() == [[0, 0, 0, 0], [5, 6, 6, 7], [8, 9, 0, 0]]
    assert batch.parents.tolist() == [[-1, 0, 0, 0], [-1, 0, 0, 1], [-1, 0, 0, 0]]
    assert batch.q_lens.tolist() == [1, 4, 2] and batch.cache_lens.tolist() == [1, 9, 10]

    def slot(c, p):
        return c.blocks[p // 4] * 4 + p % 4

    assert batch.slots.tolist() == [
        [slot(caches[0], 0), -1, -1, -1],
        [slot(caches[1], p) for p in (5, 6, 7, 8)],
        [slot(caches[2], 8), slot(caches[2], 9), -1, -1],
    ]
    assert batch.block_table.tolist() == [c.blocks + [-1] * (3 - len(c.blocks)) for c in caches]
    assert batch.tree_mask[0].tolist() == [[True] + [False] * 3] + [[False] * 4] * 3
    assert batch.tree_mask[2, :2, :2].tolist() == [[True, False], [True, True]] and not batch.tree_mask[2, 2:].any()
    assert not batch.tree_mask[2, :, 2:].any()
    assert batch.tree_mask[1].tolist() == tree.ancestor_mask().tolist()


def test_a_row_that_cannot_get_room_fails_as_before():
    """The pool runs out at the third row: both builds raise the same error with the same blocks reserved."""

    def run(build):
        pool = KVPool(CFG, num_blocks=5, block_size=2)
        caches = [pool.sequence(64) for _ in range(4)]
        trees = [DraftTree.chain(1, [2, 3]) for _ in caches]  # 3 rows: 2 blocks each
        with pytest.raises(PoolExhausted):
            build(caches, trees)
        return [c.blocks for c in caches]

    assert run(rounds.step_batch) == run(reference_step_batch)


def test_padding_past_the_widest_table():
    """The last row's padding columns lie past every row's blocks (one-row blocks, a long cache, one new node):
    padding gets slot -1 without reading a block it does not have."""
    pool = KVPool(CFG, num_blocks=32, block_size=1)
    a, b = pool.sequence(64), pool.sequence(64)
    b.reserve(7)
    b.commit(7)
    trees = [DraftTree.chain(1, list(range(2, 9))), DraftTree.chain(9, [])]
    batch = rounds.step_batch([a, b], trees)
    assert batch.block_table.shape == (2, 8)
    assert batch.slots[1].tolist() == [b.blocks[7]] + [-1] * 7
    assert batch.positions[1].tolist() == [7] + [0] * 7
