"""An int8 client part's matrix products, run in int8: the drafter graph rewritten at load, before onnxruntime sees it.

Why: a draft step is a chain of matrix-vector products whose fp32 weights are read from memory at every step;
after the client has waited on the network they are read cold. The int8 part already holds each matrix as int8
rows with one scale a row (tether.shared.weights); widened back to fp32 they cost four times the bytes a step. Here
the products read the int8 rows themselves (bench/draft.py --precisions fp32 int8 has the figures).

Contract: `int8_matmuls(graph, stored)` takes the graph bytes (tether.server.onnx_export's, its matrices external)
and `stored` {initializer name: (int8 matrix [N, K], fp32 row scales [N])}. Every `MatMul(A, Transpose(W))` whose W
is one of those 2-D matrices (the exporter's form of `x @ W.T`, a Linear layer) becomes onnxruntime's
com.microsoft `DynamicQuantizeMatMul(A, W^T as int8 [K, N], the scales [N])`: A is quantized per call (uint8, one
scale), B is W's rows at 7 bits (`seven_bit`: each row's int8 values halved, its scale doubled), per column; the
product is dequantized to fp32. Those tensors go into the graph.
Why 7 bits: on x86 cores without VNNI (AVX2 only: many laptops and edge boxes) onnxruntime's uint8 x int8 kernel
sums pairs of products in int16 (vpmaddubsw), which saturates once a pair passes 32,767 (255 x 127 x 2 can reach
64,770). With weights within +-63 no pair can (255 x 63 x 2 = 32,130), on every host alike: onnxruntime's own
advice for such hosts (quantization's `reduce_range`). On an AVX2-only EPYC the 8-bit products moved the default
drafter's logits by 5-14% against the widened part and changed its first draft token; at 7 bits 2-7% and the same
chains.
A matrix another node still reads (tied embeddings: the token lookup) stays external, dequantized to fp32; the
others, and the Transposes left unused, leave the graph. Returns (the graph bytes, {name: fp32 matrix} of the
external matrices still in it), for tether.client.onnx_drafter's session. Drafts move a little against the fp32
part (the activation is quantized too); verification keeps the text the target's either way.

    graph, weights = int8_matmuls(graph_bytes, load_stored(path, spec))

Tests: tests/client/test_onnx_int8.py (the rewrite, and its logits against the widened part).
"""

from __future__ import annotations

import numpy as np

from tether.shared.onnx_subset import ONNX_FLOAT, ONNX_INT8, onnx_model_class
from tether.shared.weights import decode_weight

MS_DOMAIN = "com.microsoft"  # onnxruntime's contrib operators
INT8_SUFFIX, SCALE_SUFFIX = "#int8T", "#scale"  # the rewritten product's B and its scales, beside W's name


def _transposed_2d(node) -> bool:
    """A Transpose that swaps a matrix's two axes (perm [1, 0], or no perm: reverse)."""
    perm = [list(a.ints) for a in node.attribute if a.name == "perm"]
    return not perm or perm[0] == [1, 0]


def _tensor(graph, name: str, array: np.ndarray, data_type: int) -> None:
    t = graph.initializer.add(name=name, data_type=data_type, raw_data=np.ascontiguousarray(array).tobytes())
    t.dims.extend(array.shape)


def seven_bit(q: np.ndarray, scale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """int8 rows [N, K] with fp32 row scales [N] -> the same rows within +-63 (halved, rounded half to even) and
    doubled scales: what the products read, so that no int16 pair sum saturates (see the module docstring)."""
    q7 = np.clip(np.rint(q.astype(np.float32) / 2), -63, 63).astype(np.int8)  # [N, K]
    return q7, (2 * scale).astype(np.float32)  # [N]


def int8_matmuls(
    graph: bytes, stored: dict[str, tuple[np.ndarray, np.ndarray | None]]
) -> tuple[bytes, dict[str, np.ndarray]]:
    """See the module docstring. `stored` values with no scale (not int8) are only widened."""
    model = onnx_model_class()()
    model.ParseFromString(graph)
    g = model.graph
    taken = {t.name for t in g.initializer}
    int8 = {name for name, (q, scale) in stored.items() if scale is not None and q.ndim == 2}
    of_weight = {
        n.output[0]: n.input[0] for n in g.node if n.op_type == "Transpose" and n.input[0] in int8 and _transposed_2d(n)
    }
    quantized: set[str] = set()
    for n in g.node:
        if n.op_type != "MatMul" or n.domain or n.input[1] not in of_weight:
            continue
        w = of_weight[n.input[1]]
        if w not in quantized:
            q, scale = stored[w]
            if {w + INT8_SUFFIX, w + SCALE_SUFFIX} & taken:
                raise ValueError(f"the graph already names a tensor {w + INT8_SUFFIX!r} or {w + SCALE_SUFFIX!r}")
            q7, scale7 = seven_bit(q, scale)
            _tensor(g, w + INT8_SUFFIX, q7.T, ONNX_INT8)  # [K, N]
            _tensor(g, w + SCALE_SUFFIX, scale7, ONNX_FLOAT)  # [N]
            quantized.add(w)
        a = n.input[0]
        del n.input[:]
        n.input.extend([a, w + INT8_SUFFIX, w + SCALE_SUFFIX])
        n.op_type, n.domain = "DynamicQuantizeMatMul", MS_DOMAIN
    if quantized:
        read = {i for n in g.node for i in n.input}
        dead = [n for n in g.node if n.op_type == "Transpose" and n.output[0] in of_weight and n.output[0] not in read]
        for n in dead:
            g.node.remove(n)
        read = {i for n in g.node for i in n.input}
        for t in [t for t in g.initializer if t.name in quantized and t.name not in read]:
            g.initializer.remove(t)
        if not any(o.domain == MS_DOMAIN for o in model.opset_import):
            model.opset_import.add(domain=MS_DOMAIN, version=1)
    left = {t.name for t in g.initializer}
    weights = {name: decode_weight(q, scale) for name, (q, scale) in stored.items() if name in left}
    return model.SerializeToString(), weights
