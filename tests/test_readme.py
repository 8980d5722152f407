"""README.md and docs/USAGE.md are executed: every command and code block in them is run, so that an example cannot
rot.

The README keeps the quick start, the install lines and the layout; docs/USAGE.md every other command (the full
command list, the OpenAI-compatible API, bringing your own checkpoint, the network harness, the Python API). Every
fenced block of either page is claimed by one entry of RUNNERS (its language and a pattern); a block no entry claims
fails `test_every_readme_block_is_claimed` with "command not run by any test: ...", so a line added to either page
without a runner fails CI. `make demo` and `make test` are listed in EXEMPT with the reason, and must stay in the
README.

The runners run the real commands on the CPU, in a scratch directory standing for the clone's root (the pages'
commands run there; tests/readme_runners.py): `.venv/bin/X` is the X beside this interpreter; GPU lines run their CPU
variant (`--device cpu`) with budgets cut to a few steps and tokens, tiny presets, and a tiny random Llama or Qwen2
checkpoint (written by transformers) where a real one is named; `[optional flags]` run without them, and where cheap
again with a subset taken from the page's own brackets; fixed ports become free ones. A `serve` line starts in the
background (one server at a time), and the commands below it that talk to a server talk to it: the one nearest above
them on the same page. A block that needs another's output (a corpus, a checkpoint) runs that block first, once.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from hub_cache import cache_hub_model
from readme_runners import BIN, ROOT, Block, Lab, free_port, pick, readme_blocks, replace_flag
from tiny_models import write_hf_checkpoint

pytestmark = pytest.mark.heavy  # a long file, started first (tests/conftest.py)

README = ROOT / "README.md"
PAGES = (README, ROOT / "docs" / "USAGE.md")
BLOCKS = [b for page in PAGES for b in readme_blocks(page)]
FEW_TOKENS = ["--max-new-tokens", "8"]
TINY_TRAIN = "--batch-size 1 --seq-len 32 --warmup 1 --eval-every 2 --eval-windows 1 --quiet".split()
TINY_DRAFTER_EVAL = "--eval-prompts 1 --eval-prompt-len 8 --eval-new-tokens 4".split()
TINY_DRAFTER = "--set n_heads=2 --set head_dim=16 --set ffn_dim=64 --set lsa_ffn_dim=32".split()
SERVE_LINES = ("listening on ",)
SERVE_HTTP_LINES = ("listening on ", "http listening on ")  # what serve prints as it listens: gRPC, then HTTP
EXEMPT = {
    "make demo": "tests/e2e/test_demo.py runs the demo (bench/demo.py) end to end",
    "make test": "CI runs it (.ci/run); running the whole suite from inside the suite would recurse",
}


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    lab = Lab(tmp_path_factory.mktemp("clone"), tmp_path_factory.mktemp("home"))
    yield lab
    lab.stop_all()


def block(pattern: str, lang: str = "") -> Block:
    found = [b for b in BLOCKS if b.lang == lang and re.search(pattern, b.text)]
    assert len(found) == 1, f"{len(found)} blocks of the pages match {pattern!r}, the test expects one"
    return found[0]


def ensure(lab: Lab, pattern: str) -> None:
    """Run the block matching `pattern` unless it has run (a prerequisite: its corpus, checkpoint, server)."""
    needed = block(pattern)
    if needed.text in lab.done:
        if error := lab.done[needed.text]:
            raise AssertionError(f"a prerequisite failed: {needed}") from error
        return
    run_block(lab, needed)


def run_block(lab: Lab, b: Block) -> None:
    lab.done[b.text] = None
    try:
        runner(b)(lab, b)
    except BaseException as e:
        lab.done[b.text] = e
        raise


def server_for(lab: Lab, b: Block) -> dict[str, str]:
    """The server the command talks to, the nearest `tether-server serve` above it on its page: started (or kept), its
    addresses as the page's fixed ones ("127.0.0.1:50051" gRPC, "127.0.0.1:8000" HTTP) map to them."""
    above = [
        s
        for s in BLOCKS[: BLOCKS.index(b)]
        if s.page == b.page and s.lang == "" and re.search(r"\btether-server serve ", s.text)
    ]
    assert above, f"no serve command above {b}"
    if above[-1].text in lab.done:  # it ran: (re)start that server alone, without the runner's other checks
        start_server(lab, above[-1])
    else:
        run_block(lab, above[-1])
    job = lab.servers[above[-1].text]
    addresses = {"127.0.0.1:50051": job.found["listening on "]}
    if "http listening on " in job.found:
        addresses["127.0.0.1:8000"] = job.found["http listening on "]
    return addresses


def at(addresses: dict[str, str], words: list[str]) -> list[str]:
    """The words with the page's fixed addresses replaced by the live ones."""
    out = []
    for word in words:
        for fixed, live in addresses.items():
            word = word.replace(fixed, live)
        out.append(word)
    return out


def last_json(stdout: str) -> dict:
    """The JSON object a command printed last (its --json result)."""
    return json.loads(stdout.strip().splitlines()[-1])


# The runners, in the order of the pages (the README, then docs/USAGE.md). Each takes the lab and its block.


def run_pip(lab: Lab, b: Block) -> None:
    """pip resolves the extra from this clone against what is installed (--dry-run, --no-index: nothing changes)."""
    (target,) = [w for w in b.words if w.startswith(".[")]
    report = lab.root / "pip-report.json"
    argv = [sys.executable, "-m", "pip", "install", "--dry-run", "--no-index", "--no-build-isolation", "--quiet",
            "--report", str(report), target]  # fmt: skip
    lab.run(argv, cwd=ROOT)
    (tether,) = [i for i in json.loads(report.read_text())["install"] if i["metadata"]["name"] == "tether"]
    extras = re.findall(r"\w+", target.split("[")[1])
    assert set(extras) <= set(tether["metadata"].get("provides_extra", [])), (extras, tether["metadata"])


def run_help(lab: Lab, b: Block) -> None:
    assert "generate" in lab.run(lab.argv(b.words)).stdout


def run_generate(lab: Lab, b: Block) -> None:
    argv = replace_flag(lab.argv(b.words), "--max-new-tokens", "8")
    assert lab.run(argv).stdout.strip()
    sampled = lab.run([*argv, *pick(b.text, "--temperature", "--top-p")])
    assert sampled.stdout.strip() and "tokens" in sampled.stderr


def run_generate_json(lab: Lab, b: Block) -> None:
    result = last_json(lab.run([*lab.argv(b.words), *FEW_TOKENS]).stdout)
    assert result["text"] and len(result["token_ids"]) == 8


def run_build_corpus(lab: Lab, b: Block) -> None:
    manifest = last_json(lab.run([*lab.argv(b.words), "--max-files", "30"]).stdout)
    assert manifest["train_tokens"] > 0 and (lab.root / "data" / "corpus" / "train.bin").is_file()


def run_train_drafter(lab: Lab, b: Block) -> None:
    ensure(lab, r"build-corpus --tokenizer deploy/models/target")
    argv = [*replace_flag(lab.argv(b.words), "--device", "cpu"), "--steps", "2", *TINY_TRAIN, *TINY_DRAFTER_EVAL]
    summary = last_json(lab.run(argv).stdout)
    assert summary["steps"] == 2 and (lab.root / "runs" / "moa3" / "drafter.safetensors").is_file()


def start_server(lab: Lab, b: Block) -> list[str]:
    """The serve command on free ports (`--port 0`, `--http-port 0`: it prints the ones it bound), in the background,
    unless it is running; returns its argv."""
    argv = replace_flag(lab.argv(b.words), "--port", "0")
    http = "--http-port" in b.words
    lab.serve(b.text, replace_flag(argv, "--http-port", "0") if http else argv, *SERVE_HTTP_LINES[: 1 + http])
    return argv


def run_serve(lab: Lab, b: Block) -> None:
    """The server the client lines below use; then once more with a subset of its optional flags (API keys, TLS where
    openssl is installed, metrics, a cache directory): it answers on its metrics port, refuses a client without the
    key, and serves the client line's `--api-key K --tls-ca ca.pem`."""
    argv = start_server(lab, b)
    if "--api-keys" not in b.text:
        return
    keys, metrics, tls = lab.root / "keys.txt", free_port(), lab.root / "pki"
    keys.write_text("# the --api-keys FILE of docs/USAGE.md\nreadme-key\n")
    subset = pick(b.text, "--api-keys", "--metrics-port", "--cache-dir", api_keys=str(keys), metrics_port=str(metrics))
    client_line = block(r'^\.venv/bin/tether-client generate --server 127\.0\.0\.1:50051 --prompt "def main').text
    client_flags = pick(client_line, "--api-key", api_key="readme-key")
    if shutil.which("openssl"):
        write_pki(tls)
        subset += pick(
            b.text, "--tls-cert", "--tls-key", tls_cert=str(tls / "server.pem"), tls_key=str(tls / "server.key")
        )
        client_flags += pick(client_line, "--tls-ca", tls_ca=str(tls / "ca.pem"))
    keyed = lab.start([*argv, *lab.argv(subset)], *SERVE_LINES)
    try:
        import httpx

        assert "tether" in httpx.get(f"http://127.0.0.1:{metrics}/metrics", timeout=60).text
        client = [str(BIN / "tether-client"), "generate", "--server", keyed.found["listening on "], "--prompt", "x"]
        without_key = [w for w in client_flags if w != "--api-key" and w != "readme-key"]
        refused = lab.run([*client, *FEW_TOKENS, *without_key], status=1)  # the server's refusal, in one line
        assert refused.stderr.strip().splitlines()[-1].startswith("tether-client generate: UNAUTHENTICATED")
        assert lab.run([*client, *FEW_TOKENS, *client_flags]).stdout.strip()
    finally:
        lab.stop(keyed)
    assert (lab.home / ".cache" / "tether").is_dir()


def write_pki(d: Path) -> None:
    """A CA and a server certificate for 127.0.0.1 signed by it (openssl)."""
    d.mkdir(exist_ok=True)
    (d / "san.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    for args in (
        "req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.pem -days 2 -subj /CN=readme-ca",
        "req -newkey rsa:2048 -nodes -keyout server.key -out server.csr -subj /CN=server",
        "x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out server.pem -days 2 -extfile san.ext",
    ):
        subprocess.run(["openssl", *args.split()], cwd=d, check=True, capture_output=True, timeout=60)


def run_warm(lab: Lab, b: Block) -> None:
    """warm compiles the CUDA kernels: on a CPU-only machine it says in one line that there is nothing to warm."""
    argv = lab.argv(b.words)
    done = subprocess.run(argv, capture_output=True, text=True, cwd=lab.root, env=lab.env, timeout=300)
    if done.returncode == 2:
        assert done.stderr.strip().count("\n") == 0 and "nothing to warm on cpu" in done.stderr, done.stderr
    else:
        assert done.returncode == 0, done.stderr


def run_generate_hf(lab: Lab, b: Block) -> None:
    model = lab.root / "models" / "tiny-llama"
    if not model.exists():
        write_hf_checkpoint(model, "llama")
    argv = [w.replace("PATH/TO/HF_LLAMA_OR_QWEN2_DIR", str(model)) for w in lab.argv(b.words)]
    lab.run([*argv, *FEW_TOKENS])


def run_client_generate(lab: Lab, b: Block) -> None:
    argv = at(server_for(lab, b), lab.argv(b.words))
    assert lab.run([*argv, *FEW_TOKENS]).stdout.strip()
    subset = pick(b.text, "--policy", "--json", "--temperature", "--seed", "--top-k", "--min-p", "--presence-penalty",
                  "--session-file", "--codec", "--precision", "--threads",
                  session_file=str(lab.root / "s.json"))  # fmt: skip
    result = last_json(lab.run([*argv, *FEW_TOKENS, *subset]).stdout)  # sampled: it may end before 8 tokens
    assert result["text"] and 1 <= len(result["token_ids"]) <= 8 and (lab.root / "s.json").is_file()


def run_client_prompt_file(lab: Lab, b: Block) -> None:
    (lab.root / "prompt.txt").write_text("def main():\n")
    argv = at(server_for(lab, b), lab.argv(b.words))
    assert lab.run([*argv, *FEW_TOKENS]).stdout.strip().startswith("def main():")
    assert "# or --prompt - (stdin)" in b.text
    stdin = [w for w in argv if w not in ("--prompt-file", "prompt.txt")]
    assert lab.run([*stdin, "--prompt", "-", *FEW_TOKENS], stdin="def main():\n").stdout.strip()


def run_chat(lab: Lab, b: Block) -> None:
    argv = at(server_for(lab, b), lab.argv(b.words))
    assert lab.run([*argv, *FEW_TOKENS], stdin="def fib(n):\n").stdout.strip()
    history = lab.root / "history.txt"
    subset = pick(b.text, "--system", "--history-file", history_file=str(history))
    assert lab.run([*argv, *FEW_TOKENS, *subset], stdin="def fib(n):\n").stdout.strip()


def run_edge_serve(lab: Lab, b: Block) -> None:
    """The edge's OpenAI endpoint answers an OpenAI client, with and without --policy rewind."""
    import httpx

    argv = replace_flag(at(server_for(lab, b), lab.argv(b.words)), "--listen", "127.0.0.1:0")
    for extra in ([], pick(b.text, "--policy", policy="rewind")):
        edge = lab.start([*argv, *extra], "listening on http://")
        try:
            base = "http://" + edge.found["listening on http://"].split()[0]
            (model,) = httpx.get(f"{base}/models", timeout=60).json()["data"]
            body = {"model": model["id"], "prompt": "def fib(n):", "max_tokens": 8, "temperature": 0}
            done = httpx.post(f"{base}/completions", json=body, timeout=120).json()
            assert done["choices"][0]["text"] and done["choices"][0]["tether"]["offline_tokens"] >= 0, done
        finally:
            lab.stop(edge)


def run_train_target(lab: Lab, b: Block) -> None:
    ensure(lab, r"build-corpus --tokenizer deploy/models/target")
    argv = replace_flag(replace_flag(lab.argv(b.words), "--device", "cpu"), "--steps", "2")
    summary = last_json(lab.run([*replace_flag(argv, "--preset", "tiny"), *TINY_TRAIN]).stdout)
    assert summary["finished"] and (lab.root / "runs" / "target" / "model.safetensors").is_file()


def run_netsim(lab: Lab, b: Block) -> None:
    """Through the proxy to a TCP echo listener and back; then the page's scenario (its times cut to a hundredth)
    played to its end, with --json."""
    upstream = echo_listener(lab)
    argv = replace_flag(replace_flag(lab.argv(b.words), "--upstream", upstream), "--listen", "127.0.0.1:0")
    proxy = lab.start(argv, "listening on ")
    host, port = proxy.found["listening on "].rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=60) as conn:
        conn.sendall(b"ping")
        assert conn.recv(4) == b"ping"
    assert "connections: 1 accepted" in lab.stop(proxy)
    scenario = json.loads(block(r'"event": "cut"', "json").text)
    (lab.root / "flaky.json").write_text(json.dumps([{**e, "at": e["at"] / 100} for e in scenario]))
    played = lab.run([*argv, *pick(b.text, "--scenario", "--json")])
    summary = last_json(played.stdout)  # the scenario's `end` stopped it, and --json printed its stats
    assert summary["connections_accepted"] == 0 and summary["up_bytes"] == 0, summary


def echo_listener(lab: Lab) -> str:
    """A TCP listener on 127.0.0.1 that echoes what each connection sends, closed with the lab."""
    server = socket.create_server(("127.0.0.1", 0))

    def close():
        with contextlib.suppress(OSError):
            server.shutdown(socket.SHUT_RDWR)  # wakes the accept() below on Linux
        server.close()

    lab.cleanup.append(close)

    def serve_one(conn):
        with conn, contextlib.suppress(OSError):  # the proxy resets its connections on a cut
            while data := conn.recv(65536):
                conn.sendall(data)

    def accept():
        with contextlib.suppress(OSError):  # closed
            while True:
                conn, _ = server.accept()
                threading.Thread(target=serve_one, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    return f"127.0.0.1:{server.getsockname()[1]}"


def run_scenario_json(lab: Lab, b: Block) -> None:
    from tether.netsim.scenario import parse_scenario

    data = json.loads(b.text)
    scenario = parse_scenario(data, b.page)
    assert len(scenario.events) == len(data) and scenario.ends


def run_netsim_python(lab: Lab, b: Block) -> None:
    assert "127.0.0.1:50051" in b.text
    code = b.text.replace("127.0.0.1:50051", echo_listener(lab))
    assert "accepted" in run_python(lab, code).stdout


def run_python(lab: Lab, code: str) -> subprocess.CompletedProcess:
    """A Python block as a script, from an empty directory (nothing of the clone's root beside it)."""
    cwd = lab.root / f"python-{len(lab.done)}"
    cwd.mkdir()
    return lab.run([sys.executable, "-c", code], cwd=cwd)


def run_python_api(lab: Lab, b: Block) -> None:
    shape = run_python(lab, b.text + "\nprint(tuple(logits.shape))").stdout.strip().splitlines()[-1]
    batch, length, vocab = eval(shape)
    assert batch == 1 and length > 0 and vocab > 1000


def run_curl(lab: Lab, b: Block) -> None:
    """With the real curl where it is installed, else the same request through httpx."""
    argv = at(server_for(lab, b), b.words)
    url = next(w for w in argv if w.startswith("http://"))
    body = json.loads(argv[argv.index("-d") + 1])
    if curl := shutil.which("curl"):
        out = lab.run([curl, "-sS", "--fail-with-body", *argv[1:]]).stdout
    else:
        import httpx

        out = httpx.post(url, json=body, timeout=120).text
    if body.get("stream"):
        events = [line.removeprefix("data: ") for line in out.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]", out
        text = "".join(
            c["choices"][0]["delta"].get("content") or "" for c in map(json.loads, events[:-1]) if c["choices"]
        )
    else:
        text = json.loads(out)["choices"][0]["text"]
    assert text, out


def run_openai(lab: Lab, b: Block) -> None:
    """The snippet prints the completion and the streamed chat: the default model must write text for both."""
    import httpx

    address = server_for(lab, b)["127.0.0.1:8000"]
    assert "http://127.0.0.1:8000/v1" in b.text
    printed = run_python(lab, b.text.replace("127.0.0.1:8000", address)).stdout
    # The completion is greedy: the same request gives the same text, which the snippet prints first.
    (request,) = re.findall(r"client\.completions\.create\((.*?)\)\n", b.text)
    body = eval(f"dict({request})")
    completion = httpx.post(f"http://{address}/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
    assert completion.strip() and printed.startswith(completion + "\n"), (completion, printed)
    assert printed.removeprefix(completion + "\n").strip(), f"the streamed chat printed nothing: {printed!r}"


def run_hf_download(lab: Lab, b: Block) -> None:
    """No hub download: `hf download` takes --local-dir, and a tiny Qwen2 checkpoint is written where it points."""
    words = b.words
    assert words[:2] == ["hf", "download"]
    hf = shutil.which("hf", path=str(BIN)) or shutil.which("hf")
    if hf:
        assert "--local-dir" in lab.run([hf, "download", "--help"]).stdout
    model = lab.root / words[words.index("--local-dir") + 1]
    if not model.exists():
        write_hf_checkpoint(model, "qwen2")


def run_byo_generate(lab: Lab, b: Block) -> None:
    ensure(lab, r"^hf download ")
    result = last_json(lab.run([*lab.argv(b.words), *FEW_TOKENS]).stdout)
    assert len(result["token_ids"]) == 8


def run_byo_hub_generate(lab: Lab, b: Block) -> None:
    """A hub id, offline: the tiny Qwen2 checkpoint is written into a hub cache of the lab's, as `hf download` leaves
    it, and the command finds it there."""
    cache = Path(lab.env.setdefault("HF_HUB_CACHE", str(lab.root / "hf-cache")))
    repo_id = b.words[b.words.index("--model") + 1]
    if not (cache / f"models--{repo_id.replace('/', '--')}").exists():
        cache_hub_model(cache, repo_id)
    result = last_json(lab.run([*lab.argv(b.words), *FEW_TOKENS]).stdout)
    assert len(result["token_ids"]) == 8


def run_byo_corpus(lab: Lab, b: Block) -> None:
    ensure(lab, r"^hf download ")
    argv = [*lab.argv(b.words), "--max-files", "30"]
    assert last_json(lab.run(argv).stdout)["train_tokens"] > 0
    extra = lab.root / "extra.py"
    extra.write_text("def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n")
    with_extra = replace_flag(argv, "--out", "data/corpus-qwen-extra")
    assert last_json(lab.run([*with_extra, *pick(b.text, "--extra-files", extra_files=str(extra))]).stdout)["files"]


def run_byo_train(lab: Lab, b: Block) -> None:
    ensure(lab, r"build-corpus --tokenizer models/")
    argv = replace_flag(replace_flag(lab.argv(b.words), "--device", "cpu"), "--steps", "2")
    summary = last_json(lab.run([*argv, *TINY_TRAIN, *TINY_DRAFTER_EVAL, *TINY_DRAFTER]).stdout)
    assert summary["steps"] == 2


def run_serve_byo(lab: Lab, b: Block) -> None:
    ensure(lab, r"^hf download ")
    if "runs/drafter-qwen" in b.words:
        ensure(lab, r"train-drafter --target models/")
    run_serve(lab, b)


def run_byo_client(lab: Lab, b: Block) -> None:
    result = last_json(lab.run([*at(server_for(lab, b), lab.argv(b.words)), *FEW_TOKENS]).stdout)
    assert result["text"] and set(result["tags"]) <= {"verified", "offline"} and result["stats"]["drafted"] > 0


def run_layout(lab: Lab, b: Block) -> None:
    """Each folder of the layout exists, and the package it names is that folder."""
    rows = [line.split()[:2] for line in b.text.splitlines() if re.match(r"^\w+/", line)]
    assert rows
    for folder, package in rows:
        assert (ROOT / folder).is_dir(), folder
        if package.startswith("tether."):
            spec = importlib.util.find_spec(package)
            assert spec and Path(spec.submodule_search_locations[0]).resolve() == (ROOT / folder).resolve(), package


RUNNERS: list[tuple[str, str, Callable[[Lab, Block], None]]] = [
    ("", r'^pip install "\.\[(server|client)\]"', run_pip),
    ("", r"^\.venv/bin/tether-server --help$", run_help),
    ("", r"^\.venv/bin/tether-server generate --prompt ", run_generate),
    ("", r"^\.venv/bin/tether-server generate --drafter none --prompt .* --json", run_generate_json),
    ("", r"^\.venv/bin/tether-server build-corpus --tokenizer deploy/models/target", run_build_corpus),
    ("", r"^\.venv/bin/tether-server train-drafter --kind ", run_train_drafter),
    ("", r"^\.venv/bin/tether-server serve --host 127\.0\.0\.1 --port 50051 ", run_serve),
    ("", r"^\.venv/bin/tether-server warm ", run_warm),
    ("", r"^\.venv/bin/tether-server generate --model PATH/TO/", run_generate_hf),
    ("", r'^\.venv/bin/tether-client generate --server 127\.0\.0\.1:50051 --prompt "def main', run_client_generate),
    ("", r"^\.venv/bin/tether-client generate .*--prompt-file ", run_client_prompt_file),
    ("", r"^\.venv/bin/tether-client chat ", run_chat),
    ("", r"^\.venv/bin/tether-client serve --listen ", run_edge_serve),
    ("", r"^\.venv/bin/tether-server train-target ", run_train_target),
    ("", r"^\.venv/bin/tether-netsim --listen ", run_netsim),
    ("json", r'"event": "cut"', run_scenario_json),
    ("python", r"from tether\.netsim\.proxy import ", run_netsim_python),
    ("python", r"from tether\.shared\.model import Transformer", run_python_api),
    ("", r"^\.venv/bin/tether-server serve --http-port 8000", run_serve),
    ("", r"^curl ", run_curl),
    ("python", r"from openai import OpenAI", run_openai),
    ("", r"^hf download ", run_hf_download),
    ("", r"^\.venv/bin/tether-server generate --model models/", run_byo_generate),
    ("", r"^\.venv/bin/tether-server generate --model Qwen/", run_byo_hub_generate),
    ("", r"^\.venv/bin/tether-server serve --model models/", run_serve_byo),
    ("", r"^\.venv/bin/tether-server build-corpus --tokenizer models/", run_byo_corpus),
    ("", r"^\.venv/bin/tether-server train-drafter --target models/", run_byo_train),
    ("", r'^\.venv/bin/tether-client generate --server 127\.0\.0\.1:50051 --prompt "def fib', run_byo_client),
    ("text", r"^shared/ +tether\.shared ", run_layout),
]


def claims(b: Block) -> list[Callable[[Lab, Block], None]]:
    return [fn for lang, pattern, fn in RUNNERS if lang == b.lang and re.search(pattern, b.text)]


def exempt(b: Block) -> str | None:
    return next((why for command, why in EXEMPT.items() if b.lang == "" and b.words == command.split()), None)


def runner(b: Block) -> Callable[[Lab, Block], None]:
    (fn,) = claims(b)
    return fn


def test_every_readme_block_is_claimed():
    unclaimed = [str(b) for b in BLOCKS if not exempt(b) and not claims(b)]
    assert not unclaimed, "\n".join(f"command not run by any test: {b}" for b in unclaimed)
    twice = [str(b) for b in BLOCKS if len(claims(b)) > 1]
    assert not twice, "blocks claimed by more than one runner:\n" + "\n".join(twice)
    in_readme = sorted(" ".join(b.words) for b in BLOCKS if exempt(b) and b.page == "README.md")
    assert in_readme == sorted(EXEMPT), "an exempt line left the README's quick start"


@pytest.mark.parametrize(
    "b", [b for b in BLOCKS if len(claims(b)) == 1 or exempt(b)], ids=lambda b: f"{Path(b.page).stem}-line{b.line}"
)
def test_readme_block(b: Block, lab: Lab):
    if why := exempt(b):
        pytest.skip(f"{b.text}: {why}")
    if b.text in lab.done:  # it ran already as another block's prerequisite
        if error := lab.done[b.text]:
            raise error
        return
    run_block(lab, b)


def test_repository_root_off_sys_path():
    """What Development's single-test command relies on: tests/conftest.py takes the clone's root off sys.path, so
    its kernels/ does not shadow Hugging Face's `kernels` package."""
    assert all(Path(p or ".").resolve() != ROOT for p in sys.path)
    spec = importlib.util.find_spec("kernels")
    assert spec is None or Path(spec.submodule_search_locations[0]).resolve() != ROOT / "kernels", spec


def test_development_single_test_command():
    """Development's single-test command as written, from the clone's root, without PYTHONSAFEPATH (a developer's
    shell has none): the test above passes there too."""
    (command,) = re.findall(r"`(TRITON_INTERPRET=1 \.venv/bin/python -m pytest -q tests/\.\.\.)`", README.read_text())
    variable, python, *args, placeholder = shlex.split(command)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH" and not k.startswith("TETHER_")}
    env.update([variable.split("=")])
    test = f"{Path(__file__).relative_to(ROOT)}::test_repository_root_off_sys_path"
    argv = [str(BIN / Path(python).name), *args, "-p", "no:cacheprovider", placeholder.replace("tests/...", test)]
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "1 passed" in done.stdout, done.stdout + done.stderr
