"""Fewer, larger kernels for a finished target: a transform applied after loading, as gpt-fast applies quantization.

A decode or verify step of a served model is a few tokens through every layer, so each layer's dozens of small
PyTorch kernels (RMSNorm alone is six: cast, square, mean, add, rsqrt, scale) cost more GPU time than its weights
take to read, even replayed from a CUDA graph. `fuse(model)` changes how the same weights are applied:
- q, k and v projections become one GEMM over a concatenated weight (and gate and up another); the original
  Linear modules keep working, their weights now views of the concatenated ones (no copy is kept);
- RMSNorm and RoPE each become one Triton kernel (tether.kernels.norm, tether.kernels.pointwise);
- every projection and the LM head of a step's few rows (<= 64) run tether.kernels.linear, which reads the weights
  at the HBM's pace and finishes in the same kernel: gate/up with SwiGLU's activation (SiLU x up), o_proj and
  down_proj with the residual add; more rows (a prefill) go to cuBLAS as before. MoDA's FFN depth K/V projection
  too: left to cuBLAS (or the CPU's BLAS, whose row-0 bits change with the row count from 1 to 2 on), a session's
  depth keys depended on how many rows shared its step.
Outputs equal the unfused model's within the kernels' tolerance (fp32 statistics, as the reference); the state
dict keys and shapes are unchanged.
A tensor-parallel shard is fused after sharding (`fuse(apply_tp(model, rank, world))`): o_proj and down_proj then
give this rank's partial sum, and rank 0 alone adds the residual (and a row-parallel bias) inside its GEMM, so
one all-reduce of the GEMMs' outputs yields the residual stream on every rank (tether.server.tp), inside a
captured step graph too.

    model = fuse(Transformer.from_pretrained(path, device="cuda", dtype=torch.bfloat16))
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from tether.kernels.linear import counters_needed, linear
from tether.kernels.norm import rms_norm
from tether.kernels.pointwise import rope
from tether.server.tp import all_reduce
from tether.shared.model import Attention, FeedForward, RMSNorm, Transformer


class FusedRMSNorm(RMSNorm):
    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)


class FusedAttention(Attention):
    qkv_weight: Tensor  # [(Hq + 2 Hkv) * D, dim]: q_proj, k_proj and v_proj's weights, which are views of it
    qkv_bias: Tensor | None
    counters: Tensor  # int32 split-K tile counters of this module's projections (tether.kernels.linear)

    def qkv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        B, T, _ = x.shape
        c = self.cfg
        h = linear(x, self.qkv_weight, self.qkv_bias, counters=self.counters)
        q, k, v = h.view(B, T, c.n_heads + 2 * c.n_kv_heads, c.head_dim).split(
            [c.n_heads, c.n_kv_heads, c.n_kv_heads], dim=2
        )  # views: the kernels read them strided
        return rope(q, cos, sin), rope(k, cos, sin), v

    def rotate(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        return rope(x, cos, sin)

    def add_output(self, o: Tensor, x: Tensor) -> Tensor:
        return linear(o, self.o_proj.weight, self.o_proj.bias, residual=x, counters=self.counters)


class ShardedAttention(FusedAttention):
    """FusedAttention of a tensor-parallel shard: o_proj's output is this rank's part of the residual stream."""

    tp_lead: bool  # rank 0: adds the residual and the bias, once for the group
    tp_group: object  # the shard's process group (None: the default one)

    def add_output(self, o: Tensor, x: Tensor) -> Tensor:
        return _reduced(self, o, self.o_proj, x)


class FusedFeedForward(FeedForward):
    gate_up_weight: Tensor  # [2 * ffn_dim, dim]: gate_proj and up_proj's weights, views of it
    counters: Tensor

    def forward(self, x: Tensor) -> Tensor:
        return linear(self._swiglu(x), self.down_proj.weight, counters=self.counters)

    def add_output(self, h: Tensor, x: Tensor) -> Tensor:
        return linear(self._swiglu(h), self.down_proj.weight, residual=x, counters=self.counters)

    def _swiglu(self, x: Tensor) -> Tensor:
        """silu(gate(x)) * up(x) from one GEMM over the concatenated weight."""
        return linear(x, self.gate_up_weight, gated=True, counters=self.counters)


class ShardedFeedForward(FusedFeedForward):
    """FusedFeedForward of a tensor-parallel shard: down_proj's output is this rank's partial sum."""

    tp_lead: bool
    tp_group: object

    def forward(self, x: Tensor) -> Tensor:
        return _reduced(self, self._swiglu(x), self.down_proj, None)

    def add_output(self, h: Tensor, x: Tensor) -> Tensor:
        return _reduced(self, self._swiglu(h), self.down_proj, x)


def _reduced(m: ShardedAttention | ShardedFeedForward, x: Tensor, proj: nn.Linear, residual: Tensor | None) -> Tensor:
    """residual + proj(x) over the group: every rank's partial GEMM, the lead's with the residual and the bias
    (apply_tp moved it to `tp_bias`, out of the partial sums), then one all-reduce (sum)."""
    lead = m.tp_lead
    y = linear(x, proj.weight, proj.tp_bias if lead else None, residual=residual if lead else None, counters=m.counters)
    return all_reduce(y, m.tp_group)


class FusedLinear(nn.Linear):
    """A Linear through tether.kernels.linear: one tiling whatever the row count (batch-invariant up to its
    MAX_ROWS), where cuBLAS picks kernels by the row count."""

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)


class FusedTransformer(Transformer):
    def head(self, h: Tensor) -> Tensor:
        return linear(h, self.head_weight)


def _concat(linears: list[nn.Linear], attr: str) -> Tensor | None:
    """One buffer holding the linears' `attr` tensors end to end; each Linear's parameter becomes a view of it."""
    parts = [getattr(lin, attr) for lin in linears]
    if parts[0] is None:
        return None
    whole = torch.cat([p.detach() for p in parts])
    at = 0
    for lin, p in zip(linears, parts, strict=True):
        setattr(lin, attr, nn.Parameter(whole[at : at + p.shape[0]], requires_grad=False))
        at += p.shape[0]
    return whole


def _swap(module: nn.Module, cls: type) -> None:
    # The same object, with the fused forward: parameters, hooks and the module tree stay as they are.
    module.__class__ = cls


def _counters(module: nn.Module, like: Tensor, widths: list[int]) -> None:
    # One buffer serves the module's projections: they run one after another and each leaves it zeroed.
    n = max(counters_needed(w) for w in widths)
    module.register_buffer("counters", torch.zeros(n, dtype=torch.int32, device=like.device), persistent=False)


@torch.no_grad()
def fuse(model: Transformer) -> Transformer:
    """Fuse the model in place (see the module docstring) and return it."""
    rank, world = model.tp
    for block in model.layers:
        a, f = block.attn, block.ffn
        a.qkv_weight = _concat([a.q_proj, a.k_proj, a.v_proj], "weight")
        a.qkv_bias = _concat([a.q_proj, a.k_proj, a.v_proj], "bias")
        _counters(a, a.qkv_weight, [a.qkv_weight.shape[0], a.o_proj.weight.shape[0]])
        f.gate_up_weight = _concat([f.gate_proj, f.up_proj], "weight")
        _counters(f, f.gate_up_weight, [f.gate_proj.weight.shape[0], f.down_proj.weight.shape[0]])
        if world > 1:
            for m in (a, f):
                m.tp_lead, m.tp_group = rank == 0, model.tp_group
            _swap(a, ShardedAttention)
            _swap(f, ShardedFeedForward)
        else:
            _swap(a, FusedAttention)
            _swap(f, FusedFeedForward)
        for norm in (block.attn_norm, block.ffn_norm):
            _swap(norm, FusedRMSNorm)
        if block.cfg.moda_ffn_kv:  # the block has an ffn_kv_proj exactly then
            _swap(block.ffn_kv_proj, FusedLinear)
    for norm in (model.norm, model.embed_norm):
        if norm is not None:
            _swap(norm, FusedRMSNorm)
    _swap(model, FusedTransformer)
    return model


def is_fused(model: Transformer) -> bool:
    return bool(model.layers) and isinstance(model.layers[0].attn, FusedAttention)
