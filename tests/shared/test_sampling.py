"""Sampling (tether.shared.sampling): the numpy rule against torch's own softmax / sort / cumsum, the proposal a
drafted token is drawn from, the tensor wrappers, and an import that leaves torch out."""

import subprocess
import sys

import numpy as np
import pytest
import torch

from tether.shared.sampling import probabilities, probabilities_np, proposal, sample_token, top_k_ids


def torch_rule(logits: torch.Tensor, temperature: float, top_p: float, top_k: int = 0) -> torch.Tensor:
    """The rule written independently with torch ops (what shared/sampling.py computed before it moved to numpy),
    top-k as transformers' TopKLogitsWarper applies it before top-p (logits below the k-th largest masked)."""
    logits = logits.double() / temperature
    if top_k:
        kth = logits.topk(min(top_k, logits.shape[-1]), -1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)
    sorted_p = sorted_p.masked_fill((sorted_p.cumsum(-1) - sorted_p) >= top_p, 0.0)
    probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    return probs / probs.sum(-1, keepdim=True)


@pytest.mark.parametrize(
    "temperature,top_p,top_k",
    [(1.0, 1.0, 0), (0.7, 0.9, 0), (1.3, 0.5, 0), (0.2, 0.05, 0), (1.0, 1.0, 5), (0.8, 0.9, 3), (1.5, 0.99, 36),
     (1.0, 1.0, 37), (1.0, 1.0, 1000)],
)  # fmt: skip
def test_numpy_rule_matches_torch(temperature, top_p, top_k):
    logits = torch.randn(3, 37, generator=torch.Generator().manual_seed(0)) * 3
    got = probabilities_np(logits.numpy(), temperature, top_p, top_k)  # [3, 37]
    assert got.dtype == np.float32 and got.shape == (3, 37)
    np.testing.assert_allclose(got, torch_rule(logits, temperature, top_p, top_k).numpy(), rtol=0, atol=2e-6)
    assert (got > 0).sum(-1).min() >= 1  # the most probable token always survives
    if 0 < top_k < 37:
        assert (got > 0).sum(-1).max() <= top_k


def test_top_k_keeps_exactly_k_ties_to_the_lower_id():
    logits = np.array([1.0, 3.0, 2.0, 3.0, 2.0, 0.0], np.float32)
    p = probabilities_np(logits, 1.0, top_k=3)
    assert np.flatnonzero(p).tolist() == [1, 2, 3]  # 1 and 3 tie first; of the tied 2 and 4 the lower id stays
    np.testing.assert_allclose(p.sum(), 1.0, rtol=1e-6)
    assert np.flatnonzero(probabilities_np(logits, 1.0, top_k=1)).tolist() == [1]
    with pytest.raises(ValueError, match="top_k"):
        probabilities_np(logits, 1.0, top_k=-1)
    draws = {sample_token(torch.from_numpy(logits), temperature=5.0, top_k=2,
                          generator=torch.Generator().manual_seed(s)) for s in range(60)}  # fmt: skip
    assert draws == {1, 3}


def test_verifier_rule_matches_the_numpy_rule():
    """tether.shared.speculative.target_probs (float64, per-row settings) is the same rule as probabilities_np."""
    from tether.shared.speculative import target_probs

    logits = torch.randn(4, 37, generator=torch.Generator().manual_seed(3)) * 3
    temps, top_ps, top_ks = [1.0, 0.7, 1.3, 0.9], [1.0, 0.8, 1.0, 0.5], [0, 0, 4, 9]
    rows = target_probs(logits, torch.tensor(temps), torch.tensor(top_ps), torch.tensor(top_ks))  # [4, 37]
    for b in range(4):
        want = probabilities_np(logits[b].numpy(), temps[b], top_ps[b], top_ks[b])
        np.testing.assert_allclose(rows[b].numpy(), want, rtol=0, atol=2e-6)
        np.testing.assert_allclose(target_probs(logits[b], temps[b], top_ps[b], top_ks[b]).numpy(), want, atol=2e-6)
    # top-p and top-k both off: the softmax itself, bit for bit, as a number or as a row's setting
    assert torch.equal(rows[0], (logits[0].double() / 1.0).softmax(-1))


def test_greedy_is_the_first_argmax():
    logits = np.array([[0.0, 2.0, 2.0, 1.0], [5.0, -1.0, 5.0, 0.0]], np.float32)
    np.testing.assert_array_equal(probabilities_np(logits), [[0, 1, 0, 0], [1, 0, 0, 0]])
    assert sample_token(torch.from_numpy(logits[0])) == 1


def test_proposal_keeps_the_most_probable_renormalised():
    p = np.array([0.1, 0.3, 0.05, 0.3, 0.25], np.float32)
    ids, q = proposal(p, 3)
    assert ids.tolist() == [1, 3, 4] and ids.dtype == np.int64  # ties to the lower id
    np.testing.assert_allclose(q, [0.3 / 0.85, 0.3 / 0.85, 0.25 / 0.85], rtol=1e-6)
    assert proposal(p, 9)[0].shape == (5,)  # never wider than the vocabulary


def test_tensor_wrappers_keep_the_device_and_validate():
    logits = torch.randn(2, 11, generator=torch.Generator().manual_seed(1))
    p = probabilities(logits, 0.9, 0.8)
    assert p.dtype == torch.float32 and p.device == logits.device
    torch.testing.assert_close(p.sum(-1), torch.ones(2))
    with pytest.raises(ValueError, match="top_p"):
        probabilities(logits, 1.0, 0.0)
    draws = {sample_token(logits[0], temperature=1.0, generator=torch.Generator().manual_seed(s)) for s in range(40)}
    assert len(draws) > 1 and draws <= set(range(11))


def test_importing_the_rule_leaves_torch_out():
    code = "import sys, tether.shared.sampling, tether.shared.draft_trees; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("shape", [(4096,), (3, 4096), (2, 3, 1000), (5, 7)])
@pytest.mark.parametrize("k", [0, 1, 3, 8, 40, 5000])
def test_top_k_ids_is_the_stable_sorts_prefix(shape, k):
    rng = np.random.default_rng(k + len(shape))
    for x in (rng.standard_normal(shape).astype(np.float32),  # distinct values
              rng.integers(0, 4, shape).astype(np.float32),  # ties everywhere, at the k-th value too
              np.zeros(shape, np.float32)):  # fmt: skip
        want = np.argsort(-x, axis=-1, kind="stable")[..., :k]
        got = top_k_ids(x, k)
        assert got.shape == want.shape and np.array_equal(got, want)
    x = rng.standard_normal(shape).astype(np.float32)
    x.flat[1] = np.nan  # ordered as the sort orders it
    assert np.array_equal(top_k_ids(x, k), np.argsort(-x, axis=-1, kind="stable")[..., :k])
