"""Drafting at the edges of a round, in both backends (torch and onnxruntime), which must agree.

- k = 0: with one token left, a sampled round drafts nothing; q comes back as empty [0, min(support, V)] arrays
  (torch.stack of an empty list raised "stack expects a non-empty TensorList" and ended the client).
- A lost round (no verdict, or one the client refused): `discard_drafts` drops the abandoned chain's rows, so the
  next draft is what a fresh one from the verified positions would be.
"""

import numpy as np
import pytest
import torch
from tiny_models import tiny_moa_drafter, tiny_target

from tether.client.onnx_drafter import OnnxDrafter
from tether.server.onnx_export import export_client_onnx
from tether.server.verifier import SequenceVerifier

PROMPT = [1, 2, 3, 4, 5, 6, 0, 1, 3]


@pytest.fixture(scope="module")
def backends(tmp_path_factory):
    target = tiny_target(vocab_size=7)
    drafter = tiny_moa_drafter(target)
    out = tmp_path_factory.mktemp("onnx")
    export_client_onnx(drafter, out)
    first, delta = SequenceVerifier(target, drafter, capacity=64).open(PROMPT)
    return first, delta, {"torch": drafter, "onnx": OnnxDrafter.load(out)}


def rng(name: str, seed: int):
    return torch.Generator().manual_seed(seed) if name == "torch" else np.random.default_rng(seed)


@pytest.mark.parametrize("name", ["torch", "onnx"])
def test_a_sampled_draft_of_zero_tokens_is_empty(backends, name):
    first, delta, drafters = backends
    d = drafters[name]
    d.begin(delta, capacity=64)
    tokens, q_ids, q_probs = d.draft(first, 0, temperature=0.8, top_p=0.9, generator=rng(name, 0))
    assert tokens == [] and tuple(q_ids.shape) == (0, 7) and tuple(q_probs.shape) == (0, 7)
    assert str(q_ids.dtype).endswith("int64") and str(q_probs.dtype).endswith("float32")
    assert d.draft(first, 0)[0] == [] and d.verified_length() == len(PROMPT)
    tokens, q_ids, _ = d.draft(first, 2, temperature=0.8, generator=rng(name, 0))  # nothing was left behind
    assert len(tokens) == 2 and tuple(q_ids.shape) == (2, 7)


@pytest.mark.parametrize("name", ["torch", "onnx"])
def test_discarding_a_lost_rounds_drafts_restores_the_fresh_chain(backends, name):
    first, delta, drafters = backends
    d = drafters[name]
    d.begin(delta, capacity=64)
    fresh = d.draft(first, 3, temperature=1.0, generator=rng(name, 1))
    d.begin(delta, capacity=64)
    d.draft(first, 3)  # a round whose answer never comes
    d.discard_drafts()
    assert d.verified_length() == len(PROMPT)
    again = d.draft(first, 3, temperature=1.0, generator=rng(name, 1))
    # The distributions, not just the tokens: the abandoned rows would shift every position after the root.
    assert again[0] == fresh[0] and np.array_equal(np.asarray(again[2]), np.asarray(fresh[2]))
