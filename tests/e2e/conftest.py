"""End-to-end fixtures shared by several test modules."""

import pytest
import torch
from toy_models import toy_model_dir

from tether.client import backend_part
from tether.server.engine_core import Engine
from tether.server.model_loading import load
from tether.server.rpc_server import make_server
from tether.server.serve_config import ServiceConfig
from tether.server.service import TetherService
from tether.shared.checkpoint import fingerprint
from tether.shared.drafter_loading import load_drafter


@pytest.fixture(scope="module")
def start_server():
    """start_server(edit=None) -> (address, service): the toy target and drafter served on the CPU over
    loopback, `edit(service)` applied before it starts (to make it look like another server); every server started
    is stopped, and its service closed, after the module."""
    servers = []

    def start(edit=None):
        target, tok = load(toy_model_dir(), "cpu")
        drafter = load_drafter(toy_model_dir("drafter"), target)
        service = TetherService(Engine(target, drafter, tok, ServiceConfig(),
                                model_fingerprint=fingerprint(toy_model_dir())))  # fmt: skip
        if edit is not None:
            edit(service)
        server, port = make_server(service, "127.0.0.1:0")
        server.start()
        servers.append((server, service))
        return f"127.0.0.1:{port}", service

    yield start
    for server, service in servers:
        server.stop(None)
        service.engine.close()  # its batcher thread would keep it, its KV pool among it, to the end of the run


@pytest.fixture(scope="module")
def default_server(start_server):
    """The toy models' server: (address, tokenizer, model fingerprint)."""
    address, service = start_server()
    return address, service.engine.tokenizer, service.engine.model_fingerprint


@pytest.fixture
def paired_once(monkeypatch, tmp_path_factory) -> str:
    """A weight cache directory whose every EdgeSession in the test reuses the first one's ONNX client part (each
    session's `begin` resets the drafter): each pairing would otherwise load it from the cache again, which
    dominates a generation of a few tokens."""
    parts: dict = {}
    real = backend_part.fetch_onnx_part

    def fetch(stub, info, cache_dir, **kwargs):
        key = (info.drafter_fingerprint, kwargs.get("precision"))
        if key not in parts:
            parts[key] = real(stub, info, cache_dir, **kwargs)
        return parts[key]

    monkeypatch.setattr(backend_part, "fetch_onnx_part", fetch)
    return str(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def served(start_server, request):
    """(address, service, the target's plain greedy continuation of the module's PROMPT, N_NEW tokens of it)."""
    address, service = start_server()
    prompt = torch.tensor([service.engine.tokenizer.encode(request.module.PROMPT)])
    return address, service, list(service.engine.target.generate(prompt, request.module.N_NEW))


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> str:
    """A weight cache directory for the module's sessions."""
    return str(tmp_path_factory.mktemp("cache"))
