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


def test_tree_fields_are_additive():
    """A chain round from an older client is the same bytes as ever (no parents on the wire), and the tree fields
    (DraftRound.parents, Verdict.path, ModelInfo.max_tree_nodes) round-trip."""
    from tether.v1 import tether_pb2 as pb

    chain = pb.DraftRound(round=3, root=7, tokens=[1, 2, 3])
    assert chain.SerializeToString() == b"\x08\x03\x10\x07\x1a\x03\x01\x02\x03"
    tree = pb.DraftRound.FromString(
        pb.DraftRound(round=3, root=7, tokens=[1, 2, 3], parents=[0, 0, 2]).SerializeToString()
    )
    assert list(tree.parents) == [0, 0, 2] and list(pb.DraftRound.FromString(chain.SerializeToString()).parents) == []
    verdict = pb.Verdict.FromString(pb.Verdict(round=3, accepted=2, bonus=5, path=[2, 3]).SerializeToString())
    assert list(verdict.path) == [2, 3]
    assert pb.ModelInfo.FromString(pb.ModelInfo(max_tree_nodes=64).SerializeToString()).max_tree_nodes == 64
