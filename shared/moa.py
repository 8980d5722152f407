"""The Mixture-of-Attentions (MoA) drafter, split between server and client (docs/ARCHITECTURE.md, section 3).

Server part:
- LSA, layer self-attention: for each verified token, one decoder layer runs bidirectionally across the L
  layers of that token's target K/V (concat K,V per layer, RoPE position = layer index), then mean over
  layers and a linear map to the model width: one context vector per verified token.
Client part:
- SA, self-attention: one causal decoder layer over the target's (frozen) token embeddings, own KV cache;
- CA, cross-attention: queries from SA, keys/values from the LSA vectors of verified tokens (plus a learned
  null slot, so a position with nothing verified yet still has something to attend to);
- TLI(N): the CA output goes through the target's last N layers (frozen, real weights) whose KV cache holds
  the target's exact K/V for verified positions, then the final norm and LM head. N=0: straight to the head.
  On a MoDA target those blocks also attend to the depth entries of the layers below them, which a drafted
  position lacks; with `tli_depth` > 0 a small MLP predicts them from the CA output and the token's embedding
  (tether.shared.tli_depth), otherwise the first TLI block sees none.

Alignment: the drafter's output at position t predicts token t+1, like the target's. During drafting, the
positions after the last verified one see the target only through LSA vectors and TLI K/V of verified
positions; training reproduces that with block-bounded verification points (tether.server.train.drafter).

    drafter = MoADrafter(target, DrafterConfig(kind="moa", tli=1))
    delta = drafter.server_delta(states, start=0, tokens=prompt)   # server
    drafter.begin(delta)                                           # client
    tokens, q_ids, q_probs = drafter.draft(root_token, k=5)
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from tether.shared.attention import moda_attention_reference
from tether.shared.config import ModelConfig
from tether.shared.drafter import DraftDelta, DrafterConfig, TargetStates, layer_config
from tether.shared.drafter_runtime import DrafterBase
from tether.shared.kv_cache import KVCache
from tether.shared.model import Block, DepthStream, FeedForward, RMSNorm, Transformer, apply_rope, rope_cos_sin
from tether.shared.model import rope_frequencies as rope_freqs
from tether.shared.tli_depth import DepthPredictor, check_tli_depth

# Tokens per LSA computation in a server step (MoADrafter.lsa_rows), by where it runs. On a GPU a chunk costs its
# ~40 small kernels whatever its size up to far past this (a step of 64 rows x 8 tokens took 32 chunks of 16, most of
# its 5.1 ms on an H100); on a CPU it costs its arithmetic, which padding a round's few tokens to 128 would multiply.
LSA_CHUNK = {"cuda": 128}
LSA_CHUNK_ELSEWHERE = 16


class LayerSelfAttention(nn.Module):
    """LSA: [L, N, Hkv, D] K and V of N tokens -> [N, dim] context vectors (server side)."""

    def __init__(self, target: ModelConfig, dcfg: DrafterConfig):
        super().__init__()
        width = 2 * target.n_kv_heads * target.head_dim
        if width % dcfg.lsa_heads:
            raise ValueError(f"LSA width {width} is not divisible by lsa_heads={dcfg.lsa_heads}")
        self.cfg = layer_config(
            target, width, dcfg.lsa_heads, dcfg.lsa_kv_heads, width // dcfg.lsa_heads, dcfg.lsa_ffn_dim
        )
        self.block = Block(self.cfg, 0)
        self.proj = nn.Linear(width, target.dim, bias=True)
        self.register_buffer("inv_freq", rope_freqs(self.cfg), persistent=False)

    def forward(self, k: Tensor, v: Tensor) -> Tensor:
        L, N = k.shape[0], k.shape[1]
        x = torch.cat([k.permute(1, 0, 2, 3).reshape(N, L, -1), v.permute(1, 0, 2, 3).reshape(N, L, -1)], -1)
        cos, sin = rope_cos_sin(self.inv_freq, torch.arange(L, device=k.device)[None])
        everywhere = torch.ones(L, L, dtype=torch.bool, device=k.device)  # bidirectional across layers
        x, _, _ = self.block(x, cos, sin, DepthStream(x, 0, grad=False), None, 0, everywhere, "reference")
        return self.proj(x.mean(1))  # [N, dim]


class CrossAttention(nn.Module):
    """CA: SA outputs attend to context vectors of verified tokens; a pre-norm layer with its own MLP."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.q_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.ctx_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.q_proj = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        self.null_k = nn.Parameter(torch.zeros(cfg.n_kv_heads, cfg.head_dim))
        self.null_v = nn.Parameter(torch.zeros(cfg.n_kv_heads, cfg.head_dim))
        self.ffn = FeedForward(cfg)

    def context_kv(self, ctx: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """ctx [B, S, dim] at their own positions -> K (RoPE'd), V [B, S, Hkv, D]; cached by the client."""
        B, S, _ = ctx.shape
        h = self.ctx_norm(ctx)
        k = self.k_proj(h).view(B, S, self.cfg.n_kv_heads, self.cfg.head_dim)
        v = self.v_proj(h).view(B, S, self.cfg.n_kv_heads, self.cfg.head_dim)
        return apply_rope(k, cos, sin), v

    def forward(self, x: Tensor, ctx_k: Tensor, ctx_v: Tensor, visible: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """x [B, T, dim]; ctx_k/v [B, S, Hkv, D]; visible [T, S] or [B, T, S] bool; cos/sin of x's positions."""
        B, T, _ = x.shape
        c = self.cfg
        q = apply_rope(self.q_proj(self.q_norm(x)).view(B, T, c.n_heads, c.head_dim), cos, sin)
        keys = torch.cat([self.null_k.expand(B, 1, -1, -1).to(ctx_k.dtype), ctx_k], 1)  # [B, 1 + S, Hkv, D]
        vals = torch.cat([self.null_v.expand(B, 1, -1, -1).to(ctx_v.dtype), ctx_v], 1)
        null = torch.ones(*visible.shape[:-1], 1, dtype=torch.bool, device=visible.device)
        o = moda_attention_reference(q, keys, vals, scale=c.head_dim**-0.5, tree_mask=torch.cat([null, visible], -1))
        x = x + self.o_proj(o.flatten(2))
        return x + self.ffn(self.ffn_norm(x))


class MoADrafter(DrafterBase):
    def __init__(self, target: Transformer, dcfg: DrafterConfig):
        super().__init__(target, dcfg)
        t = target.cfg
        if not 0 <= dcfg.tli <= t.n_layers:
            raise ValueError(f"TLI N={dcfg.tli} must lie in [0, {t.n_layers}]")
        check_tli_depth(t, dcfg.kind, dcfg.tli, dcfg.tli_depth)
        self.lsa = LayerSelfAttention(t, dcfg)
        self.layer_cfg = layer_config(t, t.dim, dcfg.n_heads, dcfg.n_kv_heads, dcfg.head_dim, dcfg.ffn_dim)
        self.sa = Block(self.layer_cfg, 0)
        self.ca = CrossAttention(self.layer_cfg)
        self.register_buffer("inv_freq", rope_freqs(self.layer_cfg), persistent=False)
        self.depth_predictor = DepthPredictor(t, dcfg.tli, dcfg.tli_depth) if dcfg.tli_depth else None

    @property
    def tli_layers(self) -> list[Block]:
        n = self.dcfg.tli
        return list(self.target.layers[len(self.target.layers) - n :]) if n else []

    def tli_depth_stream(
        self, x: Tensor, cos: Tensor, sin: Tensor, lower=None, *, tokens: Tensor | None = None, grad: bool
    ) -> DepthStream:
        """The depth stream the TLI blocks start from at x's positions [B, T, dim], cos/sin the target's RoPE there:
        pre-filled with `lower`, the entries of the target's layers below TLI (K, V [B, T, E, Hkv, D]), or when
        None with the depth predictor's entries from x and `tokens` [B, T] (the ids at those positions), or none
        without a predictor; room after them for what the TLI blocks write."""
        t = self.target.cfg
        if lower is None and self.depth_predictor is not None:
            if tokens is None:
                raise ValueError("the depth predictor needs the tokens at the TLI positions")
            lower = self.depth_predictor(x, self.target.embed_tokens(tokens).detach(), cos, sin)
        n_lower = 0 if lower is None else lower[0].shape[2]
        room = n_lower + max(0, self.dcfg.tli - 1) * t.depth_per_layer
        depth = DepthStream(x.new_empty(*x.shape[:2], t.n_kv_heads, t.head_dim), room, grad=grad)
        for e in range(n_lower):
            depth.append(lower[0][:, :, e], lower[1][:, :, e])
        return depth

    def run_tli(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        *,
        cache: KVCache | None = None,
        prefix=None,
        mask=None,
        lower=None,
        tokens: Tensor | None = None,
    ) -> Tensor:
        """The target's last N blocks on x [B, T, dim] (`tokens` [B, T]: the ids there). Their depth attention sees
        the lower layers' entries as tli_depth_stream gives them (`lower`: given ones, e.g. the target's own, or
        zero-sized for none), then the TLI-written ones."""
        depth = self.tli_depth_stream(x, cos, sin, lower, tokens=tokens, grad=torch.is_grad_enabled())
        for i, block in enumerate(self.tli_layers):
            pkv = None if prefix is None else (prefix[0][i], prefix[1][i])
            x, _, _ = block(x, cos, sin, depth, cache, i, mask, self.target.backend, prefix_kv=pkv)
        return x

    # ---- server side -------------------------------------------------------------------------------

    def lsa_rows(self, k: Tensor, v: Tensor) -> Tensor:
        """LSA of N tokens' [L, N, Hkv, D] K/V -> [N, dim], in fixed chunks of LSA_CHUNK tokens (the last one padded
        with zeros): every chunk is the same computation whatever N is, so a token's vector does not depend on the
        other tokens of a server step, their number or its place among them (batch invariance, issue #44; one
        matrix product over all N rows may be tiled and reduced otherwise for another N)."""
        N, chunk = k.shape[1], LSA_CHUNK.get(k.device.type, LSA_CHUNK_ELSEWHERE)
        pad = -N % chunk
        if pad:
            k, v = (torch.cat([t, t.new_zeros(t.shape[0], pad, *t.shape[2:])], 1) for t in (k, v))
        return torch.cat([self.lsa(k[:, i : i + chunk], v[:, i : i + chunk]) for i in range(0, N + pad, chunk)])[:N]

    def server_delta(self, states: TargetStates, start: int, tokens: list[int]) -> DraftDelta:
        n = self.dcfg.tli
        L = states.k.shape[0]
        return DraftDelta(
            start=start,
            tokens=list(tokens),
            tensors={
                "lsa": self.lsa_rows(states.k, states.v),  # [N, dim]
                "tli_k": states.k[L - n :],  # [N, n, Hkv, D]
                "tli_v": states.v[L - n :],
            },
        )

    # ---- training: every position at once --------------------------------------------------------

    def forward_train(
        self, tokens: Tensor, k_all: Tensor, v_all: Tensor, boundary: Tensor, sa_mask: Tensor | None = None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """tokens [B, T]; k_all/v_all [L, B, T, Hkv, D] from the frozen target; boundary [B, T] long: position
        t's drafter sees the target's states of positions < boundary[b, t] only (the last verification point).
        sa_mask [B, T, T] optionally restricts SA (the staircase curriculum). Returns logits [B, T, V], the CA
        output and the TLI output (features for the regression losses), each [B, T, dim]."""
        B, T = tokens.shape
        L = k_all.shape[0]
        ctx = self.lsa(k_all.flatten(1, 2), v_all.flatten(1, 2)).view(B, T, -1)  # [B, T, dim]
        pos = torch.arange(T, device=tokens.device)[None]
        cos, sin = rope_cos_sin(self.inv_freq, pos)
        x = self.target.embed_tokens(tokens).detach()
        x, _, _ = self.sa(x, cos, sin, DepthStream(x, 0, grad=True), None, 0, sa_mask, "reference")
        ctx_k, ctx_v = self.ca.context_kv(ctx, cos, sin)
        visible = pos[0][None, None, :] < boundary[:, :, None]  # [B, T(query), T(context)]
        ca_out = self.ca(x, ctx_k, ctx_v, visible, cos, sin)
        h = ca_out
        if self.dcfg.tli:
            tcos, tsin = self.target.rope(pos)
            own = pos[0][None, None, :] >= boundary[:, :, None]
            own &= pos[0][None, None, :] <= pos[0][None, :, None]
            mask = torch.cat([visible, own], -1)  # [B, T, 2T]: exact target rows, then the drafter's own
            prefix = (k_all[L - self.dcfg.tli :], v_all[L - self.dcfg.tli :])
            h = self.run_tli(ca_out, tcos, tsin, prefix=prefix, mask=mask, tokens=tokens)
        return self.target.head(self.target.norm(h)), ca_out, h

    # ---- client side -------------------------------------------------------------------------------

    def _reset(self, capacity: int) -> None:
        dev, dt = self.device, self.dtype
        self.sa_cache = KVCache(self.layer_cfg, 1, capacity, device=dev, dtype=dt)
        self.tli_cache = KVCache(self.target.cfg, 1, capacity, device=dev, dtype=dt, layers=self.dcfg.tli)
        c = self.layer_cfg
        self.ctx_k = torch.zeros(1, capacity, c.n_kv_heads, c.head_dim, device=dev, dtype=dt)
        self.ctx_v = torch.zeros_like(self.ctx_k)
        self.n_ctx = 0

    def _adopt(self, delta: DraftDelta, keep: bool = False) -> None:
        """Take the verified states of positions [delta.start, delta.start + n) into the caches; `keep`: the rows
        held after them stay as drafted (tether.shared.drafter_runtime)."""
        P, n = delta.start, delta.n
        pos = torch.arange(P, P + n, device=self.device)[None]
        cos, sin = rope_cos_sin(self.inv_freq, pos)
        ctx = delta.tensors["lsa"].to(self.dtype)[None]
        k, v = self.ca.context_kv(ctx, cos, sin)
        if self.n_ctx != P:
            raise ValueError(f"delta starts at {P} but {self.n_ctx} positions are verified")
        self.ctx_k[:, P : P + n], self.ctx_v[:, P : P + n] = k, v
        self.n_ctx = P + n
        if self.dcfg.tli:
            tli_k, tli_v = (delta.tensors[name][:, None].to(self.dtype) for name in ("tli_k", "tli_v"))
            if keep:  # the server's exact K/V replace the drafted rows there; the rows after them stay
                self.tli_cache.overwrite(P, tli_k, tli_v)
            else:
                self.tli_cache.truncate(P)
                self.tli_cache.append(tli_k, tli_v)
        if keep:
            # The drafted rows after the delta stay. Its positions' SA rows are computed again, as after
            # discard_drafts() and a commit, so that verified rows do not depend on how they were drafted.
            held = self.sa_cache.length
            self.sa_cache.truncate(P)
            self._sa(torch.tensor([delta.tokens], device=self.device))
            self.sa_cache.length = held  # _sa wrote rows [P, P + n) only: those after them are still in the buffer
            return
        # SA depends on tokens alone, so after a chain its rows for accepted drafts stay valid; fill what is
        # missing (after a tree the drafted rows were dropped, and every verified token is fed again).
        self.sa_cache.truncate(min(self.sa_cache.length, P + n))
        missing = delta.tokens[self.sa_cache.length - P :]
        if missing:
            self._sa(torch.tensor([missing], device=self.device))

    def _drop_drafted(self, rows: int) -> None:
        self.sa_cache.truncate(rows)
        if self.dcfg.tli:
            self.tli_cache.truncate(rows)

    def _tree_step(self, tokens: Tensor, positions: Tensor, mask: Tensor, parent_rows: list) -> Tensor:
        pos = positions[None]
        cos, sin = rope_cos_sin(self.inv_freq, pos)
        x = self.target.embed_tokens(tokens[None])
        x, _, _ = self.sa(x, cos, sin, DepthStream(x, 0, grad=False), self.sa_cache, 0, mask, "reference")
        self.sa_cache.advance(len(tokens))
        visible = torch.ones(len(tokens), self.n_ctx, dtype=torch.bool, device=self.device)
        h = self.ca(x, self.ctx_k[:, : self.n_ctx], self.ctx_v[:, : self.n_ctx], visible, cos, sin)
        if self.dcfg.tli:
            tcos, tsin = self.target.rope(pos)
            h = self.run_tli(h, tcos, tsin, cache=self.tli_cache, mask=mask, tokens=tokens[None])
            self.tli_cache.advance(len(tokens))
        return self.target.head(self.target.norm(h))[0]

    def _sa(self, ids: Tensor) -> Tensor:
        start = self.sa_cache.length
        pos = torch.arange(start, start + ids.shape[1], device=self.device)[None]
        cos, sin = rope_cos_sin(self.inv_freq, pos)
        x = self.target.embed_tokens(ids)
        x, _, _ = self.sa(x, cos, sin, DepthStream(x, 0, grad=False), self.sa_cache, 0, None, "reference")
        self.sa_cache.advance(ids.shape[1])
        return x

    def _step(self, token: int) -> Tensor:
        """One drafting step at the next position: SA -> CA -> TLI -> head. Returns logits [V]."""
        pos_i = self.sa_cache.length
        x = self._sa(torch.tensor([[token]], device=self.device))
        pos = torch.tensor([[pos_i]], device=self.device)
        cos, sin = rope_cos_sin(self.inv_freq, pos)
        visible = torch.ones(1, self.n_ctx, dtype=torch.bool, device=self.device)
        h = self.ca(x, self.ctx_k[:, : self.n_ctx], self.ctx_v[:, : self.n_ctx], visible, cos, sin)
        if self.dcfg.tli:
            tcos, tsin = self.target.rope(pos)
            h = self.run_tli(h, tcos, tsin, cache=self.tli_cache, tokens=torch.tensor([[token]], device=self.device))
            self.tli_cache.advance(1)
        return self.target.head(self.target.norm(h))[0, -1]

    def _feed(self, tokens: list[int]) -> Tensor:
        """Known tokens in one causal forward: SA, CA and TLI see tokens and earlier rows only, so it computes the
        rows that one step per token would, in one call instead of len(tokens)."""
        base, T = self.sa_cache.length, len(tokens)
        mask = torch.ones(T, base + T, dtype=torch.bool, device=self.device)
        mask[:, base:] = torch.ones(T, T, dtype=torch.bool, device=self.device).tril()
        ids = torch.tensor(tokens, device=self.device)
        positions = torch.arange(base, base + T, device=self.device)
        return self._tree_step(ids, positions, mask, [])[-1]

    def verified_length(self) -> int:
        return self.n_ctx

    def held_rows(self) -> int:
        return self.sa_cache.length
