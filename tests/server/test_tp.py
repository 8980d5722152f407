"""Tensor parallelism (tether.server.tp) on CPU: 2 gloo processes must reproduce the single-process model.

Each spawned rank rebuilds the same seeded tiny model, shards it and returns what it computed; the parent
compares every rank's results with the unsharded model's. One spawn per test keeps the suite fast on 2 cores.
"""

import copy
import os

import pytest
import torch
from tiny_models import tiny_moa_drafter, tiny_target

from tether.kernels.utils import interpreting
from tether.server.engine import SpeculativeEngine
from tether.server.fuse import fuse
from tether.server.tp import NO_MULTICAST, GatherKV, apply_tp, gather_heads, spawn

pytestmark = pytest.mark.heavy  # a long file, started first (tests/conftest.py)

WORLD = 2
TIMEOUT = 120  # seconds; a hung collective must fail the test, not the suite

CONFIGS = {
    # MoDA with FFN depth K/V, post-norm, tied head; biases on so the row-parallel bias path is checked.
    "moda": dict(qkv_bias=True, o_bias=True),
    "plain": dict(moda=False, norm_position="pre"),
    # Two KV heads per rank, untied head.
    "gqa": dict(
        n_heads=8, n_kv_heads=4, head_dim=8, norm_position="pre", tied_embeddings=False, qkv_bias=True, o_bias=True
    ),  # fmt: skip
    # Group size 4: one KV head and its four query heads per rank.
    "gqa4": dict(n_heads=8, n_kv_heads=2, head_dim=8, ffn_dim=64),
}


def build(name: str):
    model = tiny_target(0, **CONFIGS[name])
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def script(model) -> dict[str, torch.Tensor]:
    """Full forward, prefill, a tree verify, accepting a path, then a chain verify; K/V gathered to all heads."""
    g = torch.Generator().manual_seed(2)
    V, L, dev = model.cfg.vocab_size, model.cfg.n_layers, model.device
    ids = lambda *shape: torch.randint(0, V, shape, generator=g).to(dev)
    out: dict[str, torch.Tensor] = {}
    with torch.inference_mode():
        out["full"] = model(ids(2, 9))
        cache = model.new_cache(1, 32)
        out["prefill"] = model.prefill(ids(1, 10), cache).logits
        # Tree: 0 -> (1, 2); 1 -> 3 -> 5; 2 -> 4.
        parents = [-1, 0, 0, 1, 2, 3]
        mask = torch.eye(6, dtype=torch.bool)
        depth = [0] * 6
        for i, p in enumerate(parents):
            if p >= 0:
                mask[i] |= mask[p]
                depth[i] = depth[p] + 1
        tree = model.verify(ids(1, 6), cache, tree_mask=mask.to(dev), positions=10 + torch.tensor(depth, device=dev),
                            hidden_layers=(L,), return_kv=True)  # fmt: skip
        out["tree"], out["hidden"] = tree.logits, tree.hidden[0]
        out["k"], out["v"] = gather_heads(tree.k, -2), gather_heads(tree.v, -2)
        out["local_heads"] = torch.tensor(tree.k.shape[-2])
        cache.accept([0, 1, 3])
        out["chain"] = model.verify(ids(1, 3), cache).logits
        out["cache_k"] = gather_heads(cache.k[:, :, : cache.length], -2)
        out["cache_v"] = gather_heads(cache.v[:, :, : cache.length], -2)
    return {k: t.cpu() for k, t in out.items()}


def _logits_rank(rank: int, world: int, device: str = "cpu") -> dict:
    """`device` "cuda" (with backend "nccl") runs the same check on GPUs: cuda:rank after init_distributed."""
    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device(device)
    results = {name: script(apply_tp(build(name).to(dev), rank, world)) for name in CONFIGS}
    results["env"] = {k: os.environ.get(k) for k in NO_MULTICAST}
    return results


@pytest.fixture(scope="module")
def tp_results() -> list[dict]:
    return spawn(_logits_rank, WORLD, backend="gloo", timeout=TIMEOUT)


@pytest.mark.timeout(TIMEOUT + 30)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_tp_matches_single_process(tp_results, name):
    want = script(build(name))
    for rank, results in enumerate(tp_results):
        got = results[name]
        assert int(got.pop("local_heads")) == CONFIGS[name].get("n_kv_heads", 2) // WORLD  # sharded like the cache
        assert got.keys() == want.keys() - {"local_heads"}
        for key, t in got.items():
            msg = lambda m, k=key, r=rank: f"{name}.{k} on rank {r}: {m}"
            torch.testing.assert_close(t, want[key], rtol=1e-5, atol=1e-5, msg=msg)


def _fused_rank(rank: int, world: int) -> dict:
    return {name: script(fuse(apply_tp(build(name), rank, world))) for name in ("moda", "gqa")}


@pytest.mark.skipif(not interpreting(), reason="the fused kernels need TRITON_INTERPRET on the CPU")
@pytest.mark.timeout(TIMEOUT + 30)
def test_fused_shards_match_single_process():
    """Fused after sharding: rank 0's GEMMs add the residual and the bias, one all-reduce sums the partials."""
    want = {name: script(build(name)) for name in ("moda", "gqa")}
    for rank, results in enumerate(spawn(_fused_rank, WORLD, backend="gloo", timeout=TIMEOUT)):
        for name, got in results.items():
            got.pop("local_heads")
            for key, t in got.items():
                msg = lambda m, k=key, r=rank, n=name: f"{n}.{k} on rank {r}: {m}"
                torch.testing.assert_close(t, want[name][key], rtol=1e-4, atol=1e-4, msg=msg)


def test_sharding_a_fused_model_is_refused():
    with pytest.raises(ValueError, match="before"):
        apply_tp(fuse(tiny_target()), 0, 2)


def test_ranks_run_without_nvlink_multicast(tp_results):
    assert all(r["env"] == NO_MULTICAST for r in tp_results)


def _spec_rank(rank: int, world: int) -> dict:
    ref = tiny_target(0, vocab_size=5)
    drafter = tiny_moa_drafter(ref, tli=1)  # built on the whole model: its client part (TLI) runs unsharded
    target = apply_tp(copy.deepcopy(ref), rank, world)
    prompt = torch.randint(0, 5, (11,), generator=torch.Generator().manual_seed(3)).tolist()
    out = {}
    for name, engine, n in [
        ("chain", SpeculativeEngine(target, GatherKV(drafter), k=4), 40),
        ("tree", SpeculativeEngine(target, GatherKV(drafter), tree=(3, 3, 7)), 30),
        ("plain", SpeculativeEngine(target, None), 20),
    ]:
        out[name] = ([t for chunk in engine.generate(prompt, n) for t in chunk], engine.stats.accepted)
    return {"prompt": prompt, **out}


@pytest.mark.timeout(TIMEOUT + 30)
def test_tp_greedy_speculative_equals_plain_greedy():
    ref = tiny_target(0, vocab_size=5)
    for results in spawn(_spec_rank, WORLD, backend="gloo", timeout=TIMEOUT):
        prompt = torch.tensor([results.pop("prompt")])
        for name, (tokens, accepted) in results.items():
            assert tokens == list(ref.generate(prompt, len(tokens))), name
            assert name == "plain" or accepted > 0  # acceptance paths (and the gathered LSA delta) were exercised


def test_indivisible_world_size_is_a_clear_error():
    with pytest.raises(ValueError, match="n_heads=4 is not divisible by world_size=3"):
        apply_tp(tiny_target(), 0, 3)
    with pytest.raises(ValueError, match="n_kv_heads=2 is not divisible by world_size=4"):
        apply_tp(tiny_target(), 0, 4)
    with pytest.raises(ValueError, match="ffn_dim=80 is not divisible by world_size=3"):
        apply_tp(tiny_target(n_heads=6, n_kv_heads=3), 0, 3)
    with pytest.raises(ValueError, match="rank"):
        apply_tp(tiny_target(), 2, 2)


def test_sharded_shapes_and_configs():
    model = tiny_target()
    cfg = model.cfg
    apply_tp(model, 1, 2)
    assert model.global_cfg == cfg and model.tp == (1, 2)
    assert (model.cfg.n_heads, model.cfg.n_kv_heads, model.cfg.ffn_dim) == (2, 1, 40)
    block = model.layers[0]
    assert block.cfg is model.cfg and block.attn.cfg is model.cfg
    assert block.attn.k_proj.weight.shape == (cfg.head_dim, cfg.dim)
    assert block.attn.o_proj.weight.shape == (cfg.dim, 2 * cfg.head_dim)
    assert block.ffn_kv_proj.weight.shape == (2 * cfg.head_dim, cfg.dim)
    assert model.new_cache(1, 8).k.shape == (cfg.n_layers, 1, 8, 1, cfg.head_dim)
    with pytest.raises(ValueError, match="already"):
        apply_tp(model, 1, 2)


def _fail_rank(rank: int, world: int) -> None:
    if rank == 1:
        raise RuntimeError("rank 1 failed on purpose")
    torch.distributed.barrier()  # would wait forever: spawn must stop it


@pytest.mark.timeout(TIMEOUT + 30)
def test_spawn_reports_a_failing_rank():
    with pytest.raises(Exception, match="rank 1 failed on purpose"):
        spawn(_fail_rank, WORLD, backend="gloo", timeout=TIMEOUT)
