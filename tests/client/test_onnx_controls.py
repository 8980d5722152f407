"""The onnxruntime drafter proposes from the processed rule (tether.shared.logits_processing), as the torch drafters
do: greedy chains, trees and the guess after fed tokens are those of the processed logits, each position processed
with the counts of its own context (the root's plus its path), and a sampled draft carries the processed
distribution. Both backends get the same deltas from the target, so their drafts must agree token for token."""

import numpy as np
import pytest
import torch
from test_onnx_backend import PROMPT, VOCAB, exported  # noqa: F401  (exported: the module's fixture)

from tether.client.onnx_drafter import OnnxDrafter
from tether.server.verifier import SequenceVerifier
from tether.shared.logits_processing import SamplingControls
from tether.shared.sampling import probabilities_np

# A penalty on every count, a token pushed up and one banned: each shows in a 7-token vocabulary.
CONTROLS = SamplingControls(presence_penalty=1.5, frequency_penalty=0.6, repetition_penalty=1.8,
                            logit_bias={2: 1.5, 5: -100})  # fmt: skip


def processing(controls: SamplingControls, context: list[int], prompt_len: int = len(PROMPT)):
    return controls.processing(context, prompt_len, VOCAB)


def opened(target, ref):
    """The prompt's first token and delta from the target, as a server would send them."""
    root, delta = SequenceVerifier(target, ref, capacity=64).open(PROMPT)
    return root, delta


@pytest.mark.parametrize("kind", ["moa", "eagle"])
def test_greedy_chain_tree_and_guess_under_controls_match_torch(exported, kind):  # noqa: F811
    target, ref, out = exported(kind)
    onnx = OnnxDrafter.load(out)
    root, delta = opened(target, ref)
    context = [*PROMPT, root]  # the sequence through the round's root
    proc = processing(CONTROLS, context)
    got = {}
    for name, d in (("torch", ref), ("onnx", onnx)):
        d.begin(delta)
        chain, _, _ = d.draft(root, 6, processing=proc)
        d.discard_drafts()
        tree = d.draft_tree(root, depth=3, top_k=2, total_tokens=6, processing=proc)
        tree = (list(map(int, tree.tokens)), list(map(int, tree.parents)))
        guess = d.feed([root, *chain[:2]], processing=proc.after(chain[:2]))  # the bonus guessed after them
        d.discard_drafts()
        plain, _, _ = d.draft(root, 6)
        got[name] = chain, tree, guess, plain
    assert got["onnx"] == got["torch"]
    chain, _, _, plain = got["onnx"]
    assert 5 not in chain  # banned by logit_bias
    assert chain != plain  # the controls decided some drafts


def test_each_drafted_position_is_processed_with_its_own_context(exported):  # noqa: F811
    """A greedy chain under penalties is, token for token, the argmax of the drafter's logits processed with the
    counts of the context before it: the root's, plus the drafts before it (a repeated token is penalised again)."""
    target, ref, out = exported("moa", 2)
    onnx = OnnxDrafter.load(out)
    root, delta = opened(target, ref)
    controls = SamplingControls(frequency_penalty=2.0, presence_penalty=2.0)
    proc = processing(controls, [*PROMPT, root])
    onnx.begin(delta)
    chain, _, _ = onnx.draft(root, 6, processing=proc)
    onnx.begin(delta)
    want, token = [], root
    for _ in range(6):
        logits = onnx.backend.step(token)
        token = int(processing(controls, [*PROMPT, root, *want]).apply_np(logits).argmax())
        want.append(token)
    assert chain == want


def test_sampled_draft_carries_the_processed_distribution(exported):  # noqa: F811
    target, ref, out = exported("moa", 2)
    onnx = OnnxDrafter.load(out)
    root, delta = opened(target, ref)
    controls = SamplingControls(temperature=0.8, min_p=0.05, presence_penalty=1.0, logit_bias={2: 2.0, 5: -100})
    proc = processing(controls, [*PROMPT, root])
    settings = dict(temperature=0.8, top_p=1.0, support=VOCAB, min_p=0.05, processing=proc)
    ref.begin(delta)
    _, want_ids, want_probs = ref.draft(root, 3, **settings, generator=torch.Generator().manual_seed(0))
    onnx.begin(delta)
    tokens, q_ids, q_probs = onnx.draft(root, 3, **settings, generator=0)
    # The first row does not depend on the draw: the processed distribution of the position after the root.
    onnx.begin(delta)
    p = probabilities_np(proc.apply_np(onnx.backend.step(root)), 0.8, min_p=0.05)
    kept = want_probs[0].numpy() > 0
    assert q_ids[0][kept].tolist() == want_ids[0][kept].tolist()
    np.testing.assert_allclose(q_probs[0], want_probs[0].numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(q_probs[0], p[q_ids[0]], rtol=1e-4, atol=1e-6)
    assert 5 not in tokens and all(q_probs[i][q_ids[i].tolist().index(5)] == 0 for i in range(3))


def test_a_sampled_draft_proposes_from_the_top_k_as_the_verifier_samples(exported):  # noqa: F811
    """top_k with the rest of the rule: each row of q has at most top_k tokens, the first row is the rule's
    distribution over the processed logits, and both drafters agree."""
    target, ref, out = exported("moa", 2)
    onnx = OnnxDrafter.load(out)
    root, delta = opened(target, ref)
    proc = processing(CONTROLS, [*PROMPT, root])
    settings = dict(temperature=1.5, top_p=0.99, top_k=2, support=VOCAB, min_p=0.01, processing=proc)
    ref.begin(delta)
    _, want_ids, want_probs = ref.draft(root, 4, **settings, generator=torch.Generator().manual_seed(0))
    onnx.begin(delta)
    tokens, q_ids, q_probs = onnx.draft(root, 4, **settings, generator=0)
    assert all((row > 0).sum() <= 2 for row in q_probs) and all((row > 0).sum() <= 2 for row in want_probs)
    assert all(t in q_ids[i][q_probs[i] > 0] for i, t in enumerate(tokens))  # drawn from the kept tokens
    onnx.begin(delta)
    p = probabilities_np(proc.apply_np(onnx.backend.step(root)), 1.5, 0.99, 2, 0.01)
    assert (p > 0).sum() == 2
    np.testing.assert_allclose(q_probs[0], p[q_ids[0]], rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(q_probs[0], want_probs[0].numpy(), rtol=1e-4, atol=1e-5)
