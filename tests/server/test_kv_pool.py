"""The paged KV pool: a PagedCache behaves exactly like the contiguous KVCache, blocks follow the committed
length, the layout is the documented one, and a full pool reclaims or refuses cleanly."""

import pytest
import torch
from tiny_models import tiny_moa_drafter, tiny_target

from tether.server.kv_pool import KVPool, PoolExhausted
from tether.server.rounds import verify_batch
from tether.server.verifier import SequenceVerifier
from tether.shared.speculative import DraftTree


def drive(model, cache):
    """Prefill, a tree round, a chain round, a rewind and another round; returns every logits tensor."""
    g = torch.Generator().manual_seed(3)
    V = model.cfg.vocab_size
    outs = [model.prefill(torch.randint(V, (1, 13), generator=g), cache).logits]
    tree = DraftTree(tokens=torch.randint(V, (6,), generator=g), parents=torch.tensor([-1, 0, 0, 1, 3, 2]))
    out = model.verify(tree.tokens[None], cache, tree_mask=tree.ancestor_mask(), positions=tree.positions(13))
    outs.append(out.logits)
    cache.accept([0, 1, 3, 4])
    chain = torch.randint(V, (1, 7), generator=g)
    outs.append(model.verify(chain, cache).logits)
    cache.accept([0, 1, 2])
    cache.truncate(15)
    outs.append(model.verify(torch.randint(V, (1, 4), generator=g), cache).logits)
    cache.advance(4)
    return outs


@pytest.mark.parametrize("moda", [True, False])
def test_paged_cache_matches_contiguous(moda):
    model = tiny_target(moda=moda, moda_ffn_kv=moda)
    pool = KVPool(model.cfg, num_blocks=11, block_size=5)
    paged, flat = pool.sequence(capacity=40), model.new_cache(1, 40)
    with torch.inference_mode():
        for a, b in zip(drive(model, paged), drive(model, flat), strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert paged.length == flat.length == 19
    for layer in range(model.cfg.n_layers):
        k, v = paged.rows(layer)
        torch.testing.assert_close(k, flat.k[layer, 0, :19], rtol=0, atol=0)
        torch.testing.assert_close(v, flat.v[layer, 0, :19], rtol=0, atol=0)


def test_blocks_follow_the_committed_length_and_release_returns_them():
    model = tiny_target()
    pool = KVPool(model.cfg, num_blocks=8, block_size=4)
    cache = pool.sequence(capacity=30)
    with torch.inference_mode():
        model.prefill(torch.arange(9)[None], cache)
        assert len(cache.blocks) == 3 and pool.used_blocks == 3
        model.verify(torch.arange(6)[None], cache)  # pending rows take blocks for positions up to 14
        assert len(cache.blocks) == 4
        cache.accept([0])  # one accepted: the rest of the pending rows' blocks come back
        assert cache.length == 10 and len(cache.blocks) == 3 and pool.used_blocks == 3
        cache.truncate(4)
        assert len(cache.blocks) == 1 and pool.free_blocks == 7
    cache.release()
    assert pool.free_blocks == 8 and cache.blocks == []
    with pytest.raises(RuntimeError, match="released"):
        model.verify(torch.arange(2)[None], cache)


def test_layout_is_blocks_of_rows_addressed_by_the_block_table():
    model = tiny_target()
    pool = KVPool(model.cfg, num_blocks=9, block_size=3)
    seqs = [pool.sequence(capacity=20) for _ in range(2)]
    with torch.inference_mode():
        model.prefill(torch.arange(7)[None], seqs[0])
        model.prefill(torch.arange(2)[None], seqs[1])
    table, lens = pool.block_tables(seqs)
    assert table.dtype == lens.dtype == torch.int32 and table.shape == (2, 3)
    assert lens.tolist() == [7, 2] and table[1, 1:].tolist() == [-1, -1]
    for b, s in enumerate(seqs):
        k, _ = s.rows(2)
        for p in range(s.length):
            torch.testing.assert_close(pool.k[2, table[b, p // 3], p % 3], k[p], rtol=0, atol=0)


def test_full_pool_reclaims_through_the_callback_then_refuses():
    model = tiny_target()
    pool = KVPool(model.cfg, num_blocks=4, block_size=2)
    victim = pool.sequence(capacity=8)
    victim.reserve(6)  # 3 blocks
    calls = []

    def reclaim(missing):
        calls.append(missing)
        if victim.released:
            return False
        victim.release()
        return True

    pool.reclaim = reclaim
    assert len(pool.alloc(2)) == 2 and calls == [1]  # one block was missing: the victim went
    assert pool.free_blocks == 2
    pool.alloc(2)
    with pytest.raises(PoolExhausted, match="KV pool full"):
        pool.alloc(1)
    with pytest.raises(PoolExhausted, match="whole pool"):
        pool.alloc(5)


def test_budget_sizes_the_pool():
    model = tiny_target()
    per = KVPool.block_bytes(model.cfg, 16, torch.float32)
    assert per == 2 * 3 * 16 * 2 * 12 * 4
    assert KVPool.for_budget(model.cfg, 10 * per + 7, 16).num_blocks == 10
    with pytest.raises(ValueError, match="holds no block"):
        KVPool.for_budget(model.cfg, per - 1, 16)


def test_a_row_the_pool_cannot_hold_fails_alone_in_a_batch():
    target = tiny_target()
    drafter = tiny_moa_drafter(target)
    pool = KVPool(target.cfg, num_blocks=5, block_size=4)
    big = SequenceVerifier(target, drafter, capacity=40, pool=pool)
    small = SequenceVerifier(target, drafter, capacity=40, pool=pool)
    ref = SequenceVerifier(target, drafter, capacity=40)
    r_big, _ = big.open(list(range(12)))  # 3 blocks
    r_small, _ = small.open([5, 6, 7])  # 1 block
    ref.open([5, 6, 7])
    # big needs 2 more blocks for 8 pending rows but only 1 is free; small fits in its own block.
    res = verify_batch(target, [(big, DraftTree.chain(r_big, [1] * 7)), (small, DraftTree.chain(r_small, [1]))])
    assert isinstance(res[0], PoolExhausted)
    verdict, delta = res[1]
    want, want_delta = ref.verify(DraftTree.chain(r_small, [1]))
    assert verdict.path == want.path and verdict.bonus == want.bonus
    torch.testing.assert_close(delta.tensors["lsa"], want_delta.tensors["lsa"], rtol=1e-5, atol=1e-5)
    assert big.length == 12  # untouched
