"""What an ONNX graph from a server may hold, checked before onnxruntime sees it: the op set and shapes our exporter
emits (tether.server.onnx_export), bounded by the configs the client paired with.

Why: onnxruntime runs whatever a graph says. A hostile server could send a Loop of 2^62 iterations (a hang), a
ConstantOfShape of 4 GiB, a tensor whose dims claim far more than its bytes (allocated before its data is
read), a subgraph or a model-local function that hides any of these, or operators from another domain. The
exporter emits none of that: plain ONNX operators (the default domain, opset OPSETS) over tensors whose static
axes are the model's own sizes. So everything else is refused here, in one line, before an InferenceSession is
created; what a check of the bytes cannot see (a shape computed at run time) is bounded when drafting
(tether.client.onnx_bounds).

Contract: `GraphLimits.of(cfg, dcfg)`: the largest static axis (`max_dim`, the largest size the configs name) and
the largest tensor (`max_elements`, max_dim x the model width) a paired drafter's graphs may hold.
`check_graph(graph, limits, external)` raises GraphRefused (a ValueError) unless, in `graph`'s ModelProto:
- its IR version is in IR_VERSIONS, it imports the default domain alone at a version in OPSETS, and holds no
  model-local functions, training info, sparse initializers or fields onnx.proto does not define;
- every node is of the default domain and in ALLOWED_OPS (no Loop, Scan, If: the exporter emits no control flow),
  no attribute holds a graph, a sparse tensor or a type, and Cast converts to TENSOR_TYPES only;
- every tensor in it (initializers, Constant values) is of TENSOR_TYPES, at most MAX_RANK axes and
  `max_elements`, its bytes exactly what its dims say; an external one is named in `external` {name: shape}
  (the weights the description lists, which the client supplies itself) with that shape;
- every static axis of an input, output or value_info is at most `max_dim` (a static shape at most
  `max_elements`), and the constant shape a ConstantOfShape or an Expand reads is within the same bounds.

    check_graph(step_bytes, GraphLimits.of(cfg, dcfg), {"target.embed_tokens.weight": (4096, 192)})

Tests: tests/client/test_hostile_graphs.py (each refusal, and the shipped drafters' graphs pass).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from google.protobuf import message

from tether.shared.config import ModelConfig
from tether.shared.drafter_config import DrafterConfig
from tether.shared.onnx_subset import ONNX_EXTERNAL, ONNX_INT64, onnx_inspect_class

IR_VERSIONS = range(7, 11)  # the exporter writes 8
OPSETS = range(17, 22)  # the exporter's OPSET is 17
DEFAULT_DOMAINS = ("", "ai.onnx")
# What torch's TorchScript exporter emits for our graphs (every op of the shipped drafters, MoA and EAGLE, any TLI N,
# with a depth predictor) and a few elementwise kin a torch version may pick instead; none runs a subgraph and
# none allocates beyond its inputs but ConstantOfShape and Expand, whose constant shapes are checked.
ALLOWED_OPS = frozenset(
    "Abs Add And Cast Concat Constant ConstantOfShape Cos Div Einsum Equal Erf Exp Expand Gather Greater "
    "GreaterOrEqual Identity Less LessOrEqual Log LogSoftmax MatMul Max Min Mul Neg Not Or Pow Reciprocal ReduceMax "
    "ReduceMean ReduceSum Relu Reshape ScatterND Shape Sigmoid Sin Slice Softmax Split Sqrt Squeeze Sub Tanh "
    "Transpose Unsqueeze Where".split()
)
# TensorProto.DataType -> bytes per element: FLOAT, UINT8, INT8, INT32, INT64, BOOL, FLOAT16
TENSOR_TYPES = {1: 4, 2: 1, 3: 1, 6: 4, 7: 8, 9: 1, 10: 2}
SHAPE_OPERAND = {"ConstantOfShape": 0, "Expand": 1}  # the input holding the shape they allocate
MAX_RANK = 8
MAX_NODES = 1 << 16  # the default MoA drafter's step graph has ~1,500
MAX_ATTRIBUTE_ITEMS = 64  # ints / floats / strings of one attribute (a perm, axes, an einsum's operands)
MAX_ATTRIBUTE_STRING = 256
# Attribute fields the exporter never writes: subgraphs (Loop, Scan, If bodies), sparse tensors, types, and the
# function-body reference.
_SINGLE_FORBIDDEN = ("g", "sparse_tensor", "tp", "ref_attr_name")
_REPEATED_FORBIDDEN = ("graphs", "sparse_tensors", "type_protos")
_NON_TENSOR_TYPES = ("sequence_type", "map_type", "sparse_tensor_type", "optional_type")


class GraphRefused(ValueError):
    """A graph from the server holds something our exporter never emits; the message says what, in one line."""


@dataclass(frozen=True)
class GraphLimits:
    max_dim: int  # the longest static axis
    max_elements: int  # the largest tensor, held or of a static shape

    @classmethod
    def of(cls, cfg: ModelConfig, dcfg: DrafterConfig) -> GraphLimits:
        """The bounds the paired configs imply: no axis longer than the largest size they name, no tensor larger
        than a matrix of that many rows of the model's width (the embeddings: vocabulary x dim)."""
        sizes = (
            cfg.vocab_size,
            cfg.dim,
            cfg.ffn_dim,
            cfg.max_seq_len,
            cfg.n_heads * cfg.head_dim,
            dcfg.ffn_dim,
            dcfg.lsa_ffn_dim,
            dcfg.eagle_ffn_dim,
            dcfg.n_heads * dcfg.head_dim,
        )
        max_dim = max(sizes)
        return cls(max_dim=max_dim, max_elements=max_dim * max(cfg.dim, cfg.head_dim, dcfg.head_dim))


def check_graph(graph: bytes, limits: GraphLimits, external: Mapping[str, Sequence[int]]) -> None:
    """Refuse `graph` unless it holds only what the exporter emits, within `limits` (module docstring)."""
    model = onnx_inspect_class()()
    try:
        model.ParseFromString(graph)
    except message.DecodeError:
        raise GraphRefused("not an ONNX model (it does not parse)") from None
    # One check over the whole tree: discarding unknown fields (recursively) changes the size iff any were there.
    # (The crash under load once put on protobuf's UnknownFieldSet was upb building a nested message class in two
    # threads at once: tether.shared.onnx_subset now holds every class, #42.)
    size = model.ByteSize()
    model.DiscardUnknownFields()
    need(model.ByteSize() == size, "it holds fields onnx.proto does not define")
    need(model.ir_version in IR_VERSIONS, f"IR version {model.ir_version} is not one the exporter writes")
    need(
        not (model.functions or model.training_info or model.configuration),
        "it holds model-local functions or training or device information",
    )
    for op in model.opset_import:
        need(op.domain in DEFAULT_DOMAINS, f"it imports operator domain {op.domain[:40]!r}")
        need(op.version in OPSETS, f"opset {op.version} is outside {OPSETS.start}..{OPSETS.stop - 1}")
    g = model.graph
    need(
        not (g.sparse_initializer or g.quantization_annotation),
        "it holds sparse initializers or quantization annotations",
    )
    need(len(g.node) <= MAX_NODES, f"{len(g.node)} nodes, over {MAX_NODES}")
    constants: dict[str, np.ndarray] = {}
    for t in g.initializer:
        _check_tensor(t, limits, external, f"initializer {t.name[:80]!r}")
        if t.data_type == ONNX_INT64 and t.data_location != ONNX_EXTERNAL:
            constants[t.name] = _int64_values(t)
    for kind, infos in (("input", g.input), ("output", g.output), ("value_info", g.value_info)):
        for vi in infos:
            _check_value_info(vi, limits, f"{kind} {vi.name[:80]!r}")
    for i, node in enumerate(g.node):
        where = f"node {i} ({node.op_type[:40]})"
        need(node.domain in DEFAULT_DOMAINS, f"{where}: of operator domain {node.domain[:40]!r}")
        need(node.op_type in ALLOWED_OPS, f"{where}: not an operator the exporter emits")
        for a in node.attribute:
            _check_attribute(node, a, limits, f"{where}, attribute {a.name[:40]!r}")
        if node.op_type == "Constant" and node.output:
            value = next((a.t for a in node.attribute if a.HasField("t")), None)
            if value is not None and value.data_type == ONNX_INT64:
                constants[node.output[0]] = _int64_values(value)
        operand = SHAPE_OPERAND.get(node.op_type)
        if operand is not None and len(node.input) > operand and node.input[operand] in constants:
            _check_dims(constants[node.input[operand]].tolist(), limits, f"{where}: the shape it allocates")


def need(ok: bool, what: str) -> None:
    if not ok:
        raise GraphRefused(what)


def _check_dims(dims: Iterable[int], limits: GraphLimits, where: str) -> int:
    """The element count of a static shape, refused unless every axis and the count are within `limits`."""
    dims = list(dims)
    need(len(dims) <= MAX_RANK, f"{where} has {len(dims)} axes, over {MAX_RANK}")
    need(all(0 <= d <= limits.max_dim for d in dims), f"{where} has an axis outside 0..{limits.max_dim}")
    count = math.prod(dims)
    need(count <= limits.max_elements, f"{where} has {count} elements, over {limits.max_elements}")
    return count


def _check_tensor(t, limits: GraphLimits, external: Mapping[str, Sequence[int]], where: str) -> None:
    need(t.data_type in TENSOR_TYPES, f"{where} is of data type {t.data_type}")
    need(not t.HasField("segment") and not t.string_data, f"{where} is segmented or holds strings")
    count = _check_dims(t.dims, limits, where)
    if t.data_location == ONNX_EXTERNAL:
        need(
            list(external.get(t.name, ())) == list(t.dims) and t.name in external,
            f"{where} is external data the description does not list with that shape",
        )
        need(not t.raw_data and not _typed_values(t), f"{where} is external and holds data too")
        return
    need(t.data_location == 0, f"{where} has data location {t.data_location}")
    typed = _typed_values(t)
    if t.HasField("raw_data"):
        ok = typed == 0 and len(t.raw_data) == count * TENSOR_TYPES[t.data_type]
    else:  # the typed field of its data type, one value per element (fp16, int8 and bool travel as int32)
        field = {1: t.float_data, 7: t.int64_data}.get(t.data_type, t.int32_data)
        ok = len(field) == count == typed
    need(ok, f"{where}: its data does not match its dims {list(t.dims)[:MAX_RANK]}")


def _typed_values(t) -> int:
    return len(t.float_data) + len(t.int32_data) + len(t.int64_data) + len(t.double_data) + len(t.uint64_data)


def _int64_values(t) -> np.ndarray:
    return np.frombuffer(t.raw_data, np.int64) if t.HasField("raw_data") else np.asarray(t.int64_data, np.int64)


def _check_value_info(vi, limits: GraphLimits, where: str) -> None:
    need(not any(vi.type.HasField(f) for f in _NON_TENSOR_TYPES), f"{where} is not a tensor")
    tt = vi.type.tensor_type
    need(tt.elem_type in TENSOR_TYPES, f"{where} is of element type {tt.elem_type}")
    dims = tt.shape.dim
    need(len(dims) <= MAX_RANK, f"{where} has {len(dims)} axes, over {MAX_RANK}")
    static = [d.dim_value for d in dims if d.HasField("dim_value")]
    if len(static) == len(dims):
        _check_dims(static, limits, where)
    else:
        need(all(0 <= d <= limits.max_dim for d in static), f"{where} has an axis outside 0..{limits.max_dim}")


def _check_attribute(node, a, limits: GraphLimits, where: str) -> None:
    held = [f for f in _SINGLE_FORBIDDEN if a.HasField(f)] + [f for f in _REPEATED_FORBIDDEN if len(getattr(a, f))]
    if held:
        raise GraphRefused(f"{where} holds {held[0]} (a subgraph, sparse tensor, type or function reference)")
    need(
        max(len(a.ints), len(a.floats), len(a.strings), len(a.tensors)) <= MAX_ATTRIBUTE_ITEMS,
        f"{where} holds over {MAX_ATTRIBUTE_ITEMS} values",
    )
    need(
        len(a.s) <= MAX_ATTRIBUTE_STRING and all(len(s) <= MAX_ATTRIBUTE_STRING for s in a.strings),
        f"{where} holds a string over {MAX_ATTRIBUTE_STRING} bytes",
    )
    if a.HasField("t"):
        _check_tensor(a.t, limits, {}, where)
    for t in a.tensors:
        _check_tensor(t, limits, {}, where)
    if node.op_type == "Cast" and a.name == "to":
        need(a.i in TENSOR_TYPES, f"{where}: Cast to data type {a.i}")
