"""The target LLM: a Llama-style decoder with Mixture-of-Depths Attention (MoDA).

RMSNorm, RoPE (Hugging Face's rotate-half layout), GQA, SwiGLU; pre-norm or post-norm. With `moda` on,
each block's attention also sees the K/V its own token wrote at every earlier block (its attention K/V and,
with `moda_ffn_kv`, a K/V projected from each FFN's input), under the same softmax (tether.shared.attention).
With `moda` off it is a plain Llama/Qwen2 and loads their Hugging Face checkpoints (tether.shared.checkpoint).

Forward modes, all through `run`:
- full sequence (training):  `model(ids)` -> logits [B, T, V]
- prefill into a KV cache:   `model.prefill(ids, cache)` commits all T positions
- verify k new tokens:       `model.verify(ids, cache, tree_mask=..., positions=...)` writes them as pending;
                             the caller commits with cache.advance / cache.accept
Each returns a ForwardOutput (tether.shared.contracts): logits, the per-layer K/V of the new positions, and
requested hidden states.

    from tether.shared.model import Transformer
    model = Transformer.from_pretrained("deploy/models/target")
    logits = model(torch.tensor([[1, 2, 3]]))  # [1, 3, vocab]
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tether.shared.attention import get_backend
from tether.shared.checkpoint import load_weights, read_config, save_model
from tether.shared.config import ModelConfig
from tether.shared.contracts import ForwardCache, ForwardOutput, SequenceCache
from tether.shared.kv_cache import KVCache
from tether.shared.logits_processing import SamplingControls


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # fp32 statistics, cast back before the weight: bit-compatible with Hugging Face's LlamaRMSNorm.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_frequencies(cfg: ModelConfig) -> Tensor:
    """Inverse frequencies [D/2] on the default device, with Llama-3 style long-context scaling when the config
    asks for it. Computed on the CPU and then moved: arithmetic on the meta device (where loaders build models)
    imports torch's decompositions and dynamo on first use, ~2 s a process."""
    return _rope_frequencies(cfg).to(torch.get_default_device())


def _rope_frequencies(cfg: ModelConfig) -> Tensor:
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64, device="cpu") / cfg.head_dim))
    if not cfg.rope_scaling:
        return inv.float()
    sc = dict(cfg.rope_scaling)
    kind = sc.get("rope_type", sc.get("type", "default"))
    if kind == "default":
        return inv.float()
    if kind != "llama3":
        raise ValueError(f"unsupported rope scaling {kind!r} (supported: default, llama3)")
    factor, lo, hi = float(sc["factor"]), float(sc["low_freq_factor"]), float(sc["high_freq_factor"])
    old_len = float(sc["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_len / lo, inv / factor, inv)
    smooth = (old_len / wavelen - lo) / (hi - lo)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen >= old_len / hi) & (wavelen <= old_len / lo)
    return torch.where(is_mid, mid, scaled).float()


def rope_cos_sin(inv_freq: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
    """positions [B or 1, T] -> cos, sin [B or 1, T, 1, D] in fp32."""
    ang = positions.to(torch.float32)[..., None] * inv_freq  # [B, T, D/2]
    ang = torch.cat([ang, ang], dim=-1)[:, :, None, :]
    return ang.cos(), ang.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [B, T, H, D]; cos/sin [B or 1, T, 1, D]. Rotate-half layout (first and second halves pair up)."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


class DepthStream:
    """The per-token depth K/V that blocks write for the blocks after them, position-major [B, T, L, Hkv, D].

    Under autograd the entries are kept in a list and stacked per read (in-place writes into a buffer would
    invalidate tensors saved for backward); without it they go into one preallocated buffer, which is the
    layout the Triton kernels read, and each read is a free view.
    """

    def __init__(self, like: Tensor, capacity: int, grad: bool):
        self.grad = grad
        self.entries: list[tuple[Tensor, Tensor]] = []
        self.n = 0
        if not grad and capacity:
            B, T, H, D = like.shape
            self.k = like.new_empty(B, T, capacity, H, D)
            self.v = like.new_empty(B, T, capacity, H, D)
        self.capacity = capacity

    def append(self, k: Tensor, v: Tensor) -> None:
        if self.n >= self.capacity:
            return  # written by the last block: nobody reads it
        if self.grad:
            self.entries.append((k, v))
        else:
            self.k[:, :, self.n] = k
            self.v[:, :, self.n] = v
        self.n += 1

    def read(self) -> tuple[Tensor | None, Tensor | None]:
        if self.n == 0:
            return None, None
        if self.grad:
            return torch.stack([e[0] for e in self.entries], 2), torch.stack([e[1] for e in self.entries], 2)
        return self.k[:, :, : self.n], self.v[:, :, : self.n]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.q_proj = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=cfg.o_bias)

    def qkv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        B, T, _ = x.shape
        c = self.cfg
        q = self.q_proj(x).view(B, T, c.n_heads, c.head_dim)
        k = self.k_proj(x).view(B, T, c.n_kv_heads, c.head_dim)
        v = self.v_proj(x).view(B, T, c.n_kv_heads, c.head_dim)
        return self.rotate(q, cos, sin), self.rotate(k, cos, sin), v

    def rotate(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """RoPE at the tokens' positions: x [B, T, H, D] (a seam: the server's fused transform swaps kernels in)."""
        return apply_rope(x, cos, sin)

    def add_output(self, o: Tensor, x: Tensor) -> Tensor:
        """The residual stream after attention: x + o_proj(o), o [B, T, Hq * D], x [B, T, dim] (a seam: the fused
        transform adds inside the projection's kernel)."""
        return x + self.o_proj(o)


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.up_proj = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def add_output(self, h: Tensor, x: Tensor) -> Tensor:
        """The residual stream after the FFN: x + ffn(h), h and x [B, T, dim] (a seam, as Attention.add_output)."""
        return x + self(h)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__()
        self.cfg, self.index = cfg, index
        self.attn = Attention(cfg)
        self.ffn = FeedForward(cfg)
        # Pre-norm: normalise each sublayer's input. Post-norm: normalise each residual sum.
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        if cfg.moda_ffn_kv:
            self.ffn_kv_proj = nn.Linear(cfg.dim, 2 * cfg.n_kv_heads * cfg.head_dim, bias=False)

    def forward(
        self,
        x: Tensor,  # [B, T, dim]
        cos: Tensor,
        sin: Tensor,
        depth: DepthStream,
        cache: ForwardCache | None,
        cache_layer: int,
        tree_mask: Tensor | None,
        backend: str,
        prefix_kv: tuple[Tensor, Tensor] | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """One block over new tokens. Keys are the cache's rows plus the new ones, or `prefix_kv` rows
        [B, S, Hkv, D] plus the new ones (drafter training feeds the target's exact K/V that way).

        A cache that attends in place (its `attend(layer, q, k, v, depth_k, depth_v, *, scale, tree_mask)` returns
        the output, e.g. the server's paged pool read by a paged kernel; tether.shared.contracts.ForwardCache) stores
        the new K/V and computes the attention itself, with the backend's contract; no keys are gathered for it."""
        c, pre = self.cfg, self.cfg.norm_position == "pre"
        h = self.attn_norm(x) if pre else x
        q, k, v = self.attn.qkv(h, cos, sin)  # [B, T, H, D]
        depth_k, depth_v = depth.read()
        o = None
        if cache is not None:  # every ForwardCache answers: None unless it attends in place
            o = cache.attend(cache_layer, q, k, v, depth_k, depth_v, scale=c.head_dim**-0.5, tree_mask=tree_mask)
        if o is None:
            if cache is not None:
                keys, vals = cache.write(cache_layer, k, v)
            elif prefix_kv is not None:
                keys, vals = torch.cat([prefix_kv[0], k], 1), torch.cat([prefix_kv[1], v], 1)
            else:
                keys, vals = k, v
            o = get_backend(backend)(q, keys, vals, depth_k, depth_v, scale=c.head_dim**-0.5, tree_mask=tree_mask)
        if c.moda:
            depth.append(k, v)
        x = self.attn.add_output(o.flatten(2), x)
        if not pre:
            x = self.attn_norm(x)
        h = self.ffn_norm(x) if pre else x
        if c.moda_ffn_kv:
            B, T, _ = h.shape
            fk, fv = self.ffn_kv_proj(h).view(B, T, 2, c.n_kv_heads, c.head_dim).unbind(2)
            # RoPE at the token's own position keeps depth keys in the same space as the sequence keys
            # (a same-position score is rotation invariant, so this costs no expressiveness).
            depth.append(self.attn.rotate(fk, cos, sin), fv)
        x = self.ffn.add_output(h, x)
        if not pre:
            x = self.ffn_norm(x)
        return x, k, v


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, *, backend: str = "reference"):
        super().__init__()
        self.cfg = cfg
        self.backend = backend  # attention backend name (tether.shared.attention registry)
        self.tp = (0, 1)  # (rank, world size) of a tensor-parallel shard (tether.server.tp.apply_tp sets it)
        self.tp_group = None  # its process group (None: the default one)
        # Built on the meta device (a loader assigns every tensor afterwards), nothing is initialised: the first
        # normal_ on meta tensors costs ~2 s a process (torch imports its Python decompositions and dynamo on first
        # use), and every server, client and command that loads a checkpoint builds on meta.
        on_meta = torch.get_default_device().type == "meta"
        empty = torch.empty(cfg.vocab_size, cfg.dim) if on_meta else None
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim, _weight=empty)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        # Post-norm blocks feed their attention the raw residual stream, so the embeddings are normalised first
        # (as BERT's embedding LayerNorm does); raw 0.02-scale embeddings would leave block 0's attention scores
        # ~2500x smaller than every other block's and stall early training. Pre-norm normalises inside the block.
        self.embed_norm = RMSNorm(cfg.dim, cfg.norm_eps) if cfg.norm_position == "post" else None
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = None if cfg.tied_embeddings else nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_frequencies(cfg), persistent=False)  # [D/2]
        if not on_meta:
            self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        """Pre-norm (GPT-2 style): every matrix N(0, 0.02), residual output projections shrunk with depth.
        The stream then stays near the embeddings' tiny scale and the final norm amplifies what blocks add.
        Post-norm renormalises the stream to RMS 1 after every sublayer, so 0.02-scale sublayers would barely
        move it (measured: block gradients ~30x smaller than pre-norm's and a long unigram plateau); there
        every block matrix gets fan-in scaling, N(0, 1/fan_in), so each sublayer's output is O(1) as well."""
        post = self.cfg.norm_position == "post"
        for name, p in self.named_parameters():
            if p.dim() < 2:
                if name.endswith("bias"):
                    nn.init.zeros_(p)
                else:
                    nn.init.ones_(p)
            elif post and name.startswith("layers."):
                nn.init.normal_(p, std=p.shape[1] ** -0.5)
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                nn.init.normal_(p, std=std / math.sqrt(2 * self.cfg.n_layers))
            else:
                nn.init.normal_(p, std=std)

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The weights' dtype: what a KV pool for this model holds."""
        return self.embed_tokens.weight.dtype

    def rope(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        return rope_cos_sin(self.inv_freq, positions)

    @property
    def head_weight(self) -> Tensor:
        """The LM head's weight [vocab, dim]: the embeddings when they are tied."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def head(self, h: Tensor) -> Tensor:
        return F.linear(h, self.head_weight)

    def run(
        self,
        input_ids: Tensor,
        *,
        cache: ForwardCache | None = None,
        positions: Tensor | None = None,
        tree_mask: Tensor | None = None,
        hidden_layers: Sequence[int] = (),
        return_kv: bool = False,
        last_only: bool = False,
        return_depth: bool = False,
    ) -> ForwardOutput:
        """One forward over new tokens `input_ids` [B, T].

        cache: KV cache whose committed rows every new token sees; the new K/V are written as pending rows.
        positions: RoPE positions [T] or [B, T]; default cache.length + arange(T) (tree tokens pass depths).
            Checked against max_seq_len only when on the CPU: this method never reads the device back, so a
            step over device tensors can be captured in a CUDA graph (tether.server.step).
        tree_mask: [T, T] or [B, T, T] bool visibility among the new tokens; default causal.
        hidden_layers: indices into the residual-stream states, Hugging Face style: 0 is the stream entering
            block 0 (the embeddings; normalised first in post-norm),
            i the output of block i-1, n_layers the last block's output (before the final norm).
        last_only: compute logits for the last position only (prefill).
        return_depth: also return the depth stream's entries (drafter training regresses them); they are the
            stream the blocks read anyway, so asking costs nothing.
        """
        B, T = input_ids.shape
        start = 0 if cache is None else cache.length
        if positions is None:
            if start + T > self.cfg.max_seq_len:
                raise ValueError(f"position {start + T - 1} exceeds max_seq_len {self.cfg.max_seq_len}")
            positions = torch.arange(start, start + T, device=input_ids.device)
        elif positions.device.type == "cpu" and int(positions.max()) >= self.cfg.max_seq_len:
            # Positions already on an accelerator are the caller's to bound (a KV capacity <= max_seq_len does):
            # reading them back would stall the host on every step and cannot be captured in a CUDA graph.
            raise ValueError(f"position {int(positions.max())} exceeds max_seq_len {self.cfg.max_seq_len}")
        positions = positions.view(-1, T)
        cos, sin = self.rope(positions)
        x = self.embed_tokens(input_ids)
        if self.embed_norm is not None:
            x = self.embed_norm(x)
        n = self.cfg.n_layers
        want = sorted({i % (n + 1) for i in hidden_layers})
        saved: dict[int, Tensor] = {0: x} if 0 in want else {}
        depth = DepthStream(
            x.new_empty(B, T, self.cfg.n_kv_heads, self.cfg.head_dim),
            self.cfg.depth_len(n - 1),
            grad=torch.is_grad_enabled(),
        )
        ks, vs = [], []
        for i, block in enumerate(self.layers):
            x, k, v = block(x, cos, sin, depth, cache, i, tree_mask, self.backend)
            if return_kv:
                ks.append(k)
                vs.append(v)
            if i + 1 in want:
                saved[i + 1] = x
        h = self.norm(x)
        logits = self.head(h[:, -1:] if last_only else h)
        return ForwardOutput(
            logits=logits,
            k=torch.stack(ks) if return_kv else None,
            v=torch.stack(vs) if return_kv else None,
            hidden=tuple(saved[i % (n + 1)] for i in hidden_layers),
            depth=depth.read() if return_depth and depth.n else None,
        )

    def forward(self, input_ids: Tensor) -> Tensor:
        """Full-sequence forward: input ids [B, T] -> logits [B, T, vocab]."""
        return self.run(input_ids).logits

    def prefill(self, input_ids: Tensor, cache: SequenceCache, **kw) -> ForwardOutput:
        out = self.run(input_ids, cache=cache, **kw)
        cache.advance(input_ids.shape[1])
        return out

    def verify(self, input_ids: Tensor, cache: SequenceCache, **kw) -> ForwardOutput:
        """Score k new tokens against the cache; their K/V stay pending until the caller commits."""
        return self.run(input_ids, cache=cache, **kw)

    def new_cache(self, batch_size: int = 1, capacity: int | None = None) -> KVCache:
        return KVCache(self.cfg, batch_size, capacity, device=self.device, dtype=self.dtype)

    @torch.inference_mode()
    def generate(
        self,
        input_ids: Tensor,
        max_new_tokens: int,
        *,
        temperature: float = 0.0,
        top_p: float = 1.0,
        eos_id: int | None = None,
        generator: torch.Generator | None = None,
        controls: SamplingControls | None = None,
        stop_ids: Collection[int] = (),
    ):
        """Plain autoregressive decoding through the KV cache; yields one token id at a time (batch 1), the last one
        a token of `stop_ids` or `eos_id` when one comes. `controls` (tether.shared.logits_processing) instead of
        temperature / top_p is the whole rule: each step's logits processed with the sequence so far (the reference
        the speculative paths equal)."""
        from tether.shared.sampling import sample_token

        if input_ids.shape[0] != 1:
            raise ValueError("generate decodes one sequence at a time")
        if controls is None:
            controls = SamplingControls(temperature, top_p)
        elif (temperature, top_p) != (0.0, 1.0):
            raise TypeError("give the sampling rule as controls or as temperature / top_p, not both")
        controls.check_vocab(self.cfg.vocab_size)
        stops = frozenset(stop_ids) | ({eos_id} if eos_id is not None else set())
        sequence = input_ids[0].tolist()  # what the penalties count: the prompt, then each token
        prompt_len = len(sequence)
        total = input_ids.shape[1] + max_new_tokens
        cache = self.new_cache(1, min(total, self.cfg.max_seq_len))
        logits = self.prefill(input_ids, cache, last_only=True).logits[:, -1]
        for _ in range(max_new_tokens):
            row = logits[0]
            processing = controls.processing(sequence, prompt_len, self.cfg.vocab_size)
            if processing is not None:
                row = torch.from_numpy(processing.apply_np(row.float().cpu().numpy()))
            token = sample_token(
                row,
                temperature=controls.temperature,
                top_p=controls.top_p,
                top_k=controls.top_k,
                min_p=controls.min_p,
                generator=generator,
            )
            yield token
            sequence.append(token)
            if token in stops or cache.length >= cache.capacity:
                return
            ids = torch.tensor([[token]], device=input_ids.device)
            logits = self.prefill(ids, cache).logits[:, -1]

    @classmethod
    def from_pretrained(cls, path: str | Path, *, device: str | torch.device = "cpu", dtype=None) -> Transformer:
        """The model a checkpoint folder holds (tether.shared.checkpoint: ours, or a Hugging Face Llama / Mistral /
        Qwen2 one); an int8 one dequantized into `dtype` (default: the dtype it was saved from)."""
        cfg = read_config(path)
        with torch.device("meta"):
            model = cls(cfg)
        load_weights(model, path, dtype)
        model.inv_freq = rope_frequencies(cfg)  # the buffer was made on the meta device
        if dtype is not None:
            model = model.to(dtype)
            model.inv_freq = model.inv_freq.float()
        return model.to(device).eval()

    def save_pretrained(self, path: str | Path, *, dtype: torch.dtype | None = None) -> None:
        save_model(self, path, dtype=dtype)
