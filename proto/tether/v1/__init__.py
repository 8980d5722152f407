"""tether.v1: the wire protocol's generated code (tether_pb2, tether_pb2_grpc), from proto/tether/v1/tether.proto.

Regenerate with `make proto` (grpcio-tools pinned to the 1.84 line, so the code also imports under grpcio 1.84);
tests/test_proto.py fails when the committed code is stale.
"""
