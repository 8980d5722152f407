"""A server compiles every Triton kernel variant before it listens: what a session launches after
`server.batcher.warm_up` is a variant that warm_up already launched. Triton compiles one variant per set of
constexprs and per specialisation of the other arguments (an integer that is 1 or a multiple of 16, a pointer
aligned to 16 bytes), and a compile inside a client's round costs seconds: on the H200 the first rounds of a fresh
`serve --attention triton` outlasted the client's round deadline, an outage on a healthy link.

The kernels are not executed here: a recorder notes each launch's variant and returns, so sessions run at the speed
of the tiny model's PyTorch ops (attention outputs are garbage, every shape is real). Runs without Triton's
interpreter too (nothing is launched)."""

import pytest
import torch
from tiny_models import tiny_target

from tether.kernels.moda import backend as moda_ops
from tether.kernels.moda import prefill, verify
from tether.server import batcher, rounds
from tether.server.kv_pool import KVPool
from tether.server.verifier import SequenceVerifier
from tether.shared import attention
from tether.shared.speculative import DraftTree

pytestmark = pytest.mark.heavy  # a long file, started first (tests/conftest.py)


def _int_class(v: int, specialised: bool) -> object:
    if not specialised:
        return "i64" if abs(v) >= 2**31 else "i32"
    if v == 1:
        return 1
    return ("i64" if abs(v) >= 2**31 else "i32", v % 16 == 0)


class Recorder:
    """Stands in for a Triton kernel (`kernel[grid](*args, **kwargs)`): records the variant Triton would compile
    for the call, launches nothing."""

    def __init__(self, name: str, kernel, log: set):
        fn = kernel.fn if hasattr(kernel, "configs") else kernel  # an Autotuner wraps the kernel
        self.name, self.arg_names, self.log = name, list(fn.arg_names), log
        if hasattr(fn, "params"):  # a JITFunction
            self.fixed = {p.name for p in fn.params if p.do_not_specialize}
        else:  # TRITON_INTERPRET=1: an InterpretedFunction keeps the decorator's arguments
            self.fixed = set(fn.kwargs.get("do_not_specialize") or ())

    def __getitem__(self, grid):
        return self.launch

    def launch(self, *args, **kwargs) -> None:
        key = [self.name]
        for name, a in zip(self.arg_names, args, strict=False):
            if isinstance(a, torch.Tensor):
                key.append((name, str(a.dtype), a.data_ptr() % 16 == 0))
            elif isinstance(a, bool) or not isinstance(a, int):
                key.append((name, a if isinstance(a, bool | str) else type(a).__name__))
            else:
                key.append((name, _int_class(a, name not in self.fixed)))
        key.append(tuple(sorted((k, v) for k, v in kwargs.items())))  # constexprs, warps, stages
        self.log.add(tuple(key))


@pytest.fixture
def variants(monkeypatch) -> set:
    """Every kernel launch of the server's attention recorded, not run; the "triton" backend registered; the
    backend routing as on a GPU."""
    log: set = set()
    monkeypatch.setattr(moda_ops, "kernel_supports", lambda q: True)  # route as on a GPU
    monkeypatch.setitem(attention._BACKENDS, "triton", moda_ops.moda_backend)
    for module, name in (
        (verify, "moda_verify_fwd_kernel"),
        (verify, "moda_verify_combine_kernel"),
        (prefill, "moda_attention_fwd_kernel_autotuned"),
    ):
        monkeypatch.setattr(module, name, Recorder(name, getattr(module, name), log))
    return log


def chain(n: int) -> DraftTree:
    return DraftTree.chain(1, [(3 * i + 2) % 7 for i in range(n - 1)])


def bushy(n: int) -> DraftTree:
    return DraftTree(tokens=torch.arange(n) % 7, parents=torch.arange(n) // 2 - (torch.arange(n) == 0).long())


def test_a_session_after_warm_up_compiles_nothing(variants):
    """Sessions of many lengths (table widths of 1, multiples of 16 and others; prefixes either side of the
    split-K threshold and past 16 splits), batched rounds of every draft size from 1 to 32 as chains and trees,
    single-sequence verifies (the batcher's fallback) and absorbs of offline chains (a resync: 1 to 70 tokens)
    launch only variants that warm_up launched."""
    # head_dim 16: rows of Hkv x D elements are multiples of 16, as in every real model (the tiny preset's 2 x 12
    # makes the cache strides' divisibility depend on each sequence's capacity).
    target = tiny_target(vocab_size=7, head_dim=16, max_seq_len=8192)
    target.backend = "triton"
    pool = KVPool(target.cfg, num_blocks=1200, block_size=16, device="cpu")
    batcher.warm_up(target, pool)
    warm = set(variants)
    assert any(k[0] == "moda_verify_combine_kernel" for k in warm)  # the recorder saw the split-K path
    variants.clear()

    for prompt_len in (1, 15, 16, 17, 255, 256, 300, 511, 512, 513, 700, 1100, 4200, 8000):
        ver = SequenceVerifier(target, None, capacity=prompt_len + 200, pool=pool)
        try:
            ver.open([(5 * i + 1) % 7 for i in range(prompt_len)])
            for n in (1, 2, 3, 5, 8, 9, 16, 17, 31, 32):
                for tree in (chain(n), bushy(n)):
                    start = ver.length
                    rounds.verify_batch(target, [(ver, tree)])
                    ver.cache.truncate(start)
                    ver.verify(tree)
                    ver.cache.truncate(start)
            for n in (1, 7, 16, 33, 64, 65, 70):  # a resync's absorb: one causal chain of offline tokens
                start = ver.length
                ver.absorb(start, [3] * n, rewind=False)
                ver.cache.truncate(start)
        finally:
            ver.release()
    # Ragged batches: rows of different lengths and draft sizes in one round.
    vers = [SequenceVerifier(target, None, capacity=n + 80, pool=pool) for n in (3, 40, 600, 2000)]
    try:
        for v, n in zip(vers, (3, 40, 600, 2000), strict=True):
            v.open([(5 * i + 1) % 7 for i in range(n)])
        for sizes in ((1, 4, 9, 2), (32, 1, 5, 17), (16, 16, 3, 8)):
            rounds.verify_batch(target, [(v, bushy(n)) for v, n in zip(vers, sizes, strict=True)])
    finally:
        for v in vers:
            v.release()

    new = sorted(variants - warm, key=str)
    assert not new, f"{len(new)} kernel variants compiled after warm-up:\n" + "\n".join(map(_nearest_diff(warm), new))


def _nearest_diff(warm: set):
    """A new variant as its differences from the closest warmed one of the same kernel (readable failures)."""

    def show(key: tuple) -> str:
        same = [w for w in warm if w[0] == key[0] and len(w) == len(key)]
        if not same:
            return f"{key[0]}: no warmed variant at all"
        best = min(same, key=lambda w: sum(a != b for a, b in zip(w, key, strict=True)))
        return f"{key[0]}: " + ", ".join(f"{b} (warmed: {a})" for a, b in zip(best, key, strict=True) if a != b)

    return show
