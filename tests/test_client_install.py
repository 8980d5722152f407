"""The edge install (issue #16): `pip install "tether[client]"` into a fresh virtualenv, and what it can do there.

Contract: the `client` extra brings numpy, grpcio, protobuf, zstandard, tokenizers, onnxruntime and rich (with what
they need) and never torch or the server's extras; its site-packages stays under SIZE_BUDGET_MB; `tether-client
--help` and `--version` work there, and importing tether.client.cli pulls neither torch nor onnxruntime. The same
import check runs in this (main) virtualenv, where torch is installed and would be imported if anything reached it.
End to end: `tether-server serve` on the CPU (the toy models, from the main virtualenv, in a subprocess on a
loopback port) and, in the client virtualenv, a generation of GREEDY_TOKENS tokens with the default backend
(onnxruntime, the ONNX part the server exports): it gives the greedy text the torch backend gives in the main
virtualenv against the same server, and torch is never imported.

`client_venv` (module scope) builds the virtualenv once and returns its python, for tests that run the edge client
from it (next to a server from the main virtualenv). It installs a wheel built from a copy of the working tree's
sources (non-editable, as users get it), through pip with its cache; it needs a package index, and without one it
fails with pip's message, never skips. Tests that use it are marked `install` (`make test` runs them). The module
takes about 15 s on 2 cores (pip fetching some 70 MB of wheels); `-s` prints the measured size and `--help` time.

    TRITON_INTERPRET=1 .venv/bin/python -m pytest -q -s tests/test_client_install.py
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
from edge_text import continuation, run_text
from toy_models import toy_model_flags

pytestmark = pytest.mark.heavy  # a long file, started first (tests/conftest.py)

ROOT = Path(__file__).resolve().parent.parent
# The issue asked for 150 MB, which these dependencies cannot meet: numpy 2.4 and onnxruntime 1.32 alone install
# 151 MB, zstandard (both of its backends) and grpcio another 43 MB; the whole measured 271 MB. The budget guards
# what matters: the CPU torch wheel alone is 720 MB, and a dependency that grows or creeps in shows here.
SIZE_BUDGET_MB = 300
CLIENT_DISTRIBUTIONS = {
    "numpy",
    "grpcio",
    "protobuf",
    "zstandard",
    "tokenizers",
    "onnxruntime",
    "rich",
    "tether",
    "starlette",
    "uvicorn",
    "jinja2",
}  # the last three: `tether-client chat` and `serve`
SERVER_ONLY = ("torch", "triton", "nvidia-", "matplotlib", "prometheus-client", "grpcio-health-checking")
# Modules a bare --help or --version must not import: the drafter runtimes, and the session's heavy imports.
HEAVY = ("torch", "onnxruntime", "grpc", "numpy")
PIP_TIMEOUT_S = 480
GREEDY_TOKENS = 16
PROMPT = "def parse_args(argv):\n    "
PATIENT = {"round_timeout_s": 120.0, "connect_timeout_s": 120.0}  # a slow round must not look like an outage
# The edge client's generation, run by the client virtualenv's python: argv is the server, the cache directory and
# the prompt; it prints one JSON line. The session takes and yields token ids: the tokenizer pairing brings encodes
# the prompt and decodes the text, as `tether-client generate` does.
EDGE_GENERATION = f"""
import json, sys
from tether.client.session import ClientConfig, EdgeSession

server, cache, prompt = sys.argv[1:]
cfg = ClientConfig(server=server, max_new_tokens={GREEDY_TOKENS}, cache_dir=cache, **{PATIENT!r})
session = EdgeSession(cfg)
try:
    tok = session.pair().tokenizer
    result = session.run(tok.encode(prompt))
finally:
    session.close()
text = result.continuation(tok, session.stop_ids)
torch = sorted(m for m in sys.modules if m.split(".")[0] == "torch")
print(json.dumps({{"backend": cfg.backend, "token_ids": result.token_ids, "text": text, "tags": result.tags,
                  "torch": torch}}))
"""


def _source_copy(dest: Path) -> Path:
    """The files a wheel is built from: pip builds inside the source directory, so a stale build/ in the checkout
    (a module deleted since, another build running) must not reach the wheel under test."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    for top in sorted({Path(d).parts[0] for d in setuptools["package-dir"].values()}):
        shutil.copytree(ROOT / top, dest / top, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, dest / name)
    return dest


@pytest.fixture(scope="module")
def client_venv(tmp_path_factory) -> Path:
    """A fresh virtualenv (no system site packages) holding `tether[client]`; returns its python."""
    root = tmp_path_factory.mktemp("client_install")
    src = _source_copy(root / "src")
    subprocess.run([sys.executable, "-m", "venv", str(root / "venv")], check=True, capture_output=True)
    python = root / "venv" / "bin" / "python"
    # Under the lock, as `make test` installs: what a fresh clone gets is what CI last tested.
    lock = ["--constraint", str(ROOT / "constraints.txt")]
    cmd = [str(python), "-m", "pip", "install", "--disable-pip-version-check", "-q", *lock, f"{src}[client]"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"pip install tether[client] ran past {PIP_TIMEOUT_S} s: is the package index reachable?")
    if done.returncode:
        pytest.fail(
            "pip install tether[client] failed; it needs a package index (or pip's cache holding every wheel):\n"
            + done.stderr[-3000:]
        )
    return python


def _run(python: Path, code: str, *args: str) -> str:
    out = subprocess.run([str(python), "-c", code, *args], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout


def heavy_modules(python: Path, argv: list[str] | None) -> set[str]:
    """Top-level modules of HEAVY that importing tether.client.cli (and running main(argv), unless None) imports."""
    code = """
import sys
import tether.client.cli as cli
if sys.argv[1:] != ["--import-only"]:
    try:
        cli.main(sys.argv[1:])
    except SystemExit as e:
        assert not e.code, e.code
print(" ".join(sorted({m.split(".")[0] for m in sys.modules})))
"""
    out = _run(python, code, *(argv if argv is not None else ["--import-only"]))
    loaded = set(out.splitlines()[-1].split())  # the last line: above it is the help, which names torch too
    return loaded & set(HEAVY)


@pytest.mark.parametrize("argv", [None, ["--help"], ["--version"]], ids=["import", "help", "version"])
def test_bare_client_cli_imports_nothing_heavy_here(argv):
    """In the main virtualenv torch and onnxruntime are installed: nothing on this path may reach for them."""
    assert heavy_modules(Path(sys.executable), argv) == set()


@pytest.mark.install
def test_client_extra_brings_the_client_and_leaves_the_server_out(client_venv):
    names = _run(client_venv, "import importlib.metadata as m; print(*(d.metadata['Name'] for d in m.distributions()))")
    installed = {n.lower().replace("_", "-") for n in names.split()}
    assert CLIENT_DISTRIBUTIONS <= installed, CLIENT_DISTRIBUTIONS - installed
    assert not [n for n in installed if n.startswith(SERVER_ONLY)], installed
    assert _run(client_venv, "import importlib.util; print(importlib.util.find_spec('torch'))").strip() == "None"


@pytest.mark.install
def test_client_install_size(client_venv):
    (site,) = (client_venv.parent.parent / "lib").glob("python3*/site-packages")
    sizes: dict[str, int] = {}
    for dirpath, _, files in os.walk(site):
        top = Path(dirpath).relative_to(site).parts[:1] or ("(top level)",)
        sizes[top[0]] = sizes.get(top[0], 0) + sum(os.lstat(os.path.join(dirpath, f)).st_size for f in files)
    total_mb = sum(sizes.values()) / 1e6
    biggest = ", ".join(f"{k} {v / 1e6:.0f}" for k, v in sorted(sizes.items(), key=lambda kv: -kv[1])[:8])
    print(f"\ntether[client] site-packages: {total_mb:.0f} MB; biggest (MB): {biggest}")
    assert total_mb <= SIZE_BUDGET_MB, f"{total_mb:.0f} MB > {SIZE_BUDGET_MB} MB; biggest (MB): {biggest}"


@pytest.mark.install
def test_tether_client_help_and_version_run_there(client_venv):
    exe = client_venv.parent / "tether-client"
    t0 = time.perf_counter()
    out = subprocess.run([str(exe), "--help"], capture_output=True, text=True)
    print(f"\ntether-client --help in the client venv: {time.perf_counter() - t0:.3f} s")
    assert out.returncode == 0, out.stderr
    assert all(word in out.stdout for word in ("generate", "chat", "info")), out.stdout
    version = subprocess.run([str(exe), "--version"], capture_output=True, text=True)
    release = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert version.returncode == 0 and version.stdout.split() == ["tether-client", release], version


@pytest.mark.install
@pytest.mark.parametrize("argv", [None, ["--help"]], ids=["import", "help"])
def test_client_cli_there_imports_neither_torch_nor_onnxruntime(client_venv, argv):
    assert heavy_modules(client_venv, argv) == set()


@pytest.fixture(scope="module")
def cpu_server(tmp_path_factory):
    """`tether-server serve --device cpu` with the toy models, from this (main) virtualenv, on a free loopback
    port; yields its address and stops it (SIGTERM, then kill) when the module is done."""
    cache = tmp_path_factory.mktemp("server_cache")
    cmd = [sys.executable, "-m", "tether.server.cli", "serve", "--host", "127.0.0.1", "--port", "0", "--device", "cpu",
           "--cache-dir", str(cache), *toy_model_flags()]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline().strip()  # the server's first line, once its port is bound ("" if it died)
        assert line.startswith("listening on 127.0.0.1:"), f"tether-server serve said {line!r}"
        yield line.removeprefix("listening on ")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.mark.install
def test_onnx_client_without_torch_generates_the_torch_backends_greedy_text(client_venv, cpu_server, tmp_path):
    from tether.client.session import ClientConfig, EdgeSession

    edge = json.loads(_run(client_venv, EDGE_GENERATION, cpu_server, str(tmp_path / "edge"), PROMPT).splitlines()[-1])
    assert edge["backend"] == "onnx" and edge["torch"] == []
    assert len(edge["token_ids"]) == GREEDY_TOKENS and set(edge["tags"]) == {"verified"}
    cfg = ClientConfig(server=cpu_server, max_new_tokens=GREEDY_TOKENS, backend="torch",
                       cache_dir=str(tmp_path / "main"), **PATIENT)  # fmt: skip
    session = EdgeSession(cfg)
    try:
        reference = run_text(session, PROMPT)
    finally:
        session.close()
    assert edge["token_ids"] == reference.token_ids and edge["text"] == continuation(session, reference)
