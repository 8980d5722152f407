"""The EAGLE-style baseline drafter: every comparison with MoA is against this, in the same framework.

One decoder layer over [token embedding ; previous feature] (a linear map from 2*dim to dim first), predicting
the target's next last-layer feature, read out through the target's final norm and LM head. At position t the
input is (embedding of token t, feature at t-1): the exact target feature where t-1 is verified, the drafter's
own prediction while drafting. Its MLP is sized so the trainable budget matches the MoA drafter's.

The server's delta for EAGLE is one hidden state per verified token; the client re-runs its layer over the
accepted positions with those exact features, so its cache never keeps a drafted feature.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from tether.shared.config import ModelConfig
from tether.shared.drafter import DraftDelta, DrafterConfig, TargetStates, layer_config
from tether.shared.drafter_runtime import DrafterBase
from tether.shared.kv_cache import KVCache
from tether.shared.model import Block, DepthStream, RMSNorm, Transformer, rope_cos_sin
from tether.shared.model import rope_frequencies as rope_freqs


def moa_trainable_params(target: ModelConfig, dcfg: DrafterConfig) -> int:
    from tether.shared.moa import CrossAttention, LayerSelfAttention

    cfg = layer_config(target, target.dim, dcfg.n_heads, dcfg.n_kv_heads, dcfg.head_dim, dcfg.ffn_dim)
    with torch.device("meta"):
        parts = [LayerSelfAttention(target, dcfg), Block(cfg, 0), CrossAttention(cfg)]
    return sum(p.numel() for m in parts for p in m.parameters())


def matched_ffn_dim(target: ModelConfig, dcfg: DrafterConfig) -> int:
    """The SwiGLU width that gives EAGLE (fc + one layer + feature norm) MoA's trainable parameter count."""
    d = target.dim
    attn = d * dcfg.head_dim * (2 * dcfg.n_heads + 2 * dcfg.n_kv_heads)
    fixed = 2 * d * d + d + attn + 3 * d  # fc (with bias), attention, three norms
    return max(8, round((moa_trainable_params(target, dcfg) - fixed) / (3 * d)))


class EagleDrafter(DrafterBase):
    def __init__(self, target: Transformer, dcfg: DrafterConfig):
        super().__init__(target, dcfg)
        t = target.cfg
        ffn = dcfg.eagle_ffn_dim or matched_ffn_dim(t, dcfg)
        self.layer_cfg = layer_config(t, t.dim, dcfg.n_heads, dcfg.n_kv_heads, dcfg.head_dim, ffn)
        # The target's pre-norm stream grows with depth; normalising the feature keeps the fc input in range.
        self.feat_norm = RMSNorm(t.dim, t.norm_eps)
        self.fc = nn.Linear(2 * t.dim, t.dim, bias=True)
        self.layer = Block(self.layer_cfg, 0)
        self.register_buffer("inv_freq", rope_freqs(self.layer_cfg), persistent=False)
        self.depth_predictor = None  # MoA's TLI depth predictor (tether.shared.tli_depth): EAGLE runs no TLI

    def server_delta(self, states: TargetStates, start: int, tokens: list[int]) -> DraftDelta:
        return DraftDelta(start=start, tokens=list(tokens), tensors={"hidden": states.hidden})

    def _layer(self, tokens: Tensor, prev_feat: Tensor, cache: KVCache | None, start: int = 0) -> Tensor:
        """tokens [B, T], prev_feat [B, T, dim] (feature of the position before each) -> predicted features."""
        pos = torch.arange(start, start + tokens.shape[1], device=tokens.device)[None]
        cos, sin = rope_cos_sin(self.inv_freq, pos)
        x = self.fc(torch.cat([self.target.embed_tokens(tokens).detach(), self.feat_norm(prev_feat)], -1))
        depth = DepthStream(x, 0, grad=torch.is_grad_enabled())
        x, _, _ = self.layer(x, cos, sin, depth, cache, 0, None, "reference")
        return x

    def forward_train(self, tokens: Tensor, hidden: Tensor) -> tuple[Tensor, Tensor]:
        """tokens [B, T]; hidden [B, T, dim] the target's features (teacher forcing, noise added by the
        trainer). Returns logits [B, T, V] and predicted features [B, T, dim] (aligned with `hidden`)."""
        prev = torch.cat([torch.zeros_like(hidden[:, :1]), hidden[:, :-1]], 1)
        feat = self._layer(tokens, prev, None)
        return self.target.head(self.target.norm(feat)), feat

    def _reset(self, capacity: int) -> None:
        self.cache = KVCache(self.layer_cfg, 1, capacity, device=self.device, dtype=self.dtype)
        self.last_feat = torch.zeros(1, 1, self.target.cfg.dim, device=self.device, dtype=self.dtype)
        self.prev_feat = self.last_feat
        self.n_verified = 0

    def _adopt(self, delta: DraftDelta, keep: bool = False) -> None:
        """Re-run the layer over the verified tokens with the exact features, so no drafted feature stays in their
        rows; `keep`: the rows held after them stay as drafted (over the drafted features), and drafting goes on
        from the feature their chain predicted."""
        P = delta.start
        if self.n_verified != P:
            raise ValueError(f"delta starts at {P} but {self.n_verified} positions are verified")
        feats = delta.tensors["hidden"].to(self.dtype)[None]  # [1, n, dim]
        held, going_on = self.cache.length, self.prev_feat
        self.cache.truncate(P)
        prev = torch.cat([self.last_feat, feats[:, :-1]], 1)
        self._layer(torch.tensor([delta.tokens], device=self.device), prev, self.cache, P)
        self.cache.advance(delta.n)
        self.last_feat = feats[:, -1:]
        self.prev_feat = self.last_feat
        self.n_verified = P + delta.n
        if keep:  # the layer wrote rows [P, P + n) only: those after them are still in the buffer
            self.cache.length, self.prev_feat = held, going_on

    def _drop_drafted(self, rows: int) -> None:
        self.cache.truncate(rows)

    def held_rows(self) -> int:
        return self.cache.length

    def _tree_step(self, tokens: Tensor, positions: Tensor, mask: Tensor, parent_rows: list) -> Tensor:
        if not parent_rows or parent_rows[0] is None:
            self.row_feat = []  # a new tree: features of drafted rows, by row offset
            # The root follows the verified text, whose last feature is exact, or a chain drafted ahead, whose last
            # step predicted the feature the next token goes with (as _step would use).
            self.root_feat = self.last_feat if self.cache.length == self.n_verified else self.prev_feat
        prev = torch.cat([self.root_feat[0] if r is None else self.row_feat[r] for r in parent_rows])[None]
        x = self.fc(torch.cat([self.target.embed_tokens(tokens[None]), self.feat_norm(prev)], -1))
        cos, sin = rope_cos_sin(self.inv_freq, positions[None])
        feat, _, _ = self.layer(x, cos, sin, DepthStream(x, 0, grad=False), self.cache, 0, mask, "reference")
        self.cache.advance(len(tokens))
        self.row_feat += list(feat[0].split(1))
        return self.target.head(self.target.norm(feat))[0]

    def _step(self, token: int) -> Tensor:
        start = self.cache.length
        if start == self.n_verified:
            self.prev_feat = self.last_feat  # a new round starts from the last exact feature
        feat = self._layer(torch.tensor([[token]], device=self.device), self.prev_feat, self.cache, start)
        self.cache.advance(1)
        self.prev_feat = feat
        return self.target.head(self.target.norm(feat))[0, -1]

    def verified_length(self) -> int:
        return self.n_verified
