"""The few fields of onnx.proto that tether edits, as protobuf message classes built at run time (no `onnx` package).

The server takes a drafter graph's matrices out of it (tether.server.onnx_export.split_weights) and the edge client
rewrites an int8 part's matrix products to run in int8 (tether.client.onnx_int8) and prunes a graph to some of its
outputs (tether.client.onnx_derived). They only need initializers, nodes, the graph's inputs and outputs by name,
and opset imports; parsing a model with these classes keeps every field not listed here as an unknown field,
written back unchanged, so the rest of the graph survives an edit byte for byte (fields move only in order, which
ONNX readers ignore). Field numbers are onnx.proto's.

    model = onnx_model_class()()
    model.ParseFromString(graph_bytes)
    [t.name for t in model.graph.initializer], [n.op_type for n in model.graph.node]
    model.SerializeToString()

Tests: tests/server/test_client_export.py (split_weights), tests/client/test_onnx_int8.py (the int8 rewrite),
tests/client/test_onnx_derived.py (pruning).
"""

from __future__ import annotations

import functools

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

ONNX_FLOAT = 1  # TensorProto.DataType FLOAT
ONNX_INT8 = 3  # TensorProto.DataType INT8
ONNX_EXTERNAL = 1  # TensorProto.DataLocation EXTERNAL
ONNX_ATTR_GRAPH, ONNX_ATTR_GRAPHS = 5, 10  # AttributeProto.AttributeType GRAPH, GRAPHS: a node holding subgraphs

_F = descriptor_pb2.FieldDescriptorProto
_ONE, _MANY = _F.LABEL_OPTIONAL, _F.LABEL_REPEATED
# message -> [(field, number, type, label, message type)]
_MESSAGES = {
    "StringStringEntryProto": [("key", 1, _F.TYPE_STRING, _ONE, ""), ("value", 2, _F.TYPE_STRING, _ONE, "")],
    "TensorProto": [("dims", 1, _F.TYPE_INT64, _MANY, ""), ("data_type", 2, _F.TYPE_INT32, _ONE, ""),
                    ("name", 8, _F.TYPE_STRING, _ONE, ""), ("raw_data", 9, _F.TYPE_BYTES, _ONE, ""),
                    ("external_data", 13, _F.TYPE_MESSAGE, _MANY, "StringStringEntryProto"),
                    ("data_location", 14, _F.TYPE_INT32, _ONE, "")],
    "AttributeProto": [("name", 1, _F.TYPE_STRING, _ONE, ""), ("ints", 8, _F.TYPE_INT64, _MANY, ""),
                       ("type", 20, _F.TYPE_INT32, _ONE, "")],
    "ValueInfoProto": [("name", 1, _F.TYPE_STRING, _ONE, "")],
    "NodeProto": [("input", 1, _F.TYPE_STRING, _MANY, ""), ("output", 2, _F.TYPE_STRING, _MANY, ""),
                  ("name", 3, _F.TYPE_STRING, _ONE, ""), ("op_type", 4, _F.TYPE_STRING, _ONE, ""),
                  ("attribute", 5, _F.TYPE_MESSAGE, _MANY, "AttributeProto"),
                  ("domain", 7, _F.TYPE_STRING, _ONE, "")],
    "GraphProto": [("node", 1, _F.TYPE_MESSAGE, _MANY, "NodeProto"),
                   ("initializer", 5, _F.TYPE_MESSAGE, _MANY, "TensorProto"),
                   ("input", 11, _F.TYPE_MESSAGE, _MANY, "ValueInfoProto"),
                   ("output", 12, _F.TYPE_MESSAGE, _MANY, "ValueInfoProto")],
    "OperatorSetIdProto": [("domain", 1, _F.TYPE_STRING, _ONE, ""), ("version", 2, _F.TYPE_INT64, _ONE, "")],
    "ModelProto": [("graph", 7, _F.TYPE_MESSAGE, _ONE, "GraphProto"),
                   ("opset_import", 8, _F.TYPE_MESSAGE, _MANY, "OperatorSetIdProto")],
}  # fmt: skip


@functools.cache
def onnx_model_class() -> type:
    """ModelProto with the fields above (proto2, as onnx.proto), in a descriptor pool of its own."""
    f = descriptor_pb2.FileDescriptorProto(name="tether_onnx_subset.proto", package="tether_onnx_subset")
    f.syntax = "proto2"
    for name, fields in _MESSAGES.items():
        m = f.message_type.add(name=name)
        for field, number, kind, label, type_name in fields:
            d = m.field.add(name=field, number=number, type=kind, label=label)
            if type_name:
                d.type_name = f".tether_onnx_subset.{type_name}"
    pool = descriptor_pool.DescriptorPool()
    pool.Add(f)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("tether_onnx_subset.ModelProto"))
