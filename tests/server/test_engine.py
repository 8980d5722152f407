"""Speculative decoding end to end in one process: greedy output equals plain greedy decoding, always."""

import pytest
import torch
from tiny_models import tiny_target

from tether.server.engine import SpeculativeEngine
from tether.shared.config import PRESETS
from tether.shared.drafter import DrafterConfig
from tether.shared.eagle import EagleDrafter
from tether.shared.kv_cache import KVCache
from tether.shared.moa import MoADrafter
from tether.shared.model import Transformer

DCFG = dict(n_heads=4, n_kv_heads=2, head_dim=12, ffn_dim=64, lsa_heads=4, lsa_kv_heads=2, lsa_ffn_dim=32)


def make_target(seed=0, **overrides) -> Transformer:
    return tiny_target(seed, **overrides)


def make_drafter(target, kind: str, tli: int = 0, seed: int = 1):
    torch.manual_seed(seed)
    dcfg = DrafterConfig(kind=kind, tli=tli, **DCFG)
    return (MoADrafter if kind == "moa" else EagleDrafter)(target, dcfg).eval()


def plain_greedy(target, prompt, n):
    return list(target.generate(torch.tensor([prompt]), n))


DRAFTERS = [("moa", 0), ("moa", 1), ("moa", 2), ("eagle", 0)]


@pytest.mark.parametrize("kind,tli", DRAFTERS)
@pytest.mark.parametrize("moda", [True, False])
@pytest.mark.parametrize("vocab", [512, 5])
def test_greedy_speculative_equals_plain_greedy(kind, tli, moda, vocab):
    """vocab=5 makes random drafts agree with the target often, so multi-token acceptance paths run too."""
    target = make_target(moda=moda, vocab_size=vocab)
    drafter = make_drafter(target, kind, tli)
    prompt = torch.randint(0, vocab, (11,), generator=torch.Generator().manual_seed(3)).tolist()
    engine = SpeculativeEngine(target, drafter, k=4)
    got = [t for chunk in engine.generate(prompt, 40) for t in chunk]
    assert got == plain_greedy(target, prompt, 40)
    if vocab == 5 and kind == "moa":
        assert engine.stats.accepted > 0 and max(engine.stats.taus) >= 3  # acceptance paths were exercised


@pytest.mark.parametrize("kind,tli", DRAFTERS)
@pytest.mark.parametrize("moda", [True, False])
def test_greedy_tree_speculative_equals_plain_greedy(kind, tli, moda):
    target = make_target(moda=moda, vocab_size=7)
    drafter = make_drafter(target, kind, tli, seed=3)
    prompt = torch.randint(0, 7, (9,), generator=torch.Generator().manual_seed(4)).tolist()
    engine = SpeculativeEngine(target, drafter, tree=(3, 3, 7))
    got = [t for chunk in engine.generate(prompt, 30) for t in chunk]
    assert got == plain_greedy(target, prompt, 30)
    assert engine.stats.drafted > engine.stats.rounds  # trees of several nodes were verified
    assert engine.stats.accepted > 0


def test_sampled_tree_decoding_runs_with_deterministic_children():
    target = make_target(vocab_size=7)
    engine = SpeculativeEngine(target, make_drafter(target, "moa", 1), tree=(2, 2, 4))
    g = torch.Generator().manual_seed(5)
    out = [t for c in engine.generate([1, 2, 3], 20, temperature=1.0, generator=g) for t in c]
    assert len(out) == 20 and all(0 <= t < 7 for t in out)


def test_eagle_commit_after_partial_acceptance_keeps_greedy_exact():
    """An EAGLE drafter (seed chosen so it agrees with the target at times) through mixed accept/reject rounds:
    its cache rows for accepted positions are recomputed from exact features and the output stays exact."""
    target = make_target(moda=True, vocab_size=5)
    drafter = make_drafter(target, "eagle", seed=3)
    prompt = torch.randint(0, 5, (11,), generator=torch.Generator().manual_seed(3)).tolist()
    engine = SpeculativeEngine(target, drafter, k=4)
    got = [t for chunk in engine.generate(prompt, 40) for t in chunk]
    assert got == plain_greedy(target, prompt, 40)
    assert engine.stats.accepted > 0 and 1 in engine.stats.taus


def test_plain_engine_without_drafter_is_plain_decoding():
    target = make_target()
    engine = SpeculativeEngine(target, None)
    got = [t for chunk in engine.generate([1, 2, 3], 15) for t in chunk]
    assert got == plain_greedy(target, [1, 2, 3], 15)
    assert engine.stats.tau == 1.0


def test_sampled_speculative_decoding_is_reproducible_and_bounded():
    target = make_target(vocab_size=7)
    drafter = make_drafter(target, "moa", 1)
    runs = []
    for _ in range(2):
        engine = SpeculativeEngine(target, drafter, k=3)
        g = torch.Generator().manual_seed(11)
        runs.append([t for c in engine.generate([1, 2], 30, temperature=0.9, top_p=0.9, generator=g) for t in c])
    assert runs[0] == runs[1] and len(runs[0]) == 30 and all(0 <= t < 7 for t in runs[0])


def test_tli_layers_given_server_kv_match_the_target_last_layers():
    """On verified positions the client's TLI layers, fed the server's exact K/V, reproduce the target's own
    last N layers (exactly for a plain target; with MoDA their depth attention is approximate by design)."""
    target = make_target(moda=False)
    drafter = make_drafter(target, "moa", tli=2)
    L, n = target.cfg.n_layers, 2
    x = torch.randint(0, 512, (1, 14), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = target.run(x, hidden_layers=(L - n, L), return_kv=True)
        cache = KVCache(target.cfg, 1, 32, layers=n)
        cache.append(out.k[L - n :, :, :9], out.v[L - n :, :, :9])  # the server's delta for positions < 9
        pos = torch.arange(9, 14)[None]
        cos, sin = target.rope(pos)
        h = drafter.run_tli(out.hidden[0][:, 9:], cos, sin, cache=cache)
    torch.testing.assert_close(h, out.hidden[1][:, 9:], rtol=1e-4, atol=1e-4)


def test_drafter_deltas_are_small():
    target = make_target()
    moa, eagle = make_drafter(target, "moa", 1), make_drafter(target, "eagle")
    with torch.no_grad():
        out = target.run(torch.tensor([[1, 2, 3]]), hidden_layers=(target.cfg.n_layers,), return_kv=True)
    from tether.server.engine import target_states

    states = target_states(out)
    full = states.k.numel() + states.v.numel()
    assert moa.server_delta(states, 0, [1, 2, 3]).tensors["lsa"].shape == (3, target.cfg.dim)
    # MoA ships one vector per token plus N layers' K/V, not all L layers' K/V.
    assert sum(t.numel() for t in moa.server_delta(states, 0, [1, 2, 3]).tensors.values()) < full
    assert eagle.server_delta(states, 0, [1, 2, 3]).tensors["hidden"].shape == (3, target.cfg.dim)


def test_eagle_budget_matches_moa():
    target = Transformer(PRESETS["small"])
    moa = MoADrafter(target, DrafterConfig(kind="moa"))
    eagle = EagleDrafter(target, DrafterConfig(kind="eagle"))
    assert abs(moa.num_trainable() - eagle.num_trainable()) / moa.num_trainable() < 0.01


def test_attention_backend_is_the_kernels_on_cuda_and_the_reference_elsewhere(monkeypatch):
    import pytest

    from tether.server.model_loading import attention_backend

    assert attention_backend("cpu") == "reference" and attention_backend("cpu", "sdpa") == "sdpa"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="CUDA"):
        attention_backend("cpu", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the kernels in Triton's CPU interpreter: allowed, for tests
    assert attention_backend("cpu", "triton") == "triton"
