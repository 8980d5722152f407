"""The wire protocol: the committed generated code is what `make proto` produces, and it imports as tether.v1."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
GENERATED = ("tether_pb2.py", "tether_pb2.pyi", "tether_pb2_grpc.py")


def test_generated_code_is_fresh(tmp_path):
    pytest.importorskip("grpc_tools")
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", "-I", str(ROOT / "proto"), f"--python_out={tmp_path}",
         f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}", str(ROOT / "proto/tether/v1/tether.proto")],
        check=True,
    )  # fmt: skip
    for name in GENERATED:
        fresh = (tmp_path / "tether/v1" / name).read_bytes()
        committed = (ROOT / "proto/tether/v1" / name).read_bytes()
        assert fresh == committed, f"proto/tether/v1/{name} is stale: run `make proto`"


def test_messages_round_trip_and_service_is_complete():
    from tether.v1 import tether_pb2, tether_pb2_grpc

    msg = tether_pb2.ClientMessage(round=tether_pb2.DraftRound(round=3, root=7, tokens=[1, 2, 3]))
    back = tether_pb2.ClientMessage.FromString(msg.SerializeToString())
    assert back.WhichOneof("body") == "round" and list(back.round.tokens) == [1, 2, 3]
    service = tether_pb2.DESCRIPTOR.services_by_name["Tether"]
    assert {m.name for m in service.methods} == {
        "GetModelInfo",
        "FetchWeights",
        "Session",
        "Resync",
        "Close",
        "Generate",
    }
    assert hasattr(tether_pb2_grpc, "TetherServicer") and hasattr(tether_pb2_grpc, "TetherStub")
