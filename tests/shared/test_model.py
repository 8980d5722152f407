"""The target model's forward modes agree with each other and with the definition of MoDA attention."""

import pytest
import torch
from tiny_models import tiny_target

from tether.shared.attention import attention_sdpa, moda_attention_bruteforce, moda_attention_reference
from tether.shared.config import ModelConfig
from tether.shared.model import Transformer

VARIANTS = [
    pytest.param(dict(moda=True, moda_ffn_kv=True, norm_position="post"), id="moda-ffnkv-post"),
    pytest.param(dict(moda=True, moda_ffn_kv=False, norm_position="pre"), id="moda-pre"),
    pytest.param(dict(moda=False, moda_ffn_kv=False, norm_position="pre"), id="plain-pre"),
    pytest.param(dict(moda=False, moda_ffn_kv=False, norm_position="post"), id="plain-post"),
]


def make_model(seed: int = 0, **overrides) -> Transformer:
    return tiny_target(seed, std=0.2, **overrides)


def ids(B: int, T: int, vocab: int = 512, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("variant", VARIANTS)
@torch.no_grad()
def test_cached_decoding_matches_full_forward(variant):
    model = make_model(**variant)
    x = ids(2, 19)
    full = model(x)
    cache = model.new_cache(2, 32)
    out = [model.prefill(x[:, :7], cache).logits]
    for t in range(7, 19):
        out.append(model.prefill(x[:, t : t + 1], cache).logits)
    torch.testing.assert_close(torch.cat(out, 1), full, rtol=1e-4, atol=1e-4)
    assert cache.length == 19


@pytest.mark.parametrize("variant", VARIANTS)
@torch.no_grad()
def test_chain_verify_equals_single_steps(variant):
    model = make_model(**variant)
    x = ids(1, 16)
    cache_a, cache_b = model.new_cache(1, 32), model.new_cache(1, 32)
    model.prefill(x[:, :10], cache_a)
    model.prefill(x[:, :10], cache_b)
    chain = torch.ones(6, 6, dtype=torch.bool).tril()
    verified = model.verify(x[:, 10:], cache_a, tree_mask=chain, return_kv=True)
    steps = []
    for t in range(10, 16):
        steps.append(model.prefill(x[:, t : t + 1], cache_b).logits)
    torch.testing.assert_close(verified.logits, torch.cat(steps, 1), rtol=1e-4, atol=1e-4)
    assert cache_a.length == 10  # verify leaves its rows pending
    cache_a.advance(6)
    torch.testing.assert_close(cache_a.k[:, :, :16], cache_b.k[:, :, :16])
    torch.testing.assert_close(verified.k, cache_b.k[:, :, 10:16])


@pytest.mark.parametrize("variant", VARIANTS[:2])
@torch.no_grad()
def test_tree_verify_matches_each_branch(variant):
    model = make_model(**variant)
    prompt = ids(1, 9)
    # A tree of 6 draft tokens: 0 -> {1, 2}; 1 -> {3}; 2 -> {4}; 4 -> {5}.
    parent = [-1, 0, 0, 1, 2, 4]
    depth = [0, 1, 1, 2, 2, 3]
    tree_tokens = ids(1, 6, seed=5)
    mask = torch.zeros(6, 6, dtype=torch.bool)
    for i in range(6):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parent[j]
    cache = model.new_cache(1, 32)
    model.prefill(prompt, cache)
    pos = torch.tensor(depth) + cache.length
    out = model.verify(tree_tokens, cache, tree_mask=mask, positions=pos)
    for leaf in range(6):
        path = [j for j in range(6) if mask[leaf, j]]
        seq = torch.cat([prompt, tree_tokens[:, path]], 1)
        ref = model(seq)[:, -1]
        torch.testing.assert_close(out.logits[:, leaf], ref, rtol=1e-4, atol=1e-4)
    # Accepting a root-to-leaf path leaves the cache exactly as a chain prefill of that path would.
    path = [0, 2, 4, 5]
    cache.accept(path)
    chain = model.new_cache(1, 32)
    model.prefill(torch.cat([prompt, tree_tokens[:, path]], 1), chain)
    assert cache.length == chain.length == 13
    torch.testing.assert_close(cache.k[:, :, :13], chain.k[:, :, :13], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(cache.v[:, :, :13], chain.v[:, :, :13], rtol=1e-4, atol=1e-4)


def random_attention_inputs(B, Tq, Tk, Hq, Hkv, D, L, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Tq, Hq, D, generator=g)
    k = torch.randn(B, Tk, Hkv, D, generator=g)
    v = torch.randn(B, Tk, Hkv, D, generator=g)
    dk = torch.randn(B, Tq, L, Hkv, D, generator=g)
    dv = torch.randn(B, Tq, L, Hkv, D, generator=g)
    return q, k, v, dk, dv


@pytest.mark.parametrize("Tq,Tk,Hq,Hkv,L", [(13, 13, 4, 2, 5), (7, 20, 8, 2, 1), (1, 9, 6, 6, 3), (11, 11, 4, 1, 0)])
def test_reference_equals_bruteforce_union(Tq, Tk, Hq, Hkv, L):
    q, k, v, dk, dv = random_attention_inputs(2, Tq, Tk, Hq, Hkv, 16, L)
    ref = moda_attention_reference(q, k, v, dk, dv, scale=0.3)
    brute = moda_attention_bruteforce(q, k, v, dk, dv, scale=0.3)
    torch.testing.assert_close(ref, brute, rtol=1e-4, atol=1e-4)


def test_reference_equals_bruteforce_with_tree_mask():
    q, k, v, dk, dv = random_attention_inputs(2, 6, 15, 4, 2, 8, 4, seed=3)
    mask = torch.rand(2, 6, 6, generator=torch.Generator().manual_seed(0)) > 0.5
    mask |= torch.eye(6, dtype=torch.bool)
    ref = moda_attention_reference(q, k, v, dk, dv, tree_mask=mask)
    brute = moda_attention_bruteforce(q, k, v, dk, dv, tree_mask=mask)
    torch.testing.assert_close(ref, brute, rtol=1e-4, atol=1e-4)


def test_depth_keys_change_the_output():
    """Guards the tests above against a reference that silently ignores depth."""
    q, k, v, dk, dv = random_attention_inputs(1, 5, 5, 4, 2, 8, 3)
    with_depth = moda_attention_reference(q, k, v, dk, dv)
    without = moda_attention_reference(q, k, v, dk[:, :, :0], dv[:, :, :0])
    assert (with_depth - without).abs().max() > 1e-2


@pytest.mark.parametrize("Tq,Tk", [(9, 9), (4, 12)])
@pytest.mark.parametrize("Hq,Hkv", [(6, 2), (4, 4)], ids=["gqa", "mha"])
def test_sdpa_backend_matches_reference_without_depth(Tq, Tk, Hq, Hkv):
    q, k, v, _, _ = random_attention_inputs(2, Tq, Tk, Hq, Hkv, 16, 0)
    torch.testing.assert_close(attention_sdpa(q, k, v), moda_attention_reference(q, k, v), rtol=1e-4, atol=1e-4)
    tree = torch.rand(Tq, Tq, generator=torch.Generator().manual_seed(1)) < 0.5
    tree |= torch.eye(Tq, dtype=torch.bool)
    torch.testing.assert_close(attention_sdpa(q, k, v, tree_mask=tree),
                               moda_attention_reference(q, k, v, tree_mask=tree), rtol=1e-4, atol=1e-4)  # fmt: skip


@torch.no_grad()
def test_model_on_sdpa_backend_matches_reference():
    model = make_model(moda=False, norm_position="pre")
    x = ids(2, 12)
    ref = model(x)
    model.backend = "sdpa"
    torch.testing.assert_close(model(x), ref, rtol=1e-4, atol=1e-4)


@torch.no_grad()
def test_hidden_states_and_kv_outputs():
    model = make_model()
    x = ids(1, 8)
    out = model.run(x, hidden_layers=(0, -1, 2), return_kv=True)
    n, c = model.cfg.n_layers, model.cfg
    assert out.k.shape == (n, 1, 8, c.n_kv_heads, c.head_dim)
    torch.testing.assert_close(out.hidden[0], model.embed_norm(model.embed_tokens(x)))  # post-norm: normalised
    torch.testing.assert_close(model.head(model.norm(out.hidden[1])), out.logits)
    assert out.hidden[2].shape == (1, 8, c.dim)


def test_moda_layer_zero_is_plain_attention_and_depth_grows():
    cfg = ModelConfig(n_layers=4)
    assert [cfg.depth_len(i) for i in range(4)] == [0, 2, 4, 6]
    assert ModelConfig(n_layers=4, moda_ffn_kv=False).depth_len(3) == 3
    assert ModelConfig(n_layers=4, moda=False).depth_len(3) == 0


def test_training_backward_runs_through_depth():
    model = make_model()
    model.train()
    loss = model(ids(2, 10)).logsumexp(-1).mean()
    loss.backward()
    assert model.layers[0].ffn_kv_proj.weight.grad.abs().sum() > 0
