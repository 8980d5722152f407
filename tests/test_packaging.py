"""Packaging: one `tether` namespace, console scripts with useful help, an edge build free of GPU code."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_wheel_holds_only_the_tether_namespace(tmp_path):
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            str(ROOT),
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("tether-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names}
    assert top == {"tether", next(t for t in top if t.endswith(".dist-info"))}, top
    for sub in ("shared", "server", "client", "kernels", "netsim", "v1"):
        assert f"tether/{sub}/__init__.py" in names
    # Folders below those (kernels/ has one per op) are packaged only where pyproject.toml names them: none left out.
    for sub in ("shared", "server", "client", "kernels", "netsim"):
        for init in (ROOT / sub).glob("*/**/__init__.py"):
            assert f"tether/{init.relative_to(ROOT).as_posix()}" in names, f"pyproject.toml does not package {init}"
    assert "tether/kernels/utils.py" in names and "tether/kernels/moda/naive.py" in names
    assert "tether/v1/tether_pb2_grpc.py" in names and "tether/v1/tether.proto" in names
    assert "tether/__init__.py" not in names  # an implicit namespace package
    entry_points = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "tether-server = tether.server.cli:program" in entry_points
    assert "tether-client = tether.client.cli:main" in entry_points


@pytest.mark.parametrize(
    "command,expect",
    [
        (["tether-server", "--help"], ["train-target", "train-drafter", "generate", "build-corpus", "serve"]),
        (["tether-server", "serve", "--help"], ["--port", "--host", "--max-sessions"]),
        (["tether-server", "train-target", "--help"], ["--preset", "--steps", "--device", "peak learning rate"]),
        (["tether-server", "generate", "--help"], ["--prompt", "--max-new-tokens", "--temperature"]),
        (["tether-client", "--help"], ["info"]),
    ],
)
def test_console_scripts_have_useful_help(command, expect):
    exe = Path(sys.executable).parent / command[0]
    out = subprocess.run([str(exe), *command[1:]], check=True, capture_output=True, text=True).stdout
    for word in expect:
        assert word in out


def test_client_imports_without_triton_or_server():
    """The edge build must never depend on GPU code: import the client with triton and the server blocked."""
    code = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith(("triton.", "tether.server", "tether.kernels")):
            raise ImportError(f"blocked on the edge: {name}")
for m in list(sys.modules):
    if m.startswith(("triton", "tether.server", "tether.kernels")):
        del sys.modules[m]
sys.meta_path.insert(0, Block())
import tether.client.cli, tether.shared.model, tether.shared.checkpoint, tether.shared.tokenizer
assert not any(m.startswith(("triton", "tether.server")) for m in sys.modules), "GPU code leaked into the edge"
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
