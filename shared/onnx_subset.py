"""The fields of onnx.proto that tether reads or edits, as protobuf message classes built at run time (no `onnx`).

Two schemas of the same wire format:
- `onnx_model_class()`: the few fields tether edits. The server takes a drafter graph's matrices out of it
  (tether.server.onnx_export.split_weights) and the edge client rewrites an int8 part's matrix products to run in
  int8 (tether.client.onnx_int8) and prunes a graph to some of its outputs (tether.client.onnx_derived). They only
  need initializers, nodes, the graph's inputs and outputs by name, and opset imports; parsing a model with these
  classes keeps every field not listed here as an unknown field, written back unchanged, so the rest of the graph
  survives an edit byte for byte (fields move only in order, which ONNX readers ignore).
- `onnx_inspect_class()`: every field of onnx.proto's ModelProto, GraphProto, NodeProto, AttributeProto,
  TensorProto and ValueInfoProto (as of onnx 1.18), for the edge client's check of a graph a server sent
  (tether.client.onnx_graph_policy) and the tests that build hostile ones. Fields whose content the check only
  needs to see present (model-local functions, subgraphs, sparse tensors, non-tensor types...) are read as bytes:
  the same wire type as a message, so they parse without their schema and the check refuses them.
Field numbers are onnx.proto's. Each schema's classes, nested messages' included, are built once per process and
held for good, so threads may parse and read messages of them at once (upb would otherwise build a nested class
again on demand, racily: #42).

    model = onnx_model_class()()
    model.ParseFromString(graph_bytes)
    [t.name for t in model.graph.initializer], [n.op_type for n in model.graph.node]
    model.SerializeToString()

Tests: tests/server/test_client_export.py (split_weights), tests/client/test_onnx_int8.py (the int8 rewrite),
tests/client/test_onnx_derived.py (pruning), tests/client/test_hostile_graphs.py (the inspection schema),
tests/shared/test_onnx_subset.py (the classes under threads).
"""

from __future__ import annotations

import threading

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

ONNX_FLOAT = 1  # TensorProto.DataType FLOAT
ONNX_INT8 = 3  # TensorProto.DataType INT8
ONNX_INT64 = 7  # TensorProto.DataType INT64
ONNX_BOOL = 9  # TensorProto.DataType BOOL
ONNX_EXTERNAL = 1  # TensorProto.DataLocation EXTERNAL
ONNX_ATTR_GRAPH, ONNX_ATTR_GRAPHS = 5, 10  # AttributeProto.AttributeType GRAPH, GRAPHS: a node holding subgraphs

_F = descriptor_pb2.FieldDescriptorProto
_ONE, _MANY = _F.LABEL_OPTIONAL, _F.LABEL_REPEATED
_I64, _I32, _U64, _STR, _BYTES, _MSG = (
    _F.TYPE_INT64,
    _F.TYPE_INT32,
    _F.TYPE_UINT64,
    _F.TYPE_STRING,
    _F.TYPE_BYTES,
    _F.TYPE_MESSAGE,
)
# message -> [(field, number, type, label, message type)]
_MESSAGES = {
    "StringStringEntryProto": [("key", 1, _STR, _ONE, ""), ("value", 2, _STR, _ONE, "")],
    "TensorProto": [
        ("dims", 1, _I64, _MANY, ""),
        ("data_type", 2, _I32, _ONE, ""),
        ("name", 8, _STR, _ONE, ""),
        ("raw_data", 9, _BYTES, _ONE, ""),
        ("external_data", 13, _MSG, _MANY, "StringStringEntryProto"),
        ("data_location", 14, _I32, _ONE, ""),
    ],
    "AttributeProto": [("name", 1, _STR, _ONE, ""), ("ints", 8, _I64, _MANY, ""), ("type", 20, _I32, _ONE, "")],
    "ValueInfoProto": [("name", 1, _STR, _ONE, "")],
    "NodeProto": [
        ("input", 1, _STR, _MANY, ""),
        ("output", 2, _STR, _MANY, ""),
        ("name", 3, _STR, _ONE, ""),
        ("op_type", 4, _STR, _ONE, ""),
        ("attribute", 5, _MSG, _MANY, "AttributeProto"),
        ("domain", 7, _STR, _ONE, ""),
    ],
    "GraphProto": [
        ("node", 1, _MSG, _MANY, "NodeProto"),
        ("initializer", 5, _MSG, _MANY, "TensorProto"),
        ("input", 11, _MSG, _MANY, "ValueInfoProto"),
        ("output", 12, _MSG, _MANY, "ValueInfoProto"),
    ],
    "OperatorSetIdProto": [("domain", 1, _STR, _ONE, ""), ("version", 2, _I64, _ONE, "")],
    "ModelProto": [("graph", 7, _MSG, _ONE, "GraphProto"), ("opset_import", 8, _MSG, _MANY, "OperatorSetIdProto")],
}

_META = ("metadata_props", "StringStringEntryProto")
_INSPECTED = {
    "StringStringEntryProto": _MESSAGES["StringStringEntryProto"],
    "OperatorSetIdProto": _MESSAGES["OperatorSetIdProto"],
    "TensorProto": [
        ("dims", 1, _I64, _MANY, ""),
        ("data_type", 2, _I32, _ONE, ""),
        ("segment", 3, _BYTES, _ONE, ""),
        ("float_data", 4, _F.TYPE_FLOAT, _MANY, ""),
        ("int32_data", 5, _I32, _MANY, ""),
        ("string_data", 6, _BYTES, _MANY, ""),
        ("int64_data", 7, _I64, _MANY, ""),
        ("name", 8, _STR, _ONE, ""),
        ("raw_data", 9, _BYTES, _ONE, ""),
        ("double_data", 10, _F.TYPE_DOUBLE, _MANY, ""),
        ("uint64_data", 11, _U64, _MANY, ""),
        ("doc_string", 12, _STR, _ONE, ""),
        ("external_data", 13, _MSG, _MANY, "StringStringEntryProto"),
        ("data_location", 14, _I32, _ONE, ""),
        (*_META[:1], 16, _MSG, _MANY, _META[1]),
    ],
    "AttributeProto": [
        ("name", 1, _STR, _ONE, ""),
        ("f", 2, _F.TYPE_FLOAT, _ONE, ""),
        ("i", 3, _I64, _ONE, ""),
        ("s", 4, _BYTES, _ONE, ""),
        ("t", 5, _MSG, _ONE, "TensorProto"),
        ("g", 6, _BYTES, _ONE, ""),
        ("floats", 7, _F.TYPE_FLOAT, _MANY, ""),
        ("ints", 8, _I64, _MANY, ""),
        ("strings", 9, _BYTES, _MANY, ""),
        ("tensors", 10, _MSG, _MANY, "TensorProto"),
        ("graphs", 11, _BYTES, _MANY, ""),
        ("doc_string", 13, _STR, _ONE, ""),
        ("tp", 14, _BYTES, _ONE, ""),
        ("type_protos", 15, _BYTES, _MANY, ""),
        ("type", 20, _I32, _ONE, ""),
        ("ref_attr_name", 21, _STR, _ONE, ""),
        ("sparse_tensor", 22, _BYTES, _ONE, ""),
        ("sparse_tensors", 23, _BYTES, _MANY, ""),
    ],
    "Dimension": [
        ("dim_value", 1, _I64, _ONE, ""),
        ("dim_param", 2, _STR, _ONE, ""),
        ("denotation", 3, _STR, _ONE, ""),
    ],
    "TensorShapeProto": [("dim", 1, _MSG, _MANY, "Dimension")],
    "TensorTypeProto": [("elem_type", 1, _I32, _ONE, ""), ("shape", 2, _MSG, _ONE, "TensorShapeProto")],
    "TypeProto": [
        ("tensor_type", 1, _MSG, _ONE, "TensorTypeProto"),
        ("sequence_type", 4, _BYTES, _ONE, ""),
        ("map_type", 5, _BYTES, _ONE, ""),
        ("denotation", 6, _STR, _ONE, ""),
        ("sparse_tensor_type", 8, _BYTES, _ONE, ""),
        ("optional_type", 9, _BYTES, _ONE, ""),
    ],
    "ValueInfoProto": [
        ("name", 1, _STR, _ONE, ""),
        ("type", 2, _MSG, _ONE, "TypeProto"),
        ("doc_string", 3, _STR, _ONE, ""),
        (*_META[:1], 4, _MSG, _MANY, _META[1]),
    ],
    "NodeProto": [
        ("input", 1, _STR, _MANY, ""),
        ("output", 2, _STR, _MANY, ""),
        ("name", 3, _STR, _ONE, ""),
        ("op_type", 4, _STR, _ONE, ""),
        ("attribute", 5, _MSG, _MANY, "AttributeProto"),
        ("doc_string", 6, _STR, _ONE, ""),
        ("domain", 7, _STR, _ONE, ""),
        ("overload", 8, _STR, _ONE, ""),
        (*_META[:1], 9, _MSG, _MANY, _META[1]),
        ("device_configurations", 10, _BYTES, _MANY, ""),
    ],
    "GraphProto": [
        ("node", 1, _MSG, _MANY, "NodeProto"),
        ("name", 2, _STR, _ONE, ""),
        ("initializer", 5, _MSG, _MANY, "TensorProto"),
        ("doc_string", 10, _STR, _ONE, ""),
        ("input", 11, _MSG, _MANY, "ValueInfoProto"),
        ("output", 12, _MSG, _MANY, "ValueInfoProto"),
        ("value_info", 13, _MSG, _MANY, "ValueInfoProto"),
        ("quantization_annotation", 14, _BYTES, _MANY, ""),
        ("sparse_initializer", 15, _BYTES, _MANY, ""),
        (*_META[:1], 16, _MSG, _MANY, _META[1]),
    ],
    "ModelProto": [
        ("ir_version", 1, _I64, _ONE, ""),
        ("producer_name", 2, _STR, _ONE, ""),
        ("producer_version", 3, _STR, _ONE, ""),
        ("domain", 4, _STR, _ONE, ""),
        ("model_version", 5, _I64, _ONE, ""),
        ("doc_string", 6, _STR, _ONE, ""),
        ("graph", 7, _MSG, _ONE, "GraphProto"),
        ("opset_import", 8, _MSG, _MANY, "OperatorSetIdProto"),
        (*_META[:1], 14, _MSG, _MANY, _META[1]),
        ("training_info", 20, _BYTES, _MANY, ""),
        ("functions", 25, _BYTES, _MANY, ""),
        ("configuration", 26, _BYTES, _MANY, ""),
    ],
}


_pools_lock = threading.Lock()
_pools: dict[str, dict[str, type]] = {}  # package -> its pool's message classes, by name, held for good


def _message_classes(package: str, messages: dict) -> dict[str, type]:
    """A class for each of `messages` (proto2, as onnx.proto), in a descriptor pool of its own: built on the first
    call for `package` and held from then on.

    Why held: upb keeps a dynamic pool's message class only while something refers to it, so a nested message's
    class (GraphProto, NodeProto...) died with its last instance at a garbage collection and was built again on the
    next access. Two threads building the same one at once (a collection in one runs a finalizer that hands the GIL
    to the other) leave upb's class cache pointing at a freed class, and a later access segfaults (#42)."""
    with _pools_lock:
        if package not in _pools:
            _pools[package] = _build_classes(package, messages)
        return _pools[package]


def _build_classes(package: str, messages: dict) -> dict[str, type]:
    f = descriptor_pb2.FileDescriptorProto(name=f"{package}.proto", package=package)
    f.syntax = "proto2"
    for name, fields in messages.items():
        m = f.message_type.add(name=name)
        for field, number, kind, label, type_name in fields:
            d = m.field.add(name=field, number=number, type=kind, label=label)
            if type_name:
                d.type_name = f".{package}.{type_name}"
    pool = descriptor_pool.DescriptorPool()
    pool.Add(f)
    return {name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{package}.{name}")) for name in messages}


def onnx_model_class() -> type:
    """ModelProto with the fields tether edits (module docstring)."""
    return _message_classes("tether_onnx_subset", _MESSAGES)["ModelProto"]


def onnx_inspect_class() -> type:
    """ModelProto with every field of the messages a graph is made of (module docstring)."""
    return _message_classes("tether_onnx_inspect", _INSPECTED)["ModelProto"]
