"""The paged MoDA verify kernel (tether.kernels.moda.verify) against its naive reference: ragged batches over a paged
cache with awkward block sizes, GQA groups, depth lengths and tree masks; split-K agrees with one split; and a real
KVPool filled by the tiny model. On a machine without CUDA the kernels run in Triton's interpreter (TRITON_INTERPRET=1).
"""

import os

import pytest
import torch
from tiny_models import tiny_target

import tether.shared.attention as attention
from tether.kernels.moda import moda_verify
from tether.kernels.moda.naive import moda_verify_naive
from tether.server import kv_pool
from tether.server.kv_pool import KVPool
from tether.server.rounds import PagedBatchView
from tether.shared.speculative import DraftTree

pytestmark = [
    pytest.mark.heavy,
    pytest.mark.skipif(
        not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
        reason="Triton kernels need CUDA or TRITON_INTERPRET=1",
    ),
]
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def random_tree_mask(kmax: int, g: torch.Generator) -> torch.Tensor:
    """Ancestor mask [kmax, kmax] of a random tree (node 0 the root, parents[i] < i)."""
    parents = [-1] + [int(torch.randint(i, (1,), generator=g)) for i in range(1, kmax)]
    return DraftTree(tokens=torch.zeros(kmax, dtype=torch.long), parents=torch.tensor(parents)).ancestor_mask()


def make_batch(cache_lens, q_lens, *, hkv, G, D, L, block_size, dtype, tree, kmax=None, seed=0):
    """A ragged batch in the pool layout: rows' blocks scattered over a shuffled pool, -1 past each row's blocks,
    NaN in every slot no row may read (unused blocks, slots past a row's length, padded queries and depth rows)."""
    g = torch.Generator().manual_seed(seed)
    B, kmax = len(cache_lens), kmax or max(q_lens)
    nblocks = [-(-n // block_size) for n in cache_lens]
    num_blocks = sum(nblocks) + 3
    table = torch.full((B, max(nblocks) + 2), -1, dtype=torch.int32)
    perm, used = torch.randperm(num_blocks, generator=g), 0
    for b, n in enumerate(nblocks):
        table[b, :n] = perm[used : used + n]
        used += n
    k_cache = torch.randn(num_blocks, block_size, hkv, D, generator=g)
    v_cache = torch.randn(num_blocks, block_size, hkv, D, generator=g)
    readable = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    for b, n in enumerate(cache_lens):
        pos = torch.arange(n)
        readable[table[b, pos // block_size].long() * block_size + pos % block_size] = True
    k_cache.view(-1, hkv, D)[~readable] = float("nan")
    v_cache.view(-1, hkv, D)[~readable] = float("nan")
    q = torch.randn(B, kmax, hkv * G, D, generator=g)
    depth_k = torch.randn(B, kmax, L, hkv, D, generator=g)
    depth_v = torch.randn(B, kmax, L, hkv, D, generator=g)
    for b, k in enumerate(q_lens):
        q[b, k:] = depth_k[b, k:] = depth_v[b, k:] = float("nan")
    mask = torch.stack([random_tree_mask(kmax, g) for _ in range(B)]) if tree else None
    tensors = dict(q=q, k_cache=k_cache, v_cache=v_cache, depth_k=depth_k, depth_v=depth_v)
    batch = {name: t.to(DEV, dtype) for name, t in tensors.items()}
    batch.update(
        block_table=table.to(DEV),
        cache_lens=torch.tensor(cache_lens, dtype=torch.int32, device=DEV),
        q_lens=torch.tensor(q_lens, dtype=torch.int32, device=DEV),
        tree_mask=None if mask is None else mask.to(DEV),
    )
    return batch


def assert_rows_close(o, ref, q_lens, tol=5e-3):
    """Relative RMS error of every row's valid queries below `tol`."""
    for b, k in enumerate(q_lens):
        got, want = o[b, :k].float(), ref[b, :k].float()
        assert torch.isfinite(got).all(), f"row {b}: non-finite output"
        err = ((got - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt()).item()
        assert err < tol, f"row {b}: relative RMS error {err:.2e}"


# cache_lens count the new tokens: row prefixes of 0, 58, 122 and 1020 positions.
CACHE_LENS, Q_LENS = [1, 63, 130, 1025], [1, 5, 8, 5]
CASES = [
    # D, G, L, block_size, dtype, tree, num_splits
    (64, 1, 0, 16, torch.float32, False, 1),
    (64, 2, 3, 5, torch.float32, True, 3),
    (128, 4, 13, 16, torch.float16, False, 2),
    (128, 8, 3, 5, torch.float16, True, 1),
    (32, 2, 13, 16, torch.float16, True, 4),
    (64, 8, 0, 5, torch.float32, True, None),
]


@pytest.mark.parametrize(("D", "G", "L", "block_size", "dtype", "tree", "num_splits"), CASES)
def test_matches_naive_reference(D, G, L, block_size, dtype, tree, num_splits):
    batch = make_batch(CACHE_LENS, Q_LENS, hkv=2, G=G, D=D, L=L, block_size=block_size, dtype=dtype, tree=tree)
    out = torch.full_like(batch["q"], float("nan"))
    o = moda_verify(**batch, num_splits=num_splits, out=out)
    assert o is out and o.dtype == dtype
    assert_rows_close(o, moda_verify_naive(**batch), Q_LENS)
    for b, k in enumerate(Q_LENS):  # padded query rows are left as they were
        assert torch.isnan(o[b, k:]).all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="larger bf16 shapes run on a GPU")
@pytest.mark.parametrize("tree", [False, True], ids=["causal", "tree"])
@pytest.mark.parametrize("config", [None, {"BLOCK_N": 32, "num_warps": 8, "num_stages": 4, "combine_warps": 2}])
def test_bf16_large_on_gpu(tree, config):
    """Long ragged rows (a 32K prefix among them) in bf16, the server's dtype, with the default split heuristic
    and tiles, and with other tiles."""
    cache_lens, q_lens = [32776, 4100, 1030, 70], [8, 32, 1, 63]
    batch = make_batch(cache_lens, q_lens, hkv=8, G=4, D=128, L=32, block_size=16, dtype=torch.bfloat16, tree=tree)
    out = torch.full_like(batch["q"], float("nan"))
    ref = moda_verify_naive(**{k: v.float() if v is not None and v.is_floating_point() else v
                               for k, v in batch.items()})  # fmt: skip
    assert_rows_close(moda_verify(**batch, out=out, config=config), ref, q_lens)


def test_splits_agree_and_padding_kmax():
    """Any number of splits (more than some rows have blocks, too) or tile config gives one split's result; Kmax
    beyond every row's q_len, a shared [Kmax, Kmax] tree mask and a custom scale are honoured."""
    q_lens = [3, 7, 1]
    batch = make_batch([9, 200, 700], q_lens, hkv=1, G=4, D=64, L=3, block_size=16, dtype=torch.float32,
                       tree=False, kmax=9)  # fmt: skip
    batch["tree_mask"] = random_tree_mask(9, torch.Generator().manual_seed(5)).to(DEV)
    outs = [moda_verify(**batch, scale=0.3, num_splits=s) for s in (1, 2, 5, 16)]
    outs.append(moda_verify(**batch, scale=0.3, num_splits=3, config={"BLOCK_N": 16, "num_warps": 2, "num_stages": 1}))
    cfg = {"BLOCK_N": 32, "num_warps": 4, "num_stages": 2, "combine_warps": 4, "min_chunk_keys": 64, "max_chunks": 4}
    outs.append(moda_verify(**batch, scale=0.3, config=cfg))
    assert_rows_close(outs[0], moda_verify_naive(**batch, scale=0.3), q_lens)
    for o in outs[1:]:
        for b, k in enumerate(q_lens):
            torch.testing.assert_close(o[b, :k], outs[0][b, :k], rtol=1e-5, atol=1e-5)


def rows_of(batch: dict, rows: list[int]) -> dict:
    """The batch of `rows` only (same pool), its Kmax and table width cut to what those rows need."""
    q_lens, lens = batch["q_lens"][rows], batch["cache_lens"][rows]
    kmax, bs = int(q_lens.max()), batch["k_cache"].shape[1]
    width = -(-int(lens.max()) // bs)
    sub = {name: batch[name][rows][:, :kmax] for name in ("q", "depth_k", "depth_v")}
    mask = batch["tree_mask"]
    sub.update(k_cache=batch["k_cache"], v_cache=batch["v_cache"], cache_lens=lens, q_lens=q_lens,
               block_table=batch["block_table"][rows][:, :width].contiguous(),
               tree_mask=None if mask is None else mask[rows][:, :kmax, :kmax])  # fmt: skip
    return sub


@pytest.mark.parametrize(("tree", "max_chunks", "min_keys"), [(False, 80, 16), (True, 8, 32)])
def test_a_rows_output_does_not_depend_on_the_batch(tree, max_chunks, min_keys):
    """Batch invariance (the default rule, issue #44): a row's output, bit for bit, is the same alone and in
    batches of other rows, wherever it sits, whatever their number, lengths, Kmax and table widths (so the split
    count, from 2 to past one pass of the combine's 64 partials, changes around it)."""
    lens, q_lens = [130, 1, 63, 1025, 700, 40], [8, 1, 5, 5, 3, 2]
    batch = make_batch(lens, q_lens, hkv=2, G=3, D=64, L=3, block_size=16, dtype=torch.float32, tree=tree)
    # 80 chunks of >= 16 keys: the 1025-position row has 65 chunks, past one pass of the combine; 8 of >= 32 keys:
    # a chunk's length follows each row's prefix.
    cfg = {"BLOCK_N": 16, "num_warps": 4, "num_stages": 1, "combine_warps": 1, "max_chunks": max_chunks,
           "min_chunk_keys": min_keys}  # fmt: skip
    alone = moda_verify(**rows_of(batch, [0]), config=cfg)[0, :8]
    assert_rows_close(alone[None], moda_verify_naive(**rows_of(batch, [0]))[:, :8], [8])
    for rows in ([1, 0], [0, 2], [3, 0], [5, 4, 3, 2, 1, 0], [2, 0, 4]):
        got = moda_verify(**rows_of(batch, rows), config=cfg)
        assert torch.equal(got[rows.index(0), :8], alone), rows


def test_rejects_bad_shapes():
    batch = make_batch([4], [2], hkv=2, G=2, D=16, L=1, block_size=4, dtype=torch.float32, tree=False)
    with pytest.raises(ValueError, match="multiple"):
        moda_verify(**{**batch, "q": batch["q"][:, :, :3]})
    with pytest.raises(ValueError, match="depth_k"):
        moda_verify(**{**batch, "depth_k": batch["depth_k"][..., :8]})
    with pytest.raises(ValueError, match="tree_mask"):
        moda_verify(**batch | {"tree_mask": torch.ones(1, 3, 3, dtype=torch.bool, device=DEV)})
    with pytest.raises(ValueError, match="num_splits"):
        moda_verify(**batch, num_splits=0)


@torch.inference_mode()
def test_real_kv_pool_round(monkeypatch):
    """The tiny MoDA model prefills three sessions into a KVPool (block size 5, head dim 12), then one ragged
    batched verify round (chains and a tree) runs as the batcher runs it, with every layer's attention captured:
    the kernel, reading pool.k[layer] in place through pool.block_tables, reproduces each layer's output."""
    model = tiny_target().to(DEV)
    pool = KVPool(model.cfg, num_blocks=40, block_size=5, device=DEV)
    g = torch.Generator().manual_seed(1)
    V = model.cfg.vocab_size
    caches = [pool.sequence(capacity=96) for _ in range(3)]
    for cache, n in zip(caches, [2, 17, 61], strict=True):
        model.prefill(torch.randint(V, (1, n), generator=g).to(DEV), cache)
    trees = [
        DraftTree.chain(5, []),
        DraftTree.chain(7, [1, 2, 3, 4]),
        DraftTree(tokens=torch.randint(V, (6,), generator=g), parents=torch.tensor([-1, 0, 0, 1, 1, 3])),
    ]
    q_lens = [len(t) for t in trees]
    view = PagedBatchView(caches, q_lens)  # scatters the new rows into their slots, layer by layer
    tq = max(q_lens)
    tokens = torch.zeros(3, tq, dtype=torch.long)
    positions = torch.zeros(3, tq, dtype=torch.long)
    mask = torch.zeros(3, tq, view.lmax + tq, dtype=torch.bool)
    for i, (tree, L, n) in enumerate(zip(trees, view.lens, q_lens, strict=True)):
        tokens[i, :n], positions[i, :n], positions[i, n:] = tree.tokens, tree.positions(L), L
        mask[i, :, :L] = True
        mask[i, :n, view.lmax : view.lmax + n] = tree.ancestor_mask()
        mask[i, torch.arange(n, tq), view.lmax + torch.arange(n, tq)] = True  # padding sees itself only

    captured = []

    def capture(q, k, v, depth_k=None, depth_v=None, *, scale=None, tree_mask=None):
        o = attention.moda_attention_reference(q, k, v, depth_k, depth_v, scale=scale, tree_mask=tree_mask)
        captured.append((q, depth_k, depth_v, scale, o))
        return o

    monkeypatch.setitem(attention._BACKENDS, "capture", capture)
    model.backend = "capture"
    mask = mask.to(DEV)
    model.run(tokens.to(DEV), cache=view, positions=positions.to(DEV), tree_mask=mask)
    assert len(captured) == model.cfg.n_layers

    table, lens = pool.block_tables(caches)  # committed lengths: the round's rows are still pending
    q_lens_t = torch.tensor(q_lens, dtype=torch.int32, device=DEV)
    args = dict(block_table=table, cache_lens=lens + q_lens_t, q_lens=q_lens_t, tree_mask=mask[:, :, view.lmax :])
    for layer, (q, depth_k, depth_v, scale, o_model) in enumerate(captured):
        kc, vc = pool.k[layer], pool.v[layer]
        o = moda_verify(q, kc, vc, depth_k=depth_k, depth_v=depth_v, scale=scale, num_splits=2, **args)
        assert_rows_close(o, o_model, q_lens, tol=1e-4)
        assert_rows_close(
            o, moda_verify_naive(q, kc, vc, depth_k=depth_k, depth_v=depth_v, scale=scale, **args), q_lens
        )


@pytest.fixture
def in_place_calls(monkeypatch) -> list:
    """The "triton" backend registered (the kernels, here under the interpreter on CPU) and a list that grows by
    one for every in-place attention the batcher's PagedKernelView runs."""
    from tether.kernels.moda import moda_backend

    monkeypatch.setitem(attention._BACKENDS, "triton", moda_backend)
    calls = []
    attend = kv_pool.PagedKernelView.attend
    monkeypatch.setattr(
        kv_pool.PagedKernelView, "attend", lambda self, *a, **kw: calls.append(1) or attend(self, *a, **kw)
    )
    return calls


def test_batcher_reads_the_pool_in_place(in_place_calls):
    """verify_batch on the "triton" backend runs every layer through the paged kernel over the pool in place
    (PagedKernelView) and gives what the gathering reference path gives: the same verdicts, deltas and pool rows,
    over ragged chains and trees that straddle block edges, for three rounds of five sessions."""
    from tiny_models import tiny_moa_drafter

    from tether.server.rounds import verify_batch
    from tether.server.verifier import SequenceVerifier

    target = tiny_target(vocab_size=7).to(DEV)
    drafter = tiny_moa_drafter(target).to(DEV)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(7, (n,), generator=g).tolist() for n in (2, 4, 9, 13, 21)]
    rounds = []
    for _ in range(3):
        trees = []
        for i in range(5):
            if i % 2:
                n = int(torch.randint(1, 7, (1,), generator=g))
                parents = [-1] + [int(torch.randint(j, (1,), generator=g)) for j in range(1, n)]
                trees.append(DraftTree(tokens=torch.randint(7, (n,), generator=g), parents=torch.tensor(parents)))
            else:
                trees.append(DraftTree.chain(0, torch.randint(7, (i + 1,), generator=g).tolist()))
        rounds.append(trees)

    def session_run(backend):
        target.backend = backend
        pool = KVPool(target.cfg, num_blocks=60, block_size=5, device=DEV)
        vers = [SequenceVerifier(target, drafter, capacity=64, pool=pool) for _ in prompts]
        for v, p in zip(vers, prompts, strict=True):
            v.open(p)
        results = [verify_batch(target, list(zip(vers, trees, strict=True))) for trees in rounds]
        rows = [(pool.k[:, v.cache.blocks].flatten(1, 2)[:, : v.length], v.length) for v in vers]
        return results, rows

    got, got_rows = session_run("triton")
    assert len(in_place_calls) == 3 * target.cfg.n_layers  # one in-place attention per layer per batch
    want, want_rows = session_run("reference")
    for gr, wr in zip(got, want, strict=True):
        for (gv, gd), (wv, wd) in zip(gr, wr, strict=True):
            assert gv.path == wv.path and gv.bonus == wv.bonus
            for name in wd.tensors:
                torch.testing.assert_close(gd.tensors[name], wd.tensors[name], rtol=1e-4, atol=1e-4)
    for (gk, gl), (wk, wl) in zip(got_rows, want_rows, strict=True):
        assert gl == wl
        torch.testing.assert_close(gk, wk, rtol=1e-4, atol=1e-4)


def test_server_warm_up_leaves_the_pool_as_it_found_it(in_place_calls):
    """warm_up runs prefills and verify rounds of every tile class through the kernels, then gives every block
    back."""
    from tether.server import batcher

    target = tiny_target(vocab_size=7).to(DEV)
    target.backend = "triton"
    pool = KVPool(target.cfg, num_blocks=200, block_size=16, device=DEV)
    batcher.warm_up(target, pool, sizes=(1, 9), absorb_max=9)
    # Every forward after the prefills attends in place, one call per layer: two sizes x (chain, tree) x (the two
    # sequences batched alone, both together, each through SequenceVerifier.verify), then an absorb of each size per
    # sequence.
    assert len(in_place_calls) == (2 * 2 * (3 + 2) + 2 * 2) * target.cfg.n_layers
    assert pool.used_blocks == 0
