"""The exported step's attention (tether.server.onnx_export.attend_split: committed rows read in place, never
concatenated) equals the reference MoDA attention over the concatenated rows, on awkward shapes: one and several
new rows, no committed rows, depth keys or none, GQA groups of 3 and 2, a random visibility over the committed rows
and a causal one over the new."""

import pytest
import torch

from tether.server.onnx_export import attend_split
from tether.shared.attention import moda_attention_reference


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
