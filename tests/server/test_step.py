"""Fixed-shape steps (tether.server.step): padding a batch up to its bucket changes nothing a caller sees, padding
touches only the pool's scratch block, and on CUDA the replayed graphs give exactly what the eager step gives.

On the CPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1, as `make test` sets) and steps run
eagerly: graphs are an accelerator behind the same function, tested on the GPU by the same tests."""

import dataclasses

import pytest
import torch
from tiny_models import tiny_moa_drafter, tiny_target

import tether.shared.attention as attention
from tether.kernels.moda import moda_backend
from tether.kernels.utils import interpreting
from tether.server import rounds
from tether.server.engine import SpeculativeEngine
from tether.server.kv_pool import KVPool
from tether.server.step import StepBatch, StepConfig, StepRunner
from tether.server.verifier import SequenceVerifier
from tether.shared.acceptance import unpack_verdicts
from tether.shared.drafter_config import ArrayDelta
from tether.shared.speculative import DraftTree, verify
from tether.shared.wire import bf16_to_f32

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = [
    pytest.mark.heavy,
    pytest.mark.skipif(DEV == "cpu" and not interpreting(), reason="the kernels need CUDA or TRITON_INTERPRET"),
]


@pytest.fixture
def triton_backend(monkeypatch):
    monkeypatch.setitem(attention._BACKENDS, "triton", moda_backend)


def sessions(target, drafter, pool, prompts):
    vers = [SequenceVerifier(target, drafter, capacity=96, pool=pool) for _ in prompts]
    roots = [v.open(p)[0] for v, p in zip(vers, prompts, strict=True)]
    return vers, roots


def rounds_of(seed: int, vocab: int, n_sessions: int, n_rounds: int) -> list[list[DraftTree]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n_rounds):
        trees = []
        for i in range(n_sessions):
            n = int(torch.randint(1, 11, (1,), generator=g))  # 1 to 10 nodes: buckets 1, 2, 4, 8 and 16
            if i % 2:
                parents = [-1] + [int(torch.randint(j, (1,), generator=g)) for j in range(1, n)]
                trees.append(DraftTree(tokens=torch.randint(vocab, (n,), generator=g), parents=torch.tensor(parents)))
            else:
                trees.append(DraftTree.chain(0, torch.randint(vocab, (n - 1,), generator=g).tolist()))
        out.append(trees)
    return out


def as_float(delta) -> dict[str, torch.Tensor]:
    """A delta's tensors in fp32 on the CPU: torch tensors, or the batcher's numpy bfloat16 bits (ArrayDelta)."""
    if isinstance(delta, ArrayDelta):
        return {k: torch.from_numpy(bf16_to_f32(a)) for k, a in delta.tensors.items()}
    return {k: t.float().cpu() for k, t in delta.tensors.items()}


def run_sessions(target, drafter, config: StepConfig | None, backend: str, host_deltas: bool = False):
    """Three rounds of three sessions (ragged chains and trees, contexts across block edges), batched; returns the
    verdicts, the deltas and every session's committed pool rows."""
    target.backend = backend
    dtype = target.embed_tokens.weight.dtype
    pool = KVPool(target.cfg, num_blocks=40, block_size=5, device=DEV, dtype=dtype, step_config=config)
    vers, roots = sessions(target, drafter, pool, [[1, 2], [3, 4, 5, 6, 1, 2, 3], list(range(1, 7)) * 3])
    got = []
    for trees in rounds_of(5, target.cfg.vocab_size, len(vers), 3):
        trees = [
            DraftTree(torch.cat([torch.tensor([r]), t.tokens[1:]]), t.parents)
            for r, t in zip(roots, trees, strict=True)
        ]
        res = rounds.verify_batch(target, list(zip(vers, trees, strict=True)), host_deltas=host_deltas)
        got.append([(v.path, v.bonus, as_float(d)) for v, d in res])
        roots = [v.bonus for v, _ in res]
    kv = [pool.k[:, v.cache.blocks].flatten(1, 2)[:, : v.length].float().cpu() for v in vers]
    scratch = pool.k[:, pool.scratch].clone()
    used = pool.used_blocks
    for v in vers:
        v.release()
    assert pool.used_blocks == 0 and used > 0
    return got, kv, scratch


def assert_same(a, b, tol):
    (ga, ka, _), (gb, kb, _) = a, b
    for ra, rb in zip(ga, gb, strict=True):
        for (pa, ba, da), (pb, bb, db) in zip(ra, rb, strict=True):
            assert pa == pb and ba == bb
            for name in da:
                torch.testing.assert_close(da[name], db[name], rtol=tol, atol=tol)
    for x, y in zip(ka, kb, strict=True):
        torch.testing.assert_close(x, y, rtol=tol, atol=tol)


def test_bucketed_steps_equal_the_gathering_path(triton_backend):
    """Steps padded to buckets (rows, tokens, table width) give the verdicts, deltas and pool rows of the
    reference path that gathers each row's cache: padding is invisible."""
    target = tiny_target(vocab_size=7).to(DEV)
    drafter = tiny_moa_drafter(target).to(DEV)
    stepped = run_sessions(target, drafter, StepConfig(graphs=DEV == "cuda"), "triton")
    reference = run_sessions(target, drafter, None, "reference")
    assert_same(stepped, reference, 1e-4)


def test_steps_larger_than_every_bucket_run_eagerly_and_equal_the_gathering_path(triton_backend):
    """A batch no bucket holds runs as the same StepBatch, eagerly at its own shape (StepRunner.eager): the verdicts,
    deltas and pool rows of the reference path that gathers each row's cache."""
    target = tiny_target(vocab_size=7).to(DEV)
    drafter = tiny_moa_drafter(target).to(DEV)
    eager = run_sessions(target, drafter, StepConfig(batch_buckets=(1,), token_buckets=(1,)), "triton")
    reference = run_sessions(target, drafter, None, "reference")
    assert_same(eager, reference, 1e-4)


def test_the_batchers_deltas_equal_the_gathering_path(triton_backend):
    """The batcher's deltas (host_deltas: the drafter's server part over every token of the step, on CUDA a graph
    replayed beside the step's over its padded rows, then sliced per row) across rounds that reuse buckets with new
    data: those of the reference path, which gathers each row's accepted states and runs the drafter on them."""
    target = tiny_target(vocab_size=7).to(DEV)
    drafter = tiny_moa_drafter(target).to(DEV)
    stepped = run_sessions(target, drafter, StepConfig(graphs=DEV == "cuda"), "triton", host_deltas=True)
    got, kv, scratch = run_sessions(target, drafter, None, "reference")
    # The batcher's deltas are bfloat16 (what the wire carries): the reference's, rounded, within one bf16 step.
    rounded = [[(p, b, {k: t.bfloat16().float() for k, t in d.items()}) for p, b, d in row] for row in got]
    assert_same(stepped, (rounded, kv, scratch), 8e-3)


def test_padding_writes_only_the_scratch_block(triton_backend):
    """A step of one real row in a bucket of 4 rows x 8 tokens: the real row's K/V land in its own slots, every
    other block of the pool is untouched, and the padded rows' K/V went to the scratch block."""
    target = tiny_target(vocab_size=7).to(DEV)
    pool = KVPool(target.cfg, num_blocks=6, block_size=4, device=DEV)
    runner = StepRunner(target, pool, StepConfig(graphs=False, batch_buckets=(4,), token_buckets=(8,)))
    cache = pool.sequence(16)
    cache.reserve(3)
    pool.k.normal_()
    before = pool.k.clone()
    tree = DraftTree.chain(1, [2, 3])
    batch = rounds.step_batch([cache], [tree])
    assert batch.block_table.tolist() == [[cache.blocks[0]]]
    with runner.lock:
        out, greedy = runner.forward(batch, states=True)
        assert out.logits.shape[:2] == (4, 8) and out.k.shape[1:3] == (4, 8)
        ref = out.k[:, 0, :3].clone()
        # The step's own greedy verdict of the real row is the scalar reference's.
        want = verify(tree, out.logits[0, :3])
        assert unpack_verdicts([tree], greedy.cpu())[0] == want
    changed = (pool.k != before).flatten(3).any(-1).any(0)  # [blocks + 1, block_size]
    own = cache.blocks[0]
    assert changed[own, :3].all() and not changed[own, 3:].any()
    assert changed[pool.scratch].any()
    others = [b for b in range(pool.num_blocks) if b != own]
    assert not changed[others].any()
    torch.testing.assert_close(pool.k[:, own, :3], ref.to(pool.k.dtype))


def test_buckets_round_up_and_large_steps_fall_back():
    cfg = StepConfig(batch_buckets=(1, 2, 4), token_buckets=(1, 8), min_width=4, max_bucket_tokens=16)
    target = tiny_target(max_seq_len=64)
    runner = StepRunner(target, KVPool(target.cfg, num_blocks=4, block_size=4), cfg)
    assert runner.bucket(2, 5, 5, True) == (2, 8, 8, True)
    assert runner.bucket(3, 1, 5, True) == (4, 1, 8, True)
    assert runner.bucket(1, 1, 1, False) == (1, 1, 4, False)
    assert runner.bucket(2, 8, 16, False).width == 16  # the widest table the model's length needs
    assert runner.bucket(5, 1, 1, False) is None  # more rows than any bucket
    assert runner.bucket(3, 5, 1, False) is None  # 4 x 8 = 32 tokens > max_bucket_tokens


def test_round_shapes_cover_every_bucket_a_round_can_land_in():
    cfg = StepConfig(batch_buckets=(1, 2, 4, 8), token_buckets=(1, 4, 8), min_width=2, max_bucket_tokens=16)
    target = tiny_target(max_seq_len=40)
    runner = StepRunner(target, KVPool(target.cfg, num_blocks=4, block_size=4), cfg)
    shapes = runner.round_shapes(3)
    assert len(shapes) == len({tuple(s) for s in shapes})
    want = {runner.bucket(rows, 3, width, True) for rows in range(1, 5) for width in range(1, 11)}
    assert {tuple(s) for s in shapes} == want  # 8 rows x 4 tokens > max_bucket_tokens: eager, not listed
    assert {s[2] for s in shapes} == {2, 4, 8, 10}  # doubling from min_width, capped at the model's 10 blocks
    assert runner.round_shapes(9) == []  # past every token bucket


def test_step_batch_describes_each_row():
    target = tiny_target()
    pool = KVPool(target.cfg, num_blocks=8, block_size=4)
    a, b = pool.sequence(32), pool.sequence(32)
    a.reserve(6)
    a.commit(6)
    tree = DraftTree(tokens=torch.tensor([1, 2, 3]), parents=torch.tensor([-1, 0, 0]))
    batch: StepBatch = rounds.step_batch([a, b], [tree, DraftTree.chain(4, [])])
    assert batch.positions.tolist() == [[6, 7, 7], [0, 0, 0]]
    assert batch.q_lens.tolist() == [3, 1] and batch.cache_lens.tolist() == [9, 1]
    bs = pool.block_size
    assert batch.slots[0].tolist() == [a.blocks[p // bs] * bs + p % bs for p in (6, 7, 8)]
    assert batch.slots[1].tolist() == [b.blocks[0] * bs, -1, -1]
    assert batch.tree_mask[0].tolist() == [[True, False, False], [True, True, False], [True, False, True]]


@pytest.mark.skipif(DEV != "cuda", reason="CUDA graphs need a GPU")
def test_graphs_replay_what_the_eager_step_computes(triton_backend):
    """On the GPU: the same sessions with graphs on and off, and greedy speculative decoding through replayed
    steps equals plain greedy decoding token for token."""
    target = tiny_target(vocab_size=7).to(DEV)
    drafter = tiny_moa_drafter(target).to(DEV)
    graphs = run_sessions(target, drafter, StepConfig(graphs=True), "triton")
    eager = run_sessions(target, drafter, StepConfig(graphs=False), "triton")
    assert_same(graphs, eager, 1e-5)
    big = dataclasses.replace(target.cfg, vocab_size=97)
    target = tiny_target(vocab_size=big.vocab_size).to(DEV)
    target.backend = "triton"
    prompt = [5, 9, 11, 3]
    plain = [t for c in SpeculativeEngine(target, None).generate(prompt, 40) for t in c]
    spec = [t for c in SpeculativeEngine(target, tiny_moa_drafter(target).to(DEV), k=4).generate(prompt, 40) for t in c]
    target.backend = "reference"
    ref = list(target.generate(torch.tensor([prompt], device=DEV), 40))
    assert plain == spec == ref


def test_chained_decode_steps_equal_one_token_rounds(triton_backend):
    """Plain greedy decoding chained on the device (16 + 4 + 2 + 1 steps, across block edges) gives the tokens and
    the cached K/V of 23 one-token verify rounds."""
    target = tiny_target(vocab_size=37).to(DEV)
    target.backend = "triton"
    pool = KVPool(target.cfg, num_blocks=30, block_size=4, device=DEV, dtype=target.embed_tokens.weight.dtype)
    chained, rounds_ = (SequenceVerifier(target, None, capacity=64, pool=pool) for _ in range(2))
    prompt = [3, 14, 15, 9, 26, 5]
    root = chained.open(prompt)[0]
    assert root == rounds_.open(prompt)[0]
    got = chained.decode(root, 23)
    want = []
    for _ in range(23):
        root = rounds_.verify(DraftTree.chain(root, []))[0].bonus
        want.append(root)
    assert got == want and chained.length == rounds_.length == len(prompt) + 23
    rows = [pool.k[:, v.cache.blocks].flatten(1, 2)[:, : v.length] for v in (chained, rounds_)]
    torch.testing.assert_close(rows[0], rows[1], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="do not fit"):
        chained.decode(got[-1], chained.room + 1)


@pytest.mark.skipif(DEV != "cuda", reason="CUDA graphs need a GPU")
def test_captured_shapes_are_captured_again_by_a_new_runner(triton_backend):
    """What a warm start replays: the shapes one runner captured, captured up front by the next."""
    target = tiny_target(vocab_size=37).to(DEV)
    target.backend = "triton"
    pool = KVPool(target.cfg, num_blocks=30, block_size=4, device=DEV)
    ver = SequenceVerifier(target, None, capacity=64, pool=pool)
    root = ver.open([1, 2, 3])[0]
    ver.decode(root, 5)
    ver.verify(DraftTree.chain(root, [4, 5]))
    shapes = pool.runner_for(target).shapes()
    assert any(len(s) == 2 for s in shapes) and any(len(s) == 4 for s in shapes)
    fresh = StepRunner(target, pool)
    assert fresh.capture_shapes(shapes + [[999, 1], [3, 3, 3]]) == len(shapes)
    assert sorted(fresh.shapes()) == sorted(shapes)


@pytest.mark.skipif(DEV != "cuda", reason="CUDA graphs need a GPU")
def test_rounds_capture_nothing_after_their_shapes_were_captured_up_front(triton_backend):
    """serve's --round-graph-tokens: a server that captured round_shapes(k + 1) captures no step in the rounds."""
    target = tiny_target(vocab_size=37).to(DEV)
    target.backend = "triton"
    drafter = tiny_moa_drafter(target).to(DEV)
    pool = KVPool(target.cfg, num_blocks=60, block_size=4, device=DEV)
    runner = pool.runner_for(target)
    runner.capture_shapes(runner.round_shapes(3), drafter=drafter)
    before = sorted(runner.shapes())
    vers, roots = sessions(target, drafter, pool, [[1, 2, 3], [4, 5, 6, 7, 8], [9] * 30])
    for r in range(8):  # contexts grow from 1 block of 4 positions to 14: two widths, 8 and 16 blocks
        for n in range(1, len(vers) + 1):
            trees = [DraftTree.chain(root, [(r + i) % 37, 7]) for i, root in enumerate(roots[:n])]
            res = rounds.verify_batch(target, list(zip(vers[:n], trees, strict=True)), host_deltas=True)
            roots[:n] = [v.bonus for v, _ in res]
    assert sorted(runner.shapes()) == before
    for v in vers:
        v.release()


def test_every_token_delta_sliced_equals_the_gathered_delta(triton_backend):
    """The batcher's deltas (the drafter's server part over every token, enqueued before the verdicts' copy, then
    sliced per row: a view for a chain's prefix, a gather for a tree's path) equal what verifying each round on
    its own gathers."""
    target = tiny_target(vocab_size=37).to(DEV)
    target.backend = "triton"
    drafter = tiny_moa_drafter(target, tli=2).to(DEV)
    pool = KVPool(target.cfg, num_blocks=60, block_size=4, device=DEV)
    prompts = [[3, 14, 15, 9, 26], [5, 3, 5], [8, 9, 7, 9, 3, 2, 3, 8]]
    batched, roots = sessions(target, drafter, pool, prompts)
    single, _ = sessions(target, drafter, pool, prompts)
    plain, _ = sessions(target, None, pool, prompts[:2])
    good = [plain[i].decode(roots[i], 3) for i in range(2)]  # what greedy verification will accept
    wrong = (good[1][0] + 1) % 37
    trees = [
        DraftTree.chain(roots[0], good[0][:2] + [(good[0][2] + 1) % 37]),  # path [0, 1, 2]: a view
        DraftTree(tokens=torch.tensor([roots[1], wrong, good[1][0]]), parents=torch.tensor([-1, 0, 0])),  # [0, 2]
        DraftTree.chain(roots[2], [1, 2]),
    ]
    got = rounds.verify_batch(target, list(zip(batched, trees, strict=True)), host_deltas=True)
    assert [v.path for v, _ in got][:2] == [[0, 1, 2], [0, 2]]
    for (verdict, delta), ver, tree in zip(got, single, trees, strict=True):
        want_verdict, want = ver.verify(tree)
        assert verdict.path == want_verdict.path and delta.start == want.start and delta.tokens == want.tokens
        assert isinstance(delta, ArrayDelta) and delta.tensors.keys() == want.tensors.keys()
        for k, t in as_float(delta).items():  # bfloat16 on the wire: the gathered delta rounded the same way
            torch.testing.assert_close(t, want.tensors[k].to(torch.bfloat16).float().cpu(), rtol=8e-3, atol=1e-5)


@pytest.mark.skipif(DEV != "cuda", reason="CUDA graphs need a GPU")
def test_capture_while_other_threads_use_the_gpu(triton_backend):
    """A server captures step graphs while other threads run eager forwards (prefills), allocate and copy results
    to the host (measured on the H200: concurrent Generate streams failed with 'operation not permitted when stream
    is capturing' before captures became thread-local and one at a time). Another thread runs forwards of changing
    lengths without pause while this one captures new buckets; both finish, and the replayed tokens equal one-token
    rounds."""
    import threading

    target = tiny_target(vocab_size=37).to(DEV)
    target.backend = "triton"
    other = tiny_target(vocab_size=37, seed=1).to(DEV)
    pool = KVPool(target.cfg, num_blocks=40, block_size=4, device=DEV)
    ver, ref = (SequenceVerifier(target, None, capacity=96, pool=pool) for _ in range(2))
    started, stop, errors = threading.Event(), threading.Event(), []

    def busy():
        try:
            for i in range(100_000):  # bounded; stops when the captures are done
                # Ids drawn on the CPU: the CUDA generator belongs to the capture while one runs (the server
                # samples on the CPU, with each session's own generator).
                ids = torch.randint(0, 37, (1, i % 50 + 1)).to(DEV)
                other(ids).argmax(-1).tolist()  # an eager forward, then a copy the host waits for
                started.set()
                if stop.is_set():
                    return
        except Exception as e:  # noqa: BLE001 - the test reports it
            errors.append(e)
            started.set()

    t = threading.Thread(target=busy)
    t.start()
    try:
        assert started.wait(60)
        root = ver.open([1, 2, 3])[0]
        assert root == ref.open([1, 2, 3])[0]
        got = ver.decode(root, 23)  # 16 + 4 + 2 + 1 chained steps: four decode graphs, each a new capture
    finally:
        stop.set()
        t.join(60)
    assert not errors, errors
    want = []
    for _ in range(23):
        root = ref.verify(DraftTree.chain(root, []))[0].bonus
        want.append(root)
    assert got == want


@pytest.mark.skipif(DEV != "cuda", reason="CUDA graphs need a GPU")
def test_one_server_part_graph_serves_every_width_of_a_shape(triton_backend):
    """Steps of the same rows x tokens but different block-table widths (short and long contexts) share one graph
    of the drafter's server part, over the states each step graph copies into the shape's buffers; the deltas of
    both equal what verifying each round on its own gathers."""
    target = tiny_target(vocab_size=37).to(DEV)
    target.backend = "triton"
    drafter = tiny_moa_drafter(target, tli=2).to(DEV)
    pool = KVPool(target.cfg, num_blocks=200, block_size=2, device=DEV)
    runner = pool.runner_for(target)
    for prompt_len in (9, 40):  # 5 and 20 blocks of 2: widths 8 and 32
        prompts = [[(7 * i + j) % 37 for i in range(prompt_len)] for j in range(2)]
        batched, roots = sessions(target, drafter, pool, prompts)
        single, _ = sessions(target, drafter, pool, prompts)
        trees = [DraftTree.chain(r, [1, 2, 3]) for r in roots]
        got = rounds.verify_batch(target, list(zip(batched, trees, strict=True)), host_deltas=True)
        for (verdict, delta), ver, tree in zip(got, single, trees, strict=True):
            want_verdict, want = ver.verify(tree)
            assert verdict.path == want_verdict.path and delta.tokens == want.tokens
            for k, t in as_float(delta).items():
                torch.testing.assert_close(t, want.tensors[k].to(torch.bfloat16).float().cpu(), rtol=8e-3, atol=1e-5)
        for v in batched + single:
            v.release()
    widths = {s[2] for s in runner.shapes() if len(s) == 4 and s[3]}
    assert len(widths) == 2 and len(runner._parts) == 1
