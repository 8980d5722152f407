"""The edge client with the onnxruntime backend agrees with the torch backend end to end: the same greedy text,
the same rounds and acceptance (so the same drafts), through a real server; and sampling works with it.

No link fault here: the deadlines are generous so that a busy machine never makes a slow round look like an outage
(an outage would change the rounds compared)."""

import pytest

from tether.client.session import ClientConfig, generate

PATIENT = {"round_timeout_s": 120.0, "connect_timeout_s": 120.0}


@pytest.fixture(scope="module")
def address(default_server):
    return default_server[0]


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
