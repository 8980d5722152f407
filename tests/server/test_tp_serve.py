"""`tether-server serve --tp 2` on CPU (gloo): rank 0 speaks gRPC, rank 1 follows; a session's greedy output,
its KV deltas and a full-history resync match the single-process model, and SIGTERM stops both ranks."""

import os
import queue
import signal
import subprocess
import sys

import grpc
import pytest
import torch
from toy_models import toy_model_dir, toy_model_flags

from tether.server.model_loading import load
from tether.server.verifier import target_states
from tether.shared.codecs import Codec, decode_many
from tether.shared.drafter import DraftDelta
from tether.shared.drafter_loading import load_drafter
from tether.shared.weights import client_part_tensors
from tether.v1 import tether_pb2 as pb
from tether.v1 import tether_pb2_grpc

pytestmark = pytest.mark.heavy  # a long file, started first (tests/conftest.py)


def to_delta(kv: pb.KVDelta) -> DraftDelta:
    return DraftDelta(start=kv.start, tokens=list(kv.tokens), tensors=decode_many(kv.payload))


@pytest.mark.parametrize(
    "attention",
    [
        "auto",
        pytest.param("triton", marks=pytest.mark.skipif(
            not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
            reason="the Triton kernels need CUDA or TRITON_INTERPRET=1")),
    ],
)  # fmt: skip
def test_tensor_parallel_server_matches_plain_greedy_and_stops_cleanly(attention):
    """With "triton", every rank verifies through the paged kernel over its own pool shard (PagedKernelView
    rebuilt from rank 0's block tables) and prefills through the prefill kernel."""
    # Two GPUs: NCCL ranks, otherwise gloo ranks on the CPU; fp32 both ways, so that the only difference from
    # the single-process model is the order of the all-reduce sums (in bf16 that rounding can flip a near tie).
    device = "cuda" if torch.cuda.device_count() >= 2 else "cpu"
    ref, _ = load(toy_model_dir(), "cuda:0" if device == "cuda" else "cpu", "float32")  # what the server computes
    target, tok = load(toy_model_dir(), "cpu")  # the client's side
    drafter = load_drafter(toy_model_dir("drafter"), target)
    prompt = tok.encode("def parse_header(line):\n    ")
    n_new = 24
    plain = list(ref.generate(torch.tensor([prompt], device=ref.device), n_new + 12))  # a round may overshoot
    cmd = [
        sys.executable,
        "-m",
        "tether.server.cli",
        "serve",
        *toy_model_flags(),
        "--tp",
        "2",
        "--device",
        device,
        "--port",
        "0",
        "--kv-pool-mb",
        "8",
        "--attention",
        attention,
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline().strip()
        assert line.startswith("listening on 127.0.0.1:") and "2 ranks" in line, line
        address = line.removeprefix("listening on ").split(" ")[0]
        with grpc.insecure_channel(address) as channel:
            stub = tether_pb2_grpc.TetherStub(channel)
            info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=120)
            # The client part is whole (taken before sharding): the same manifest as a single-process server's.
            manifest = next(stub.FetchWeights(pb.FetchWeightsRequest(), timeout=120)).manifest
            whole = client_part_tensors(target, drafter)
            assert [e.name for e in manifest.tensors] == [*whole, "tokenizer.json"]
            assert [tuple(e.shape) for e in manifest.tensors][:-1] == [tuple(t.shape) for t in whole.values()]

            outbox: queue.Queue = queue.Queue()
            replies = stub.Session(iter(outbox.get, None), timeout=300)
            open_ = pb.OpenSession(prompt=prompt, max_new_tokens=64, model_fingerprint=info.model_fingerprint,
                                   delta_codec=Codec.FP16_SHUFFLE_ZSTD)  # fmt: skip
            outbox.put(pb.ClientMessage(open=open_))
            opened = next(replies).opened
            first = to_delta(opened.delta)
            # The prompt's LSA vectors need every KV head: rank 0 gathered them from both shards.
            with torch.inference_mode():
                full = target.prefill(torch.tensor([prompt]), target.new_cache(1, 64), return_kv=True,
                                      hidden_layers=(target.cfg.n_layers,))  # fmt: skip
                want = drafter.server_delta(target_states(full), 0, prompt)
            tol = 3e-2  # bf16 on the wire
            torch.testing.assert_close(first.tensors["lsa"].float(), want.tensors["lsa"].float(), atol=tol, rtol=tol)
            drafter.begin(first)
            out, root, rnd = [opened.first_token], opened.first_token, 0
            while len(out) < n_new:
                drafts, _, _ = drafter.draft(root, 4)
                rnd += 1
                outbox.put(pb.ClientMessage(round=pb.DraftRound(round=rnd, root=root, tokens=drafts)))
                v = next(replies).verdict
                drafter.commit(to_delta(v.delta))
                out += drafts[: v.accepted] + [v.bonus]
                root = v.bonus
            outbox.put(None)
            assert out == plain[: len(out)]
            # A replica that never saw the session rebuilds it from the history (here: an unknown id).
            history = prompt + out[:-1]
            req = pb.ResyncRequest(session_id="f" * 32, resume_token="0" * 32, verified_length=len(history),
                                   offline_tokens=[out[-1]], history=history,
                                   model_fingerprint=info.model_fingerprint)  # fmt: skip
            reply = stub.Resync(req, timeout=120)
            assert reply.rebuilt and reply.target_token == plain[len(out)]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0
        assert "stopped" in proc.stdout.read()
    finally:
        proc.kill()
