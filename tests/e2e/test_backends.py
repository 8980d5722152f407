"""The edge client with the onnxruntime backend agrees with the torch backend end to end: the same greedy text,
the same rounds and acceptance (so the same drafts), through a real server; and sampling works with it.

No link fault here: the deadlines are generous so that a busy machine never makes a slow round look like an outage
(an outage would change the rounds compared)."""

import pytest

from tether.client.session import ClientConfig, generate
from tether.server.generate import default_model_dir, load
from tether.server.rpc_server import make_server
from tether.server.service import ServiceConfig, TetherService
from tether.shared.checkpoint import fingerprint
from tether.shared.drafter import load_drafter

PATIENT = {"round_timeout_s": 120.0, "connect_timeout_s": 120.0}


@pytest.fixture(scope="module")
def address():
    target, tok = load(default_model_dir(), "cpu")
    drafter = load_drafter(default_model_dir("drafter"), target)
    service = TetherService(target, drafter, tok, ServiceConfig(), model_fingerprint=fingerprint(default_model_dir()))
    server, port = make_server(service, "127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(None)


def test_onnx_and_torch_backends_agree_end_to_end(address, tmp_path):
    runs = {}
    for backend in ("torch", "onnx"):
        cfg = ClientConfig(server=address, max_new_tokens=48, backend=backend, cache_dir=str(tmp_path), **PATIENT)
        runs[backend] = generate(cfg, "def write_lines(path, lines):\n    ")
    t, o = runs["torch"], runs["onnx"]
    assert o.token_ids == t.token_ids
    assert (o.stats.rounds, o.stats.accepted, o.stats.drafted) == (t.stats.rounds, t.stats.accepted, t.stats.drafted)
    assert t.stats.accepted > 0
    assert (tmp_path / "onnx").is_dir()  # exported once, cached by the drafter's fingerprint


def test_onnx_backend_samples(address, tmp_path):
    cfg = ClientConfig(server=address, max_new_tokens=24, backend="onnx", temperature=0.8, seed=3,
                       cache_dir=str(tmp_path), **PATIENT)  # fmt: skip
    result = generate(cfg, "import os\n")
    assert len(result.token_ids) == 24 and result.stats.rounds > 0
