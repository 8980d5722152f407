"""Batch-invariant verification (issue #44): a session's verdict, delta and cached K/V do not depend on what else
shares its step, where it sits in it, or the padding: bit for bit, alone and among 1 to 127 other sessions of mixed
context lengths and draft sizes. This is what makes greedy output reproducible under any load.

It holds on the served GPU path: the fused target (tether.server.fuse: the skinny linear kernel, one row tile for
every row), the Triton MoDA verify kernel (fixed prefix chunks, always split) and the MoA drafter's server part in
fixed chunks. On the CPU it runs that same path through Triton's interpreter (TRITON_INTERPRET=1, as `make test`
sets), in fp32; on CUDA in bf16 with the step graphs, up to 128 rows. The PyTorch reference path a CPU server uses
is not batch-invariant (its matrix products are tiled by row count).

    TRITON_INTERPRET=1 .venv/bin/python -m pytest -q tests/server/test_batch_invariance.py
"""

import pytest
import torch
from interpreter_blas import BLAS_ROWS_REASON, blas_rows_placed_alike
from tiny_models import tiny_moa_drafter, tiny_target

import tether.shared.attention as attention
from tether.kernels.moda import moda_backend
from tether.kernels.utils import interpreting
from tether.server import rounds
from tether.server.fuse import fuse
from tether.server.kv_pool import KVPool
from tether.server.verifier import SequenceVerifier
from tether.shared.speculative import DraftTree

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEV == "cuda" else torch.float32
# (other sessions, the session's place among them): on the CPU the interpreter runs every program one by one.
PLACES = [(0, 0), (1, 1), (4, 2), (11, 11)] + ([(31, 0), (63, 30), (127, 60), (127, 127)] if DEV == "cuda" else [])


pytestmark = [
    pytest.mark.heavy,
    pytest.mark.skipif(DEV == "cpu" and not interpreting(), reason="the kernels need CUDA or TRITON_INTERPRET"),
    pytest.mark.skipif(DEV == "cpu" and not blas_rows_placed_alike(), reason=BLAS_ROWS_REASON),
]


@pytest.fixture(scope="module")
def served():
    """A tiny target as serve runs it (fused, the Triton backend) with a MoA drafter, and one pool for all."""
    attention.register_backend("triton", moda_backend)
    target = tiny_target(vocab_size=50, max_seq_len=512).to(DEV, DTYPE)
    target.backend = "triton"
    fuse(target)
    drafter = tiny_moa_drafter(target).to(DEV, DTYPE)
    pool = KVPool(target.cfg, num_blocks=1600, block_size=16, device=DEV, dtype=DTYPE)
    return target, drafter, pool


def one_round(served, prompt: list[int], tree_of, others: list[tuple[list[int], DraftTree]], at: int):
    """One verification round of a fresh session (`prompt`, then the tree `tree_of(root)`) placed at `at` among
    fresh `others`; returns its path, bonus token, delta tensors and every K/V row the pool holds for it."""
    target, drafter, pool = served
    mine = SequenceVerifier(target, drafter, capacity=240, pool=pool)
    items = []
    for p, tree in others:
        v = SequenceVerifier(target, drafter, capacity=240, pool=pool)
        v.open(p)
        items.append((v, tree))
    root = mine.open(prompt)[0]
    items.insert(at, (mine, tree_of(root)))
    try:
        verdict, delta = rounds.verify_batch(target, items)[at]
        kv = torch.stack([pool.k, pool.v])[:, :, mine.cache.blocks].flatten(2, 3)[:, :, : mine.length].cpu()
        return verdict.path, verdict.bonus, {k: t.cpu() for k, t in delta.tensors.items()}, kv
    finally:
        for v, _ in items:
            v.release()


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_a_sessions_round_is_the_same_bits_whatever_shares_its_step(served, shape):
    g = torch.Generator().manual_seed(1 if shape == "chain" else 2)
    vocab = served[0].cfg.vocab_size

    def draws(n: int) -> list[int]:
        return torch.randint(1, vocab, (n,), generator=g).tolist()

    prompt, drafts = draws(37), draws(6)
    parents = torch.tensor([-1, 0, 0, 1, 2, 2, 4])

    def tree_of(root: int) -> DraftTree:
        if shape == "chain":
            return DraftTree.chain(root, drafts)
        return DraftTree(tokens=torch.tensor([root, *drafts]), parents=parents)

    alone = one_round(served, prompt, tree_of, [], 0)
    for n, at in PLACES[1:]:
        # Others of 1 to 150 positions (one to ten blocks of 16: the step's table width changes around the
        # session) with 1 to 8 draft tokens (the step's tokens per row too).
        sizes = torch.randint(1, 150, (n,), generator=g).tolist()
        drafted = torch.randint(0, 8, (n,), generator=g).tolist()
        others = [(draws(size), DraftTree.chain(1, draws(d))) for size, d in zip(sizes, drafted, strict=True)]
        got = one_round(served, prompt, tree_of, others, at)
        assert got[:2] == alone[:2], (n, at)
        assert got[2].keys() == alone[2].keys()
        for name in alone[2]:
            assert torch.equal(got[2][name], alone[2][name]), (name, n, at)
        assert torch.equal(got[3], alone[3]), (n, at)
