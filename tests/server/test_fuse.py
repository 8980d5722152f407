"""The fusing transform (tether.server.fuse): the same function of the same weights, in fewer kernels.

On the CPU the Triton kernels run under the interpreter (TRITON_INTERPRET=1, as `make test` sets)."""

import copy

import pytest
import torch
from tiny_models import tiny_moa_drafter, tiny_target

import tether.shared.attention as attention
from tether.kernels.moda import moda_backend
from tether.kernels.utils import interpreting
from tether.server.engine import SpeculativeEngine
from tether.server.fuse import FusedAttention, fuse, is_fused

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = [
    pytest.mark.heavy,
    pytest.mark.skipif(DEV == "cpu" and not interpreting(), reason="the kernels need CUDA or TRITON_INTERPRET"),
]


@pytest.mark.parametrize("norm_position", ["pre", "post"])
@pytest.mark.parametrize("moda", [True, False])
def test_fused_model_computes_what_the_model_computes(norm_position, moda):
    plain = tiny_target(vocab_size=37, norm_position=norm_position, moda=moda, moda_ffn_kv=moda).to(DEV)
    fused = fuse(copy.deepcopy(plain))
    assert is_fused(fused) and not is_fused(plain)
    ids = torch.randint(37, (2, 13), generator=torch.Generator().manual_seed(0)).to(DEV)
    with torch.inference_mode():
        want = plain.run(ids, hidden_layers=(plain.cfg.n_layers,), return_kv=True)
        got = fused.run(ids, hidden_layers=(fused.cfg.n_layers,), return_kv=True)
    for g, w in ((got.logits, want.logits), (got.k, want.k), (got.v, want.v), (got.hidden[0], want.hidden[0])):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_fusing_keeps_the_weights_and_copies_nothing():
    plain = tiny_target(qkv_bias=True)
    fused = fuse(copy.deepcopy(plain))
    want, got = plain.state_dict(), fused.state_dict()
    assert list(want) == list(got)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0)
    a = fused.layers[0].attn
    assert isinstance(a, FusedAttention)
    whole = a.qkv_weight
    for lin in (a.q_proj, a.k_proj, a.v_proj):  # views of the fused weight: one copy of the weights in memory
        assert lin.weight.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr()
    assert (
        a.qkv_bias is not None and a.q_proj.bias.untyped_storage().data_ptr() == a.qkv_bias.untyped_storage().data_ptr()
    )
    f = fused.layers[0].ffn
    assert f.gate_proj.weight.untyped_storage().data_ptr() == f.gate_up_weight.untyped_storage().data_ptr()


def test_fused_target_speculative_greedy_equals_plain_greedy(monkeypatch):
    """Greedy speculative decoding through the fused target on the "triton" backend (paged steps) gives exactly
    plain greedy decoding of the unfused reference model."""
    monkeypatch.setitem(attention._BACKENDS, "triton", moda_backend)
    plain = tiny_target(vocab_size=37).to(DEV)
    fused = fuse(copy.deepcopy(plain))
    fused.backend = "triton"
    prompt = [5, 9, 11, 3, 30]
    want = list(plain.generate(torch.tensor([prompt], device=DEV), 12))
    got = [t for c in SpeculativeEngine(fused, tiny_moa_drafter(fused).to(DEV), k=3).generate(prompt, 12) for t in c]
    assert got == want
