"""Bring your own checkpoint, end to end on the CPU, as docs/USAGE.md's walkthrough ("Bring your own Llama or Qwen2
checkpoint") does it, through the real command lines: a tiny random Llama-shaped and a tiny random Qwen2-shaped
checkpoint, written by transformers (save_pretrained) with a byte-level BPE tokenizer.json built by `tokenizers`.

1. `tether-server generate --model DIR --drafter none`: plain greedy decoding, the reference;
2. `tether-server serve --model DIR --drafter none --http-port 0`: server-only, the OpenAI API (the official
   `openai` package) completes the prompt to the reference text;
3. `tether-server build-corpus --tokenizer DIR` and `train-drafter` (a tiny budget): a drafter for that target;
4. `tether-server serve --model DIR --drafter D` and `tether-client generate`: the edge drafts, the server
   verifies, and the greedy tokens equal the reference's.

`serve` runs as `python -m tether.server.cli` in a subprocess (it waits for SIGTERM); the other commands run
through their main() in this process. About 15 s per checkpoint on 2 cores."""

import json
import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from tiny_models import HF_SPECIALS, write_hf_checkpoint

from tether.client.cli import main as client_main
from tether.server.cli import main as server_main
from tether.shared import env
from tether.shared.tokenizer import Tokenizer

pytestmark = pytest.mark.heavy  # a long file, started first (tests/conftest.py)

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
openai = pytest.importorskip("openai")

PROMPT = "def main(argv):\n    "
NEW_TOKENS = 24
TINY_DRAFTER = "--set n_heads=2 --set head_dim=16 --set ffn_dim=64 --set lsa_ffn_dim=32".split()
TINY_BUDGET = ("--steps 6 --batch-size 4 --seq-len 64 --warmup 2 --eval-every 6 --eval-windows 2 --eval-prompts 1 "
               "--eval-prompt-len 16 --eval-new-tokens 8").split()  # fmt: skip
WAIT_S = 120  # the longest any one step may take on a busy machine before the test gives up on it


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def checkpoint(request, tmp_path_factory) -> Path:
    return write_hf_checkpoint(tmp_path_factory.mktemp("byo") / f"tiny-{request.param}", request.param)


@pytest.fixture
def no_tether_env(monkeypatch) -> dict[str, str]:
    """The commands read TETHER_* variables: none of the machine's may change what this test runs."""
    for name in [n for n in os.environ if n.startswith(env.PREFIX)]:
        monkeypatch.delenv(name)
    return dict(os.environ)


@contextmanager
def serving(environ: dict[str, str], log: Path, *argv: str) -> Iterator[dict[str, str]]:
    """`tether-server serve --port 0 ARGV` in a subprocess (its log in `log`); yields its addresses ("grpc", and
    "http" with --http-port) from the lines it prints, and stops it with SIGTERM."""
    cmd = [sys.executable, "-m", "tether.server.cli", "serve", "--host", "127.0.0.1", "--port", "0",
           "--device", "cpu", "--kv-pool-mb", "16", "--http-host", "127.0.0.1", *argv]  # fmt: skip
    with log.open("w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=environ)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [*map(lines.put, proc.stdout), lines.put("")], daemon=True).start()
    try:
        addresses = {}
        expected = (("grpc", "listening on "), ("http", "http listening on "))[: 2 if "--http-port" in argv else 1]
        for name, prefix in expected:
            try:
                line = lines.get(timeout=WAIT_S)  # "" when serve exited first
            except queue.Empty:
                line = ""
            assert line.startswith(prefix), f"serve printed {line!r}; its log:\n{log.read_text()}"
            addresses[name] = line.removeprefix(prefix).strip()
        yield addresses
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=WAIT_S)
        finally:
            proc.kill()
            proc.stdout.close()
    assert proc.returncode == 0, log.read_text()


def run(main, argv: list[str], capsys) -> dict:
    """A command's main() with --json: its exit status must be 0, and its stdout one JSON object."""
    status = main(argv)
    out, err = capsys.readouterr()
    assert status == 0, err
    return json.loads(out.strip().splitlines()[-1])


def test_bring_your_own_checkpoint(checkpoint, tmp_path, capsys, no_tether_env):
    model = str(checkpoint)
    plain = ["generate", "--model", model, "--drafter", "none", "--device", "cpu", "--prompt", PROMPT, "--json"]
    reference = run(server_main, [*plain, "--max-new-tokens", str(NEW_TOKENS)], capsys)
    specials = {tokenizers.Tokenizer.from_file(str(checkpoint / "tokenizer.json")).token_to_id(s)
                for s in HF_SPECIALS[checkpoint.name.removeprefix("tiny-")]}  # fmt: skip
    # The reference is all text (end-of-text would end it early, and the HTTP API leaves specials out of its text).
    assert len(reference["token_ids"]) == NEW_TOKENS and not specials & set(reference["token_ids"])

    # 1. The checkpoint as it is: server-only decoding, the OpenAI-compatible API.
    with serving(
        no_tether_env, tmp_path / "plain.log", "--model", model, "--drafter", "none", "--http-port", "0"
    ) as address:
        api = openai.OpenAI(base_url=f"http://{address['http']}/v1", api_key="unused", max_retries=0, timeout=WAIT_S)
        (served,) = api.models.list().data
        assert served.id == checkpoint.name  # --served-model-name defaults to the directory's name
        done = api.completions.create(model=served.id, prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0)
    assert done.choices[0].text == reference["text"] and done.usage.completion_tokens == NEW_TOKENS

    # 2. A corpus in the checkpoint's token ids, and a drafter trained for it.
    corpus, drafter = tmp_path / "corpus", tmp_path / "drafter"
    built = run(server_main, ["build-corpus", "--tokenizer", model, "--out", str(corpus), "--max-files", "30"], capsys)
    assert built["tokenizer_sha256"] == Tokenizer.from_pretrained(checkpoint).sha256  # the ids serve will read
    trained = run(server_main, ["train-drafter", "--target", model, "--data", str(corpus), "--out", str(drafter),
                                "--quiet", *TINY_BUDGET, *TINY_DRAFTER], capsys)  # fmt: skip
    assert trained["steps"] == 6 and (drafter / "drafter.safetensors").is_file()

    # 3. Served with its drafter: the edge client drafts, the server verifies, greedy output is the target's.
    with serving(no_tether_env, tmp_path / "drafted.log", "--model", model, "--drafter", str(drafter)) as address:
        edge = ["generate", "--server", address["grpc"], "--prompt", PROMPT, "--max-new-tokens", str(NEW_TOKENS)]
        patient = ["--round-timeout-s", str(WAIT_S), "--connect-timeout-s", str(WAIT_S)]  # a busy CPU is no outage
        result = run(client_main, [*edge, *patient, "--cache-dir", str(tmp_path / "edge"), "--json"], capsys)
    assert result["token_ids"] == reference["token_ids"] and result["text"] == reference["text"]
    assert set(result["tags"]) == {"verified"} and result["stats"]["drafted"] > 0  # drafted, then verified
