"""End-to-end fixtures shared by several test modules."""

import pytest

from tether.server.generate import default_model_dir, load
from tether.server.rpc_server import make_server
from tether.server.service import ServiceConfig, TetherService
from tether.shared.checkpoint import fingerprint
from tether.shared.drafter import load_drafter


@pytest.fixture(scope="module")
def default_server():
    """The shipped target and drafter served on the CPU over loopback: (address, tokenizer, model fingerprint)."""
    target, tok = load(default_model_dir(), "cpu")
    drafter = load_drafter(default_model_dir("drafter"), target)
    service = TetherService(target, drafter, tok, ServiceConfig(), model_fingerprint=fingerprint(default_model_dir()))
    server, port = make_server(service, "127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}", tok, service.model_fingerprint
    server.stop(None)
