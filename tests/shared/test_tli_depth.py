"""TLI with depth (tether.shared.tli_depth): with the target's true lower depth entries the TLI blocks compute the
target's own last layers; the predictor's shapes and rotation; where it is refused; it travels in the client part."""

import dataclasses

import pytest
import torch
from tiny_models import tiny_target

from tether.shared.drafter import DrafterConfig
from tether.shared.drafter_loading import build_drafter
from tether.shared.model import apply_rope
from tether.shared.tli_depth import DepthPredictor, depth_regression, lower_entries
from tether.shared.weights import build_client_part, client_part_tensors

SMALL = {"n_heads": 4, "n_kv_heads": 2, "head_dim": 12, "ffn_dim": 40, "lsa_ffn_dim": 24}


def moa(target, tli: int, tli_depth: int = 0):
    torch.manual_seed(3)
    return build_drafter(target, DrafterConfig(kind="moa", tli=tli, tli_depth=tli_depth, **SMALL)).eval()


@torch.no_grad()
def tli_at_drafted_positions(target, drafter, tokens, lower: str):
    """The drafter's TLI blocks at every position with exact inputs (the target's hidden entering TLI, its exact
    K/V of earlier positions): (their output, the target's own output there). `lower`: which lower depth entries
    the blocks see: "empty", "true" (the target's) or "predicted"."""
    L, N = target.cfg.n_layers, drafter.dcfg.tli
    out = target.run(tokens, hidden_layers=(L - N, L), return_kv=True, return_depth=True)
    T = tokens.shape[1]
    pos = torch.arange(T)
    cos, sin = target.rope(pos[None])
    mask = torch.cat([pos[None, :] < pos[:, None], torch.eye(T, dtype=torch.bool)], -1)  # earlier rows, then own
    if lower == "empty":
        given = (out.k.new_empty(*tokens.shape, 0, *out.k.shape[-2:]),) * 2  # zero entries
    elif lower == "true":
        E = lower_entries(target.cfg, N)
        given = (out.depth[0][:, :, :E], out.depth[1][:, :, :E])
    else:
        given = None  # the drafter's own predictor
    prefix = (out.k[L - N :], out.v[L - N :])
    h = drafter.run_tli(out.hidden[0], cos, sin, prefix=prefix, mask=mask, lower=given, tokens=tokens)
    return h, out.hidden[1]


def rel_err(a, b) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("norm", ["pre", "post"])
@pytest.mark.parametrize("tli", [1, 2])
def test_true_depth_entries_give_the_targets_own_layers(norm, tli):
    target = tiny_target(norm_position=norm).float()
    drafter = moa(target, tli)
    tokens = torch.randint(0, target.cfg.vocab_size, (2, 11), generator=torch.Generator().manual_seed(0))
    h, own = tli_at_drafted_positions(target, drafter, tokens, "true")
    assert rel_err(h, own) < 1e-5
    empty, _ = tli_at_drafted_positions(target, drafter, tokens, "empty")
    assert rel_err(empty, own) > 1e-2  # the gap the predictor is for


def test_plain_target_needs_no_depth():
    target = tiny_target(moda=False)
    drafter = moa(target, 1)
    tokens = torch.randint(0, target.cfg.vocab_size, (1, 9), generator=torch.Generator().manual_seed(1))
    h, own = tli_at_drafted_positions(target, drafter, tokens, "empty")
    assert rel_err(h, own) < 1e-5
    assert target.run(tokens, return_depth=True).depth is None


def test_predictor_shapes_and_rotation():
    target = tiny_target()  # dim 48, 3 layers, 2 KV heads of 12, FFN K/V: 2 entries a layer
    p = DepthPredictor(target.cfg, n_tli=1, width=7)
    B, T = 2, 5
    h = torch.randn(B, 1, target.cfg.dim).expand(B, T, -1)  # the same hidden and token at every position
    cos, sin = target.rope(torch.arange(3, 3 + T)[None])
    k, v = p(h, torch.randn(1, 1, target.cfg.dim).expand(B, T, -1), cos, sin)
    assert k.shape == v.shape == (B, T, 4, 2, 12)  # E = (3 - 1) * 2
    assert torch.allclose(v, v[:, :1].expand_as(v))  # V is position-free
    # K is rotated at its own position: a query of that position scores it the same everywhere.
    q = torch.randn(B, 1, 2, 12).expand(B, T, 2, 12)
    scores = torch.einsum("bthd,btehd->bteh", apply_rope(q, cos, sin), k)
    assert torch.allclose(scores, scores[:, :1].expand_as(scores), atol=1e-5)
    assert not torch.allclose(k[:, 0], k[:, 1])
    assert lower_entries(dataclasses.replace(target.cfg, moda_ffn_kv=False), 2) == 1


def test_where_a_predictor_is_refused():
    moda = tiny_target()
    with pytest.raises(ValueError, match="needs a MoDA target"):
        moa(tiny_target(moda=False), 1, tli_depth=8)
    with pytest.raises(ValueError, match="no depth entry is missing"):
        moa(moda, moda.cfg.n_layers, tli_depth=8)
    with pytest.raises(ValueError, match="TLI N >= 1"):
        DrafterConfig(kind="moa", tli=0, tli_depth=8)
    with pytest.raises(ValueError, match="TLI N >= 1"):
        DrafterConfig(kind="eagle", tli=1, tli_depth=8)
    with pytest.raises(ValueError, match=">= 0"):
        DrafterConfig(tli_depth=-1)


def test_config_dict_unchanged_while_off():
    assert "tli_depth" not in DrafterConfig(tli=3).to_dict()  # older configs and their fingerprints stay
    on = DrafterConfig(tli=3, tli_depth=16)
    assert DrafterConfig.from_dict(on.to_dict()) == on
    assert DrafterConfig.from_dict(DrafterConfig(tli=3).to_dict()).tli_depth == 0


def test_predicted_entries_reach_the_tli_blocks_and_the_client_part():
    target = tiny_target()
    drafter = moa(target, 1, tli_depth=16)
    with torch.no_grad():
        for p in drafter.depth_predictor.parameters():
            p.normal_(0, 0.3)
    tokens = torch.randint(0, target.cfg.vocab_size, (1, 8), generator=torch.Generator().manual_seed(2))
    predicted, _ = tli_at_drafted_positions(target, drafter, tokens, "predicted")
    empty, _ = tli_at_drafted_positions(target, drafter, tokens, "empty")
    assert rel_err(predicted, empty) > 1e-3
    tensors = client_part_tensors(target, drafter)
    assert {n for n in tensors if "depth_predictor" in n} == {
        "drafter.depth_predictor." + n for n, _ in drafter.depth_predictor.named_parameters()
    }
    _, client = build_client_part(target.cfg, drafter.dcfg, tensors)
    again, _ = tli_at_drafted_positions(target, client, tokens, "predicted")
    torch.testing.assert_close(again, predicted)


def test_regression_training_lowers_the_depth_loss():
    target = tiny_target()
    p = DepthPredictor(target.cfg, n_tli=1, width=32)
    opt = torch.optim.Adam(p.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(4)
    cos, sin = target.rope(torch.arange(16)[None])
    losses = []
    for _ in range(30):
        tokens = torch.randint(0, target.cfg.vocab_size, (4, 16), generator=gen)
        with torch.no_grad():
            out = target.run(tokens, hidden_layers=(2,), return_depth=True)
        E = p.n_entries
        pred = p(out.hidden[0], target.embed_tokens(tokens), cos, sin)
        loss = depth_regression(pred, (out.depth[0][:, :, :E], out.depth[1][:, :, :E]))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert sum(losses[-5:]) / 5 < 0.85 * sum(losses[:5]) / 5
