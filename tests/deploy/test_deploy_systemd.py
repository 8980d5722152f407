"""The systemd units (deploy/systemd).

- They parse as INI (configparser, strict=False), carry the hardening and restart policy the README promises, and
  the command line each ExecStart= expands to, with the unit's Environment= defaults and the example environment
  file's values the way systemd substitutes them, parses with the real `tether-server` / `tether-client` parsers.
- `systemd-analyze verify` finds nothing to say about them, and `systemd-analyze security --offline` rates them
  "OK" or better, when systemd-analyze is on the machine (ExecStart= pointed at this venv's console scripts).
"""

import configparser
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tether.client.env import API_KEY

ROOT = Path(__file__).resolve().parents[2]
SYSTEMD = ROOT / "deploy" / "systemd"
SERVER = SYSTEMD / "tether-server.service"
CLIENT = SYSTEMD / "tether-client@.service"
UNITS = {
    "server": (SERVER, SYSTEMD / "tether-server.env.example"),
    "client": (CLIENT, SYSTEMD / "tether-client.env.example"),
}


def unit(path: Path) -> dict[str, dict[str, list[str]]]:
    """Sections -> key -> every value in order (systemd keys repeat), continuation lines joined."""
    out: dict[str, dict[str, list[str]]] = {}
    section, pending = None, ""
    for raw in path.read_text().splitlines():
        line = pending + raw.strip() if pending else raw.strip()
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        pending = ""
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            out[section] = {}
            continue
        key, _, value = line.partition("=")
        out[section].setdefault(key.strip(), []).append(value.strip())
    return out


def env_file(path: Path) -> dict[str, str]:
    values = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, _, value = line.partition("=")
            value = value.strip()
            if value[:1] in ("'", '"'):
                (value,) = shlex.split(value)  # systemd removes one level of quotes
            values[key.strip()] = value
    return values


def environment(u: dict, example: Path) -> dict[str, str]:
    env = {}
    for assignment in u["Service"].get("Environment", []):
        key, _, value = assignment.partition("=")
        env[key] = value
    return env | env_file(example)  # EnvironmentFile= overrides Environment=


def expand(command: str, env: dict[str, str], instance: str = "job") -> list[str]:
    """ExecStart= as systemd expands it: "${VAR}" is one argument, "$VAR" splits on whitespace, %i the instance."""
    argv = []
    for word in shlex.split(command.replace("%i", instance)):
        if m := re.fullmatch(r"\$\{(\w+)\}", word):
            argv.append(env[m.group(1)])
        elif m := re.fullmatch(r"\$(\w+)", word):
            argv += env[m.group(1)].split()
        else:
            argv.append(re.sub(r"\$\{(\w+)\}", lambda m: env[m.group(1)], word))
    return argv


@pytest.mark.parametrize("name", list(UNITS))
def test_units_parse_as_ini(name):
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str
    parser.read(UNITS[name][0])
    assert {"Unit", "Service", "Install"} <= set(parser.sections())


@pytest.mark.parametrize("name", list(UNITS))
def test_units_are_hardened_and_restart_on_failure(name):
    path, _ = UNITS[name]
    s = {k: v[-1] for k, v in unit(path)["Service"].items()}
    assert s.get("User") == "tether" or s.get("DynamicUser") == "yes"
    for key, value in {"NoNewPrivileges": "yes", "ProtectSystem": "strict", "ProtectHome": "yes", "PrivateTmp": "yes",
                       "ProtectKernelTunables": "yes", "ProtectKernelModules": "yes", "ProtectControlGroups": "yes",
                       "RestrictSUIDSGID": "yes", "LockPersonality": "yes", "CapabilityBoundingSet": "",
                       "Restart": "on-failure", "RestartPreventExitStatus": "2"}.items():  # fmt: skip
        assert s.get(key) == value, f"{path.name}: {key}={s.get(key)!r}"
    assert s["EnvironmentFile"].startswith("/etc/tether/")
    assert "@system-service" in s["SystemCallFilter"]


def test_server_unit_specifics():
    s = {k: v[-1] for k, v in unit(SERVER)["Service"].items()}
    assert s["KillSignal"] == "SIGTERM" and s["KillMode"] == "mixed"
    env = environment(unit(SERVER), UNITS["server"][1])
    assert float(env["TETHER_GRACE_S"]) < float(s["TimeoutStopSec"])
    # The GPU: no PrivateDevices= or closed device policy (the unit must still see /dev/nvidia*).
    assert "PrivateDevices" not in s and "DevicePolicy" not in s and "MemoryDenyWriteExecute" not in s
    assert (SYSTEMD / "tether.sysusers.conf").read_text().count("\nu tether ") == 1


def test_client_unit_is_a_resumable_job():
    s = {k: v[-1] for k, v in unit(CLIENT)["Service"].items()}
    assert s["Type"] == "oneshot" and s["DynamicUser"] == "yes"
    assert s["StandardOutput"] == "truncate:/var/lib/tether-client/%i.json"
    assert "--session-file /var/lib/tether-client/%i.session.json" in s["ExecStart"]


@pytest.mark.parametrize("name", list(UNITS))
def test_execstart_parses_with_the_real_cli(name):
    path, example = UNITS[name]
    u = unit(path)
    env = environment(u, example)
    (command,) = u["Service"]["ExecStart"]
    # Every ${VAR} has a default in the unit, so leaving it out of the environment file is safe, and every
    # variable of the example file is used.
    defaults = {a.partition("=")[0] for a in u["Service"]["Environment"]}
    used = set(re.findall(r"\$\{?(\w+)\}?", command))
    assert used <= defaults, used - defaults
    # The client reads its API key from the environment itself (tether.client.env): never on the command line,
    # where every user of the machine could read it (ps, /proc/PID/cmdline).
    read_itself = {API_KEY} if name == "client" else set()
    assert not used & read_itself and read_itself <= defaults
    assert set(env_file(example)) <= used | read_itself
    argv = expand(command, env)
    assert argv[0] == f"/opt/tether/bin/tether-{name}"
    if name == "server":
        from tether.server.cli import build_parser

        args = build_parser().parse_args(argv[1:])
        assert args.command == "serve" and args.port == 50051 and args.metrics_port == 9100
        assert args.api_keys == "/etc/tether/api-keys" and args.device == "cuda"
        # The kernel cache is the directory systemd keeps for the unit (CacheDirectory=): warm restarts.
        (cache_dir,) = u["Service"]["CacheDirectory"]
        assert args.cache_dir == f"/var/cache/{cache_dir}"
        # With an empty environment file the unit's defaults still make a valid command line.
        bare = {a.partition("=")[0]: a.partition("=")[2] for a in u["Service"]["Environment"]}
        args = build_parser().parse_args(expand(command, bare)[1:])
        assert args.api_keys == "" and args.tls_cert == "" and args.cache_dir == f"/var/cache/{cache_dir}"
    else:
        from tether.client.cli import build_parser

        args = build_parser().parse_args(argv[1:])
        assert args.command == "generate" and args.json and args.backend == "onnx"
        assert args.prompt == "Write a haiku about resilient networks:"
        assert args.session_file == "/var/lib/tether-client/job.session.json"
        assert args.cache_dir == "/var/cache/tether-client"


def local_copies(tmp_path: Path) -> list[Path]:
    """The units with ExecStart= pointing at this venv's console scripts (verify checks the binary exists)."""
    out = []
    for path in (SERVER, CLIENT):
        copy = tmp_path / path.name
        copy.write_text(path.read_text().replace("/opt/tether/bin/", f"{Path(sys.executable).parent}/"))
        out.append(copy)
    return out


def systemd_analyze() -> str:
    binary = shutil.which("systemd-analyze")
    if binary is None:
        pytest.skip("systemd-analyze is not installed")
    return binary


def test_systemd_analyze_verify(tmp_path):
    binary = systemd_analyze()
    server, client = local_copies(tmp_path)
    instance = tmp_path / "tether-client@job.service"
    run = subprocess.run([binary, "verify", str(server), str(instance)], capture_output=True, text=True,
                         timeout=60, cwd=tmp_path)  # fmt: skip
    complaints = [ln for ln in (run.stdout + run.stderr).splitlines() if ".service" in ln]
    assert run.returncode == 0 and not complaints, run.stdout + run.stderr


@pytest.mark.parametrize("name", ["tether-server.service", "tether-client@job.service"])
def test_systemd_analyze_security_rates_the_units_ok(tmp_path, name):
    binary = systemd_analyze()
    local_copies(tmp_path)
    run = subprocess.run([binary, "security", "--offline=yes", "--no-pager", str(tmp_path / name)],
                         capture_output=True, text=True, timeout=60, cwd=tmp_path)  # fmt: skip
    m = re.search(r"Overall exposure level for \S+: ([\d.]+) (\w+)", run.stdout + run.stderr)
    if m is None:
        pytest.skip(f"systemd-analyze security --offline is not supported here: {run.stderr.strip()[:200]}")
    assert float(m.group(1)) <= 3.0 and m.group(2) in ("OK", "SAFE"), run.stdout
