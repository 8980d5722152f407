"""The exported step's attention (tether.server.onnx_export.attend_split: committed rows read in place, never
concatenated) equals the reference MoDA attention over the concatenated rows, on awkward shapes: one and several
new rows, no committed rows, depth keys or none, GQA groups of 3 and 2, a random visibility over the committed rows
and a causal one over the new. And its RoPE, one matrix product a use, equals apply_rope; an export puts the
drafter's own rotation back."""

import pytest
import torch
from tiny_models import tiny_pair

from tether.server.onnx_export import attend_split, export_client_onnx, rope_matrices
from tether.shared.attention import moda_attention_reference
from tether.shared.model import apply_rope, rope_cos_sin


@pytest.mark.parametrize("T,P,Hq,Hkv,D,L", [(1, 37, 6, 2, 32, 0), (3, 5, 6, 2, 32, 2), (4, 0, 4, 2, 12, 0),
                                           (2, 19, 6, 2, 32, 3), (5, 63, 3, 1, 16, 1)])  # fmt: skip
def test_split_attention_equals_the_reference(T, P, Hq, Hkv, D, L):
    g = torch.Generator().manual_seed(T * 100 + P)

    def rand(*shape):
        return torch.randn(*shape, generator=g)

    q, new_k, new_v = rand(1, T, Hq, D), rand(1, T, Hkv, D), rand(1, T, Hkv, D)
    past_k, past_v = rand(1, P, Hkv, D), rand(1, P, Hkv, D)
    depth_k, depth_v = (rand(1, T, L, Hkv, D), rand(1, T, L, Hkv, D)) if L else (None, None)
    mask = torch.rand(T, P + T, generator=g) > 0.3
    mask[:, P:] = torch.tril(torch.ones(T, T, dtype=torch.bool))  # each new row sees itself: no empty row
    want = moda_attention_reference(q, torch.cat([past_k, new_k], 1), torch.cat([past_v, new_v], 1), depth_k,
                                    depth_v, scale=D**-0.5, tree_mask=mask)  # fmt: skip
    got = attend_split(q, past_k, past_v, new_k, new_v, mask, depth_k, depth_v, D**-0.5)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    every = attend_split(q, past_k, past_v, new_k, new_v, None, depth_k, depth_v, D**-0.5)  # no mask: every key
    want = moda_attention_reference(q, torch.cat([past_k, new_k], 1), torch.cat([past_v, new_v], 1), depth_k,
                                    depth_v, scale=D**-0.5, tree_mask=torch.ones_like(mask))  # fmt: skip
    torch.testing.assert_close(every, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("T,H,D", [(1, 6, 32), (5, 3, 12), (3, 4, 64)])
def test_rope_as_one_matrix_equals_apply_rope(T, H, D):
    """The step graph's RoPE (one product with rope_matrices) is apply_rope, at positions far apart."""
    g = torch.Generator().manual_seed(T * 10 + D)
    x = torch.randn(1, T, H, D, generator=g)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    cos, sin = rope_cos_sin(inv_freq, torch.tensor([[0, 7, 1023, 5, 64][:T]]))
    torch.testing.assert_close(x @ rope_matrices(cos, sin), apply_rope(x, cos, sin), rtol=1e-6, atol=1e-6)


def test_an_export_gives_back_the_drafters_own_rotation(tmp_path):
    """Exporting swaps the attention layers' rotation for the matrix one while it runs, then puts theirs back."""
    target, drafter = tiny_pair("moa", 7, 2)
    layers = [drafter.sa.attn, *(b.attn for b in drafter.tli_layers)]
    export_client_onnx(drafter, tmp_path)
    assert all("rotate" not in attn.__dict__ for attn in layers)
    x = torch.randn(1, 2, drafter.sa.attn.cfg.n_heads, drafter.sa.attn.cfg.head_dim)
    cos, sin = rope_cos_sin(drafter.inv_freq, torch.tensor([[3, 4]]))
    torch.testing.assert_close(drafter.sa.attn.rotate(x, cos, sin), apply_rope(x, cos, sin))
