"""The server's ONNX client part (tether.server.client_export): split graphs, weight precisions, the export cache,
one export for concurrent first requests, and typed refusals when an export fails or a format is unknown."""

import asyncio
import threading

import grpc
import numpy as np
import onnxruntime as ort
import pytest
import torch
from tiny_models import tiny_moa_drafter, tiny_target

import tether.server.client_export as client_export
from tether.client.refusals import Refusal
from tether.server.client_export import ClientExporter, ExportError
from tether.server.engine_core import Engine
from tether.server.onnx_export import export_client_onnx, split_weights
from tether.server.rpc_server import make_server
from tether.server.serve_config import ServiceConfig
from tether.server.service import TetherService
from tether.shared.tokenizer import Tokenizer
from tether.shared.weights import (
    TOKENIZER_TENSOR,
    client_part_tensors,
    decode_weight,
    encode_weights,
    onnx_entries,
    stored_layout,
)
from tether.v1 import tether_pb2 as pb
from tether.v1 import tether_pb2_grpc

FP = "f" * 64


def tiny_part(tli: int = 2):
    """(target, drafter, the client part as a server streams it: bf16 tensors and the tokenizer's bytes)."""
    target = tiny_target(vocab_size=7)
    drafter = tiny_moa_drafter(target, tli=tli)
    part = {k: v.to(torch.bfloat16) for k, v in client_part_tensors(target, drafter).items()}
    part[TOKENIZER_TENSOR] = torch.frombuffer(bytearray(b'{"tokenizer": 1}'), dtype=torch.uint8)
    return target, drafter, part


def test_split_graph_runs_as_the_whole_one(tmp_path):
    _, drafter, _ = tiny_part()
    export_client_onnx(drafter, tmp_path)
    whole = (tmp_path / "step.onnx").read_bytes()
    graph, weights = split_weights(whole, "step.safetensors")
    assert len(graph) < len(whole) // 4 and weights
    assert all(w.ndim >= 2 and w.dtype == np.float32 for w in weights.values())
    assert "target.embed_tokens.weight" in weights and "drafter.sa.attn.q_proj.weight" in weights
    opts = ort.SessionOptions()
    opts.add_external_initializers(list(weights), [ort.OrtValue.ortvalue_from_numpy(w) for w in weights.values()])
    split = ort.InferenceSession(graph, opts, providers=["CPUExecutionProvider"])
    ref = ort.InferenceSession(whole, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    feeds = {}
    for arg in ref.get_inputs():
        shape = [{"T": 3, "P_plus_T": 7, "R": 2, "P": 4, "S": 5}.get(d, d) for d in arg.shape]
        if arg.type == "tensor(bool)":
            feeds[arg.name] = np.ones(shape, dtype=bool)
        elif arg.type == "tensor(int64)":
            feeds[arg.name] = np.minimum(np.arange(int(np.prod(shape))).reshape(shape), 2)
        else:
            feeds[arg.name] = rng.standard_normal(shape).astype(np.float32)
    for a, b in zip(split.run(None, feeds), ref.run(None, feeds), strict=True):
        np.testing.assert_array_equal(a, b)


def test_weight_precisions_round_trip_within_their_error():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((6, 10)).astype(np.float32) * np.arange(1, 7, dtype=np.float32)[:, None]
    w[2] = 0  # an all-zero row keeps a zero scale and decodes to zeros
    np.testing.assert_array_equal(encode_weights({"w": w}, "fp32")["w"], w)
    half = encode_weights({"w": w}, "fp16")["w"]
    assert half.dtype == np.float16
    np.testing.assert_allclose(decode_weight(half), w, rtol=2**-11)
    q = encode_weights({"w": w}, "int8")
    assert q["w"].dtype == np.int8 and q["w.scale"].shape == (6,)
    assert {k: (v.dtype.name, v.shape) for k, v in q.items()} == {
        "w" + suffix: layout for suffix, layout in stored_layout((6, 10), "int8").items()
    }
    back = decode_weight(q["w"], q["w.scale"])
    # Symmetric per row: every element within half a step of its row's scale, the row maximum exact.
    assert np.all(np.abs(back - w) <= q["w.scale"][:, None] / 2 + 1e-6)
    assert np.all(back[2] == 0) and np.abs(q["w"]).max() == 127
    with pytest.raises(ValueError, match="fp16"):
        encode_weights({"big": np.full((2, 2), 1e6, dtype=np.float32)}, "fp16")


def test_exports_once_and_every_restart_reuses_it(tmp_path):
    target, drafter, part = tiny_part()
    first = ClientExporter(target.cfg, drafter.dcfg, part, FP, tmp_path)
    parts = {p: first.part(p) for p in ("fp32", "fp16", "int8")}
    assert first.exports == 1  # fp16 and int8 come from the fp32 export's weights
    for p, got in parts.items():
        assert [e.name for e in got.manifest] == list(onnx_entries("moa"))
        assert all(e.dtype == "uint8" and e.shape == (e.nbytes,) for e in got.manifest)
        assert (tmp_path / f"{FP}-v{client_export.EXPORT_VERSION}" / p / "step.safetensors").is_file()
    sizes = {p: {e.name: e.nbytes for e in got.manifest} for p, got in parts.items()}
    assert sizes["fp16"]["step.onnx"] == sizes["fp32"]["step.onnx"]  # the graphs are the same, the weights not
    assert sizes["int8"]["step.safetensors"] < sizes["fp16"]["step.safetensors"] < sizes["fp32"]["step.safetensors"]
    first.close()
    again = ClientExporter(target.cfg, drafter.dcfg, part, FP, tmp_path)  # a restart
    assert {p: again.part(p).manifest for p in parts} == {p: got.manifest for p, got in parts.items()}
    assert again.exports == 0
    again.close()


@pytest.mark.parametrize("precision, damage", [("fp32", "removed"), ("int8", "changed")])
def test_a_damaged_export_is_made_again(tmp_path, precision, damage):
    target, drafter, part = tiny_part()
    exporter = ClientExporter(target.cfg, drafter.dcfg, part, FP, tmp_path)
    want = exporter.part(precision).manifest
    exporter.close()
    kept = tmp_path / f"{FP}-v{client_export.EXPORT_VERSION}" / precision
    if damage == "removed":
        (kept / "context.onnx").unlink()
    else:
        with open(kept / "step.safetensors", "r+b") as f:
            f.seek(-4, 2)
            f.write(b"\xff\xff\xff\xff")
    exporter = ClientExporter(target.cfg, drafter.dcfg, part, FP, tmp_path)
    assert exporter.part(precision).manifest == want
    assert exporter.exports == (precision == "fp32")  # int8 is derived again from the fp32 export on disk
    exporter.close()


def test_concurrent_first_requests_share_one_export_off_the_event_loop(tmp_path, monkeypatch):
    target, drafter, part = tiny_part()
    exporter = ClientExporter(target.cfg, drafter.dcfg, part, FP, tmp_path)
    gate, calls = threading.Event(), []

    def gated(*args):
        calls.append(args)
        assert gate.wait(60), "the test never opened the gate"
        return export_client_onnx(*args)

    monkeypatch.setattr(client_export, "export_client_onnx", gated)

    async def main():
        asks = ["fp32", "int8", "fp32", "int8", "fp16"]
        tasks = [asyncio.create_task(exporter.part_async(p)) for p in asks]
        await asyncio.sleep(0)  # every task has asked and waits: the event loop runs while the export is held
        assert not any(t.done() for t in tasks)
        gate.set()
        return dict(zip(asks, await asyncio.gather(*tasks), strict=False))

    got = asyncio.run(main())
    assert len(calls) == 1 and exporter.exports == 1
    assert got["fp32"] is exporter.part("fp32") and got["int8"].precision == "int8"
    exporter.close()


@pytest.fixture
def served(tmp_path):
    target, drafter, _ = tiny_part()
    tok = Tokenizer.train(texts=["def f(x):\n    return x\n"] * 20, vocab_size=260)
    service = TetherService(Engine(target, drafter, tok, ServiceConfig(), model_fingerprint=FP, export_dir=tmp_path))
    server, port = make_server(service, "127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield service, tether_pb2_grpc.TetherStub(channel)
    channel.close()
    server.stop(grace=None)
    service.engine.close()


def fetch(stub, fmt, **kw) -> list[pb.WeightChunk]:
    return list(stub.FetchWeights(pb.FetchWeightsRequest(model_fingerprint=FP, format=fmt, **kw)))


def test_model_info_lists_the_formats_and_each_streams_its_manifest(served):
    service, stub = served
    info = stub.GetModelInfo(pb.GetModelInfoRequest())
    assert list(info.client_part_formats) == [pb.CLIENT_PART_TENSORS, pb.CLIENT_PART_ONNX_FP32,
                                              pb.CLIENT_PART_ONNX_FP16, pb.CLIENT_PART_ONNX_INT8,
                                              pb.CLIENT_PART_TOKENIZER]  # fmt: skip
    tensors = fetch(stub, pb.CLIENT_PART_TENSORS, manifest_only=True)[0].manifest
    assert tensors.format == pb.CLIENT_PART_TENSORS and any(e.dtype == "bfloat16" for e in tensors.tensors)
    messages = fetch(stub, pb.CLIENT_PART_ONNX_INT8)
    man = messages[0].manifest
    assert man.format == pb.CLIENT_PART_ONNX_INT8 and man.drafter_fingerprint == service.engine.drafter_fingerprint
    assert [e.name for e in man.tensors] == list(onnx_entries("moa"))
    sent = {e.name: b"" for e in man.tensors}
    for m in messages[1:]:
        assert m.chunk.offset == len(sent[m.chunk.tensor])
        sent[m.chunk.tensor] += m.chunk.data
    assert {k: len(v) for k, v in sent.items()} == {e.name: e.nbytes for e in man.tensors}
    # Resumed in the middle of an entry: the rest of it, then every entry after it.
    rest = fetch(stub, pb.CLIENT_PART_ONNX_INT8, resume_tensor="step.onnx", resume_offset=100)[1:]
    assert rest[0].chunk.tensor == "step.onnx" and rest[0].chunk.offset == 100
    assert b"".join(m.chunk.data for m in rest if m.chunk.tensor == "step.onnx") == sent["step.onnx"][100:]


def test_a_failed_export_is_an_internal_refusal_and_is_tried_again(served, monkeypatch):
    service, stub = served

    def broken(*args):
        raise RuntimeError("no exporter here")

    monkeypatch.setattr(client_export, "export_client_onnx", broken)
    with pytest.raises(grpc.RpcError) as e:
        fetch(stub, pb.CLIENT_PART_ONNX_FP16, manifest_only=True)
    refusal = Refusal.of_rpc_error(e.value)
    assert refusal.code == grpc.StatusCode.INTERNAL and refusal.reason == pb.REASON_INTERNAL
    with pytest.raises(ExportError):
        service.engine.exporter.part("fp16")
    assert stub.GetModelInfo(pb.GetModelInfoRequest()).model_fingerprint == FP  # the server stays up
    monkeypatch.undo()
    assert fetch(stub, pb.CLIENT_PART_ONNX_FP16, manifest_only=True)[0].manifest.format == pb.CLIENT_PART_ONNX_FP16


def test_an_unknown_format_or_resume_point_is_invalid(served):
    _, stub = served
    for kw in ({"format": 9}, {"format": pb.CLIENT_PART_ONNX_FP32, "resume_tensor": "target.embed_tokens.weight"}):
        with pytest.raises(grpc.RpcError) as e:
            list(stub.FetchWeights(pb.FetchWeightsRequest(model_fingerprint=FP, **kw)))
        assert Refusal.of_rpc_error(e.value).reason == pb.REASON_INVALID_REQUEST
