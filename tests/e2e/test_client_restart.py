"""The client killed mid-generation (SIGKILL) and started again with the same session file goes on from where
it was: nothing written is lost or repeated, and greedy output still equals plain decoding.

The first client kills itself on its own event, the moment its text reaches 30 tokens (the session file is written
before the event), so the kill lands mid-generation on a machine of any speed."""

import json
import signal
import subprocess
import sys

import torch
from toy_models import toy_model_dir

from tether.server.engine_core import Engine
from tether.server.model_loading import load
from tether.server.rpc_server import make_server
from tether.server.serve_config import ServiceConfig
from tether.server.service import TetherService
from tether.shared.checkpoint import fingerprint
from tether.shared.drafter_loading import load_drafter

PROMPT = "class Cache:\n    def __init__(self"
KILL_AT = 30

# `tether-client` itself, its session dying by SIGKILL on the first event that finds KILL_AT tokens in its text.
KILLED_AT = f"""
import os, signal, sys
from tether.client import cli, session

class Killed(session.EdgeSession):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.on_event = self.die

    def die(self, event):
        if len(self.tokens) >= {KILL_AT}:
            os.kill(os.getpid(), signal.SIGKILL)

session.EdgeSession = Killed
sys.exit(cli.main(sys.argv[1:]))
"""


def test_killed_client_resumes_from_its_session_file(tmp_path):
    target, tok = load(toy_model_dir(), "cpu")
    drafter = load_drafter(toy_model_dir("drafter"), target)
    service = TetherService(
        Engine(target, drafter, tok, ServiceConfig(), model_fingerprint=fingerprint(toy_model_dir()))
    )
    server, port = make_server(service, "127.0.0.1:0")
    server.start()
    state = tmp_path / "session.json"
    args = ["generate", "--server", f"127.0.0.1:{port}", "--prompt", PROMPT, "--max-new-tokens", "100",
            "--session-file", str(state), "--cache-dir", str(tmp_path / "cache"), "--json",
            # No outage on a busy machine: offline tokens (policy keep) would not be plain decoding.
            "--round-timeout-s", "120", "--connect-timeout-s", "120"]  # fmt: skip
    try:
        first = subprocess.run([sys.executable, "-c", KILLED_AT, *args], capture_output=True, text=True, timeout=300)
        assert first.returncode == -signal.SIGKILL, first.stderr
        saved = json.loads(state.read_text())["tokens"]
        assert KILL_AT <= len(saved) < 100, "the first run should be killed mid-generation"
        second = subprocess.run([sys.executable, "-m", "tether.client.cli", *args], capture_output=True, text=True,
                                timeout=300)  # fmt: skip
        assert second.returncode == 0, second.stderr
        result = json.loads(second.stdout)
    finally:
        server.stop(None)
    assert result["token_ids"][: len(saved)] == saved
    plain = list(target.generate(torch.tensor([tok.encode(PROMPT)]), 100))
    assert result["token_ids"] == plain
    assert json.loads(state.read_text())["done"]
