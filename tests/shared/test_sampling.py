"""Sampling (tether.shared.sampling): the numpy rule against torch's own softmax / sort / cumsum, the proposal a
drafted token is drawn from, the tensor wrappers, and an import that leaves torch out."""

import subprocess
import sys

import numpy as np
import pytest
import torch

from tether.shared.sampling import probabilities, probabilities_np, proposal, sample_token


def torch_rule(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """The rule written independently with torch ops (what shared/sampling.py computed before it moved to numpy)."""
    probs = (logits.double() / temperature).softmax(-1)
    sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)
    sorted_p = sorted_p.masked_fill((sorted_p.cumsum(-1) - sorted_p) >= top_p, 0.0)
    probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    return probs / probs.sum(-1, keepdim=True)


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9), (1.3, 0.5), (0.2, 0.05)])
def test_numpy_rule_matches_torch(temperature, top_p):
    logits = torch.randn(3, 37, generator=torch.Generator().manual_seed(0)) * 3
    got = probabilities_np(logits.numpy(), temperature, top_p)  # [3, 37]
    assert got.dtype == np.float32 and got.shape == (3, 37)
    np.testing.assert_allclose(got, torch_rule(logits, temperature, top_p).numpy(), rtol=0, atol=2e-6)
    assert (got > 0).sum(-1).min() >= 1  # the most probable token always survives


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
