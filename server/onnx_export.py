"""Export the edge client's drafting step to ONNX, for the onnxruntime drafter (tether.client.onnx_drafter).

Only the client part is exported (docs/ARCHITECTURE.md section 3; LSA stays on the server). The caches never live inside
a graph: each call takes the committed cache rows as inputs and returns the new rows, so the runtime keeps the
caches as numpy buffers and rolls drafted rows back by keeping a shorter length.

- MoA: `context.onnx` turns a delta's LSA vectors into CA keys/values; `step.onnx` runs T new tokens through
  SA -> CA -> TLI(N) -> final norm -> LM head (with `tli_depth`, the depth predictor feeding TLI is in it too).
  Adopting the server's exact TLI K/V is an array copy (numpy).
- EAGLE: `step.onnx` runs fc -> layer -> final norm -> LM head over (token, previous feature) pairs.
- The attention layers (MoA: SA, CA, TLI; EAGLE: its layer) read the committed rows in place (`attend_split`):
  no concatenation or transpose of a cache inside the graph, whose copy at every draft step made a step's time
  grow with context. They apply RoPE as one matrix product a use (`rope_matrices`), built once per graph: a step
  is hundreds of small nodes, and onnxruntime's cost per node is much of its time on a CPU.

Graph contract (fp32, batch 1; T new tokens, P committed cache rows, S verified context rows, R logit rows;
Hs/Ds: the drafter's own KV heads/width, Hkv/D: the target's):
  step.onnx, MoA
    in   tokens int64 [1, T], positions int64 [1, T] (RoPE positions of the new tokens),
         mask bool [T, P + T] (row i sees key j: the committed rows, then the new ones; SA and TLI share it),
         logit_rows int64 [R] (which new rows get logits; R = 0 when only the cache rows are wanted),
         sa_k, sa_v [1, P, Hs, Ds], ctx_k, ctx_v [1, S, Hs, Ds], then tli_k.i, tli_v.i [1, P, Hkv, D] for i < N
    out  logits [1, R, V], sa_k_new, sa_v_new [1, T, Hs, Ds], then tli_k_new.i, tli_v_new.i [1, T, Hkv, D]
  context.onnx, MoA
    in   lsa [1, n, dim], positions int64 [1, n]      out  ctx_k, ctx_v [1, n, Hs, Ds]
  step.onnx, EAGLE
    in   tokens, positions, mask, logit_rows (as above), prev_feat [1, T, dim], k, v [1, P, Hs, Ds]
    out  logits [1, R, V], feat [1, T, dim], k_new, v_new [1, T, Hs, Ds]
`onnx_drafter.json` beside the graphs holds the format version, the drafter kind and config, the shapes the
runtime allocates, and per graph its file, sha256, input and output names in order, and signature
(name -> [dtype, shape], dynamic axes named as above).

`split_weights(graph_bytes, location)` takes a written graph's weight matrices out of it: every fp32 initializer of
two or more dimensions becomes an external reference (ONNX's external-data form, pointing at `location`) and is
returned as a numpy array, so they can travel in another file and another precision (tether.server.client_export);
onnxruntime is then given them by name (SessionOptions.add_external_initializers). The graph is edited without
the `onnx` package: a message class built at run time knows the few ONNX fields touched
(tether.shared.onnx_subset) and protobuf keeps every other field as it was.

Exporter: torch.onnx.export's TorchScript exporter (dynamo=False); the dynamo exporter needs onnxscript. The
TorchScript one imports the `onnx` package only to splice onnxscript custom functions into the model, which
these graphs do not use, so when `onnx` is missing that step is skipped (see _skip_onnxscript_step).

    from tether.server.onnx_export import export_client_onnx
    export_client_onnx(load_drafter("deploy/models/drafter", target), "build/onnx-drafter")

    python -m tether.server.onnx_export --target deploy/models/target --drafter deploy/models/drafter \\
        --out build/onnx-drafter

Tests: tests/client/test_onnx_backend.py, tests/server/test_client_export.py.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import hashlib
import json
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from tether.shared.model import DepthStream, rope_cos_sin, rope_frequencies
from tether.shared.onnx_subset import ONNX_EXTERNAL, ONNX_FLOAT, onnx_model_class
from tether.shared.weights import onnx_graph_io

FORMAT_VERSION = 1
MANIFEST = "onnx_drafter.json"
OPSET = 17


def attend_split(
    q: Tensor,  # [1, T, Hq, D]
    past_k: Tensor,  # [1, P, Hkv, D] committed rows, in the cache's own layout
    past_v: Tensor,
    new_k: Tensor,  # [1, T', Hkv, D] rows the graph computed (T' = T, or CA's one null key)
    new_v: Tensor,
    mask: Tensor | None,  # [T, P + T'] bool: row i sees key j (committed rows, then new ones); None: every key
    depth_k: Tensor | None,  # [1, T, L, Hkv, D] each query's own depth keys (MoDA), or None
    depth_v: Tensor | None,
    scale: float,
) -> Tensor:
    """MoDA attention of the new rows over committed rows, new rows and depth keys, as
    tether.shared.attention.moda_attention_reference computes it over their concatenation, without copying the
    committed rows: a graph that concatenates them, or lets Einsum transpose them, copies the whole cache at every
    draft step (its cost grew with context). The committed rows are read in place by two MatMuls, the query
    spread block-diagonally over the KV heads so K and V need no transpose (the off-diagonal products are zero
    and thrown away: Hkv times the FLOPs of the head-wise product, a few thousand per row); the softmax runs over
    the scores of all three parts at once. Returns [1, T, Hq, D].

    A step graph is hundreds of small nodes, so onnxruntime's cost per node sets a draft step's time on a CPU: the
    mask comes whole (one per graph, not sliced and joined again in every layer), and the KV heads and depth entries
    are Python ints, constants in the graph. Read from a shape they would be traced as shape arithmetic run at every
    call, which onnxruntime cannot fold while P is free. Hq and D stay traced: as constants they kept onnxruntime
    from folding T in a one-token session (tether.client.onnx_derived)."""
    _, T, Hq, D = q.shape
    Hkv = int(past_k.shape[2])
    G = Hq // Hkv
    eye = torch.eye(Hkv, dtype=q.dtype)  # [Hkv (the key's head), Hkv (the query's)]
    qh = q.reshape(T, Hkv, G, D)  # B = 1: no Gather of the batch row (a node a call)
    # qb[h, d, h', g, t] = q[t, h', g, d] where h == h', else 0: [Hkv * D, Hkv * G * T]
    qb = (qh.permute(1, 3, 2, 0)[:, :, None] * eye[:, None, :, None, None]).reshape(Hkv * D, Hkv * G * T)
    s_past = (past_k.reshape(-1, Hkv * D) @ qb).transpose(0, 1).reshape(Hkv, G, T, -1)  # [Hkv, G, T, P]
    # Einsums sum over the batch axis (B = 1) rather than index it: indexing is a Gather node at every call.
    s_new = torch.einsum("qhgd,bkhd->hgqk", qh, new_k)  # [Hkv, G, T, T']
    parts = [s_past, s_new]
    L = int(depth_k.shape[2]) if depth_k is not None else 0  # depth entries a query sees
    if depth_k is not None:
        parts.append(torch.einsum("qhgd,bqlhd->hgql", qh, depth_k))  # [Hkv, G, T, L]
    s = torch.cat(parts, -1).float() * scale
    if mask is not None:
        if depth_k is not None:  # a query sees all its depth keys
            mask = torch.cat([mask, torch.ones(T, L, dtype=torch.bool)], -1)
        s = s.masked_fill(~mask, float("-inf"))
    p = s.softmax(-1).to(q.dtype)
    # The parts are sliced from the end: P is free in every session, so bounds counted from it are shape arithmetic
    # at every call, while T' and L are fixed in a one-token session, which onnxruntime then folds.
    tail = new_k.shape[1] + L  # T' + L
    p_past, p_new = p[..., :-tail], p[..., -tail : (-L if L else None)]
    # o[h, g, t, h', d] = sum_p p[h, g, t, p] v[p, h', d]; keep h == h'.
    o = (p_past.reshape(Hkv * G * T, -1) @ past_v.reshape(-1, Hkv * D)).reshape(Hkv, G, T, Hkv, D)
    o = (o * eye[:, None, None, :, None]).sum(3)  # [Hkv, G, T, D]
    o = o + torch.einsum("hgqk,bkhd->hgqd", p_new, new_v)
    if depth_k is not None:
        o = o + torch.einsum("hgql,bqlhd->hgqd", p[..., -L:], depth_v)
    return o.permute(2, 0, 1, 3).reshape(1, T, Hq, D)


class _Committed:
    """The committed rows of one attention layer, as a cache that attends in place (Block.forward's hook): the
    step graph's SA and TLI blocks attend through attend_split instead of concatenating the rows."""

    length = 0

    def __init__(self, k: Tensor, v: Tensor):
        self.k, self.v = k, v  # [1, P, Hkv, D]

    def attend(self, layer, q, k, v, depth_k, depth_v, *, scale: float, tree_mask: Tensor) -> Tensor:
        dk = depth_k if depth_k is not None and depth_k.shape[2] > 0 else None
        return attend_split(q, self.k, self.v, k, v, tree_mask, dk, None if dk is None else depth_v, scale)


def rope_matrices(cos: Tensor, sin: Tensor) -> Tensor:
    """cos, sin [1, T, 1, D] (tether.shared.model.rope_cos_sin) -> [1, T, D, D]: RoPE at each position as one
    matrix, x @ M = apply_rope(x, cos, sin) for x [1, T, H, D]. In a step graph apply_rope is six nodes (split, negate,
    join, two products, a sum) at each of its uses; the matrix is one product there, built once per graph: M[t] =
    diag(cos[t]) + R diag(sin[t]), R the rotate-half permutation with its signs (x @ R = cat(-x2, x1)). Each column
    of M holds two non-zeros, so the product adds the same two terms apply_rope adds."""
    D = int(cos.shape[-1])
    h = D // 2
    rot = torch.zeros(D, D, dtype=cos.dtype)
    rot[:h, h:] = torch.eye(h)  # input i < h feeds output i + h
    rot[h:, :h] = -torch.eye(h)  # input i >= h feeds output i - h, negated
    return torch.eye(D, dtype=cos.dtype) * cos + rot * sin  # [1, T, D, D]: the rows broadcast over cos's size-1 axis


class _MatrixRope:
    """Attention.rotate for the step graph: the product with the matrices its forward set (rope_matrices)."""

    def __init__(self):
        self.m: Tensor | None = None  # [1, T, D, D]

    def __call__(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        return x @ self.m  # [1, T, H, D]


@contextlib.contextmanager
def _rotating_by(ropes: Sequence[tuple[nn.Module, _MatrixRope]]) -> Iterator[None]:
    """Give each attention module its matrix rotation for as long as the export runs; then put back what it had
    (a caller's drafter may be the one exported when it is already fp32 on the CPU)."""
    saved = [(attn, attn.__dict__.get("rotate")) for attn, _ in ropes]
    for attn, rope in ropes:
        attn.rotate = rope
    try:
        yield
    finally:
        for attn, before in saved:
            if before is None:
                del attn.rotate
            else:
                attn.rotate = before


def _cross_attention(ca, x: Tensor, ctx_k: Tensor, ctx_v: Tensor, rope: Tensor) -> Tensor:
    """tether.shared.moa.CrossAttention.forward for a step (every context row visible), its null key attended
    beside the context rows instead of concatenated before them; `rope` the RoPE matrices (rope_matrices)."""
    B, T, _ = x.shape
    c = ca.cfg
    q = ca.q_proj(ca.q_norm(x)).view(B, T, c.n_heads, c.head_dim) @ rope
    o = attend_split(q, ctx_k, ctx_v, ca.null_k[None, None], ca.null_v[None, None], None, None, None, c.head_dim**-0.5)
    x = x + ca.o_proj(o.flatten(2))
    return x + ca.ffn(ca.ffn_norm(x))


class _MoAStep(nn.Module):
    """T new tokens through SA -> CA -> TLI -> norm -> head, the caches passed in and the new rows out. Export it
    inside `rotating()`: its attention layers then apply RoPE as one matrix product (rope_matrices)."""

    def __init__(self, drafter):
        super().__init__()
        self.drafter, self.target = drafter, drafter.target
        self.n_tli = drafter.dcfg.tli
        # Fresh fp32 frequencies: a drafter cast to bf16 also cast its inv_freq buffers.
        self.register_buffer("inv_freq", rope_frequencies(drafter.layer_cfg), persistent=False)
        self.register_buffer("tli_inv_freq", rope_frequencies(drafter.target.cfg), persistent=False)
        self.rope, self.tli_rope = _MatrixRope(), _MatrixRope()

    def rotating(self) -> contextlib.AbstractContextManager:
        ropes = [(self.drafter.sa.attn, self.rope)] + [(b.attn, self.tli_rope) for b in self.drafter.tli_layers]
        return _rotating_by(ropes)

    def forward(self, tokens, positions, mask, logit_rows, sa_k, sa_v, ctx_k, ctx_v, *tli_kv):
        d, t = self.drafter, self.target
        cos, sin = rope_cos_sin(self.inv_freq, positions)
        self.rope.m = rope_matrices(cos, sin)
        x = t.embed_tokens(tokens)  # [1, T, dim]
        x, sk, sv = d.sa(x, cos, sin, DepthStream(x, 0, grad=True), _Committed(sa_k, sa_v), 0, mask, "reference")
        h = _cross_attention(d.ca, x, ctx_k, ctx_v, self.rope.m)  # CA sees every verified row
        new_tli = []
        if self.n_tli:
            tcos, tsin = rope_cos_sin(self.tli_inv_freq, positions)
            self.tli_rope.m = rope_matrices(tcos, tsin)
            # As MoADrafter.run_tli (its depth predictor, if any, is in the graph); grad=True picks DepthStream's
            # list form, which traces without in-place writes.
            depth = d.tli_depth_stream(h, tcos, tsin, tokens=tokens, grad=True)
            for i, block in enumerate(d.tli_layers):
                past = _Committed(tli_kv[2 * i], tli_kv[2 * i + 1])
                h, k, v = block(h, tcos, tsin, depth, past, 0, mask, "reference")
                new_tli += [k, v]
        h = h.index_select(1, logit_rows)  # [1, R, dim]
        return (t.head(t.norm(h)), sk, sv, *new_tli)


class _MoAContext(nn.Module):
    """LSA vectors of verified positions -> the CA keys (RoPE'd at their positions) and values."""

    def __init__(self, drafter):
        super().__init__()
        self.ca = drafter.ca
        self.register_buffer("inv_freq", rope_frequencies(drafter.layer_cfg), persistent=False)

    def forward(self, lsa: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        cos, sin = rope_cos_sin(self.inv_freq, positions)
        return self.ca.context_kv(lsa, cos, sin)


class _EagleStep(nn.Module):
    """T new (token, previous feature) pairs through fc -> layer -> norm -> head, the cache passed in; exported
    inside `rotating()`, as _MoAStep."""

    def __init__(self, drafter):
        super().__init__()
        self.drafter, self.target = drafter, drafter.target
        self.register_buffer("inv_freq", rope_frequencies(drafter.layer_cfg), persistent=False)
        self.rope = _MatrixRope()

    def rotating(self) -> contextlib.AbstractContextManager:
        return _rotating_by([(self.drafter.layer.attn, self.rope)])

    def forward(self, tokens, positions, mask, logit_rows, prev_feat, k, v):
        d, t = self.drafter, self.target
        cos, sin = rope_cos_sin(self.inv_freq, positions)
        self.rope.m = rope_matrices(cos, sin)
        x = d.fc(torch.cat([t.embed_tokens(tokens), d.feat_norm(prev_feat)], -1))
        feat, nk, nv = d.layer(x, cos, sin, DepthStream(x, 0, grad=True), _Committed(k, v), 0, mask, "reference")
        return t.head(t.norm(feat.index_select(1, logit_rows))), feat, nk, nv


@contextlib.contextmanager
def _skip_onnxscript_step() -> Iterator[None]:
    """Without the `onnx` package, make the TorchScript exporter's onnxscript-function splice a no-op.

    That step (torch.onnx ... onnx_proto_utils._add_onnxscript_fn) parses the finished model with `onnx` only
    to append custom onnxscript functions; graphs made of standard ops, like ours, come out byte-identical.
    With `onnx` installed nothing is patched."""
    try:
        import onnx  # noqa: F401
    except ImportError:
        pass
    else:
        yield
        return
    from torch.onnx._internal.torchscript_exporter import onnx_proto_utils as opu

    original = opu._add_onnxscript_fn
    opu._add_onnxscript_fn = lambda model_bytes, custom_opsets: model_bytes
    try:
        yield
    finally:
        opu._add_onnxscript_fn = original


def _export(module: nn.Module, args: tuple, path: Path, inputs: list[str], outputs: list[str], axes: dict) -> dict:
    """Write one graph; returns its manifest entry with the signature: name -> [dtype, shape with named axes]."""
    with _skip_onnxscript_step(), warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation and tracer warnings
        results = module(*args)
        torch.onnx.export(
            module,
            args,
            str(path),
            dynamo=False,
            opset_version=OPSET,
            input_names=inputs,
            output_names=outputs,
            dynamic_axes={name: axes[name] for name in inputs + outputs if name in axes},
            # Folding would store the LM head's transposed copy of the tied embeddings beside the embeddings
            # (+30% file size); onnxruntime folds it in memory when it loads the graph instead.
            do_constant_folding=False,
        )
    signature = {
        name: [str(t.dtype).removeprefix("torch."), [axes.get(name, {}).get(i, n) for i, n in enumerate(t.shape)]]
        for name, t in zip(inputs + outputs, [*args, *results], strict=True)
    }
    return {"file": path.name, "inputs": inputs, "outputs": outputs, "signature": signature}


def _fp32_cpu(drafter):
    """The drafter (and its target) in fp32 on the CPU; a copy when a cast is needed, so the caller's stays put."""
    # A paired client's target has its unused layers on the meta device (never materialised): ignore them.
    params = [p for p in (*drafter.parameters(), *drafter.target.parameters()) if p.device.type != "meta"]
    if all(p.dtype == torch.float32 and p.device.type == "cpu" for p in params):
        return drafter
    drafter = copy.deepcopy(drafter)  # copies the target too: the drafter holds it as a plain attribute
    drafter.target.to("cpu", torch.float32)
    return drafter.to("cpu", torch.float32)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _dummy_step_inputs(T: int, P: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """tokens, positions, mask, logit_rows for tracing T new tokens after P cache rows."""
    mask = torch.ones(T, P + T, dtype=torch.bool)
    mask[:, P:] = torch.ones(T, T, dtype=torch.bool).tril()
    return torch.arange(1, T + 1)[None], torch.arange(P, P + T)[None], mask, torch.tensor([0, T - 1])


def export_client_onnx(drafter, out_dir: str | Path) -> dict:
    """Export `drafter`'s client part (MoA or EAGLE, with its target attached) to `out_dir`.

    Writes the graphs and onnx_drafter.json (module docstring) and returns that manifest. Weights are exported
    in fp32 whatever the drafter's dtype (a cast copy is made when needed)."""
    drafter = _fp32_cpu(drafter).eval()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dcfg, tcfg, lcfg = drafter.dcfg, drafter.target.cfg, drafter.layer_cfg
    hs, ds = lcfg.n_kv_heads, lcfg.head_dim
    # Distinct trace sizes (T, P, S and R = 2 all differ), so that no size is mistaken for another.
    T, P, S = 3, 4, 5
    tokens, positions, mask, logit_rows = _dummy_step_inputs(T, P)
    step_axes = {
        "tokens": {1: "T"},
        "positions": {1: "T"},
        "mask": {0: "T", 1: "P_plus_T"},
        "logit_rows": {0: "R"},
        "logits": {1: "R"},
    }
    graphs: dict[str, dict] = {}
    io = onnx_graph_io(dcfg.kind, dcfg.tli)
    if dcfg.kind == "moa":
        inputs, outputs = io["step"]
        tli_in, tli_out = inputs[8:], outputs[3:]
        axes = dict(step_axes, ctx_k={1: "S"}, ctx_v={1: "S"})
        axes.update({name: {1: "P"} for name in ["sa_k", "sa_v", *tli_in]})
        axes.update({name: {1: "T"} for name in ["sa_k_new", "sa_v_new", *tli_out]})
        args = (
            tokens,
            positions,
            mask,
            logit_rows,
            torch.randn(1, P, hs, ds),
            torch.randn(1, P, hs, ds),
            torch.randn(1, S, hs, ds),
            torch.randn(1, S, hs, ds),
            *[torch.randn(1, P, tcfg.n_kv_heads, tcfg.head_dim) for _ in tli_in],
        )
        step = _MoAStep(drafter).eval()
        with step.rotating():
            graphs["step"] = _export(step, args, out / "step.onnx", inputs, outputs, axes)
        ctx_in, ctx_out = io["context"]
        ctx_axes = {"lsa": {1: "n"}, "positions": {1: "n"}, "ctx_k": {1: "n"}, "ctx_v": {1: "n"}}
        ctx_args = (torch.randn(1, S, tcfg.dim), torch.arange(2, 2 + S)[None])
        graphs["context"] = _export(
            _MoAContext(drafter).eval(), ctx_args, out / "context.onnx", ctx_in, ctx_out, ctx_axes
        )
    else:
        inputs, outputs = io["step"]
        axes = dict(step_axes, prev_feat={1: "T"}, k={1: "P"}, v={1: "P"}, feat={1: "T"})
        axes.update(k_new={1: "T"}, v_new={1: "T"})
        args = (tokens, positions, mask, logit_rows, torch.randn(1, T, tcfg.dim), *torch.randn(2, 1, P, hs, ds))
        step = _EagleStep(drafter).eval()
        with step.rotating():
            graphs["step"] = _export(step, args, out / "step.onnx", inputs, outputs, axes)
    for g in graphs.values():
        g["sha256"] = _sha256(out / g["file"])
    manifest = {
        "format_version": FORMAT_VERSION,
        "kind": dcfg.kind,
        "dtype": "float32",
        "opset": OPSET,
        "drafter_config": dcfg.to_dict(),
        "shapes": {
            "vocab_size": tcfg.vocab_size,
            "dim": tcfg.dim,
            "max_seq_len": tcfg.max_seq_len,
            "tli": dcfg.tli if dcfg.kind == "moa" else 0,
            "draft_kv_heads": hs,  # Hs: SA / CA / EAGLE cache rows are [Hs, Ds]
            "draft_head_dim": ds,
            "target_kv_heads": tcfg.n_kv_heads,  # Hkv: TLI cache rows are [Hkv, D]
            "target_head_dim": tcfg.head_dim,
        },
        "target_fingerprint": dcfg.target_fingerprint,
        "graphs": graphs,
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest


def split_weights(graph: bytes, location: str) -> tuple[bytes, dict[str, np.ndarray]]:
    """(the graph with its fp32 matrices as external references to `location`, {initializer name: fp32 array})."""
    model = onnx_model_class()()
    model.ParseFromString(graph)
    weights: dict[str, np.ndarray] = {}
    for t in model.graph.initializer:
        if t.data_type != ONNX_FLOAT or len(t.dims) < 2 or not t.HasField("raw_data") or t.name in weights:
            continue  # vectors and scalars stay inside: small, and a norm's weights are worth their fp32
        array = np.frombuffer(t.raw_data, dtype="<f4").reshape(tuple(t.dims)).astype(np.float32)
        weights[t.name] = array
        t.ClearField("raw_data")
        t.data_location = ONNX_EXTERNAL
        for key, value in (("location", location), ("offset", "0"), ("length", str(array.nbytes))):
            t.external_data.add(key=key, value=value)
    return model.SerializeToString(), weights


def main(argv: Sequence[str] | None = None) -> int:
    from tether.shared.drafter_loading import load_drafter
    from tether.shared.model import Transformer

    p = argparse.ArgumentParser(prog="python -m tether.server.onnx_export", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True, help="target model directory")
    p.add_argument("--drafter", required=True, help="drafter directory (MoA or EAGLE)")
    p.add_argument("--out", required=True, help="output directory for the graphs and onnx_drafter.json")
    args = p.parse_args(argv)
    target = Transformer.from_pretrained(args.target, dtype=torch.float32)
    manifest = export_client_onnx(load_drafter(args.drafter, target), args.out)
    print(json.dumps({name: g["sha256"] for name, g in manifest["graphs"].items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
