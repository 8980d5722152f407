"""The client killed mid-generation (SIGKILL) and started again with the same session file goes on from where
it was: nothing written is lost or repeated, and greedy output still equals plain decoding."""

import json
import subprocess
import sys
import time

import torch

from tether.server.generate import default_model_dir, load
from tether.server.service import ServiceConfig, TetherService, make_server
from tether.shared.checkpoint import fingerprint
from tether.shared.drafter import load_drafter

PROMPT = "class Cache:\n    def __init__(self"


def test_killed_client_resumes_from_its_session_file(tmp_path):
    target, tok = load(default_model_dir(), "cpu")
    drafter = load_drafter(default_model_dir("drafter"), target)
    service = TetherService(target, drafter, tok, ServiceConfig(), model_fingerprint=fingerprint(default_model_dir()))
    server, port = make_server(service, "127.0.0.1:0")
    server.start()
    state = tmp_path / "session.json"
    cmd = [
        sys.executable,
        "-m",
        "tether.client.cli",
        "generate",
        "--server",
        f"127.0.0.1:{port}",
        "--prompt",
        PROMPT,
        "--max-new-tokens",
        "100",
        "--session-file",
        str(state),
        "--cache-dir",
        str(tmp_path / "cache"),
        "--json",
    ]
    try:
        first = subprocess.Popen([*cmd, "--pace-tokens-per-s", "20"], stdout=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 120
        saved: list[int] = []
        while len(saved) < 30 and time.monotonic() < deadline and first.poll() is None:
            time.sleep(0.05)
            if state.exists():
                saved = json.loads(state.read_text())["tokens"]
        first.kill()
        first.wait(10)
        assert 30 <= len(saved) < 100, "the first run should be killed mid-generation"
        saved = json.loads(state.read_text())["tokens"]
        second = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert second.returncode == 0, second.stderr
        result = json.loads(second.stdout)
    finally:
        server.stop(None)
    assert result["token_ids"][: len(saved)] == saved
    plain = list(target.generate(torch.tensor([tok.encode(PROMPT)]), 100))
    assert result["token_ids"] == plain
    assert json.loads(state.read_text())["done"]
