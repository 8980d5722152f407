"""tether.netsim stays a standalone harness: every module of it imports, and `tether-netsim` parses its flags and
variables and proxies, with every other package of tether made unimportable. Checked in a fresh interpreter, so
nothing this test process imported earlier can hide an import."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import tether.netsim

# The other packages of the `tether` distribution (pyproject.toml); netsim may import none of them.
OTHERS = ("tether.shared", "tether.client", "tether.server", "tether.kernels", "tether.v1")

# Makes the packages named in argv[1] (comma-separated) unimportable, before anything of tether is imported.
BLOCK = textwrap.dedent(
    """
    import sys

    BLOCKED = tuple(sys.argv[1].split(","))

    class Blocked:
        def find_spec(self, name, path=None, target=None):
            if any(name == b or name.startswith(b + ".") for b in BLOCKED):
                raise ImportError(f"tether.netsim imported {name}")
            return None

    sys.meta_path.insert(0, Blocked())
    """
)

PROBE = BLOCK + textwrap.dedent(
    """
    import importlib, io, json, pkgutil, socket, threading
    from contextlib import redirect_stdout

    import tether.netsim

    names = sorted("tether.netsim." + m.name for m in pkgutil.iter_modules(tether.netsim.__path__))
    for name in names:
        importlib.import_module(name)

    from tether.netsim.cli import build_parser, main
    from tether.netsim.proxy import NetSimThread

    args = build_parser().parse_args(["--latency-ms", "5"])  # TETHER_JITTER_MS and TETHER_JSON come from the env
    help_out = io.StringIO()
    with redirect_stdout(help_out):
        help_rc = main(["--help"])

    # A byte through the proxy, to a one-shot echo server.
    echo = socket.create_server(("127.0.0.1", 0))
    def serve():
        conn, _ = echo.accept()
        conn.sendall(conn.recv(1))
        conn.close()
    threading.Thread(target=serve, daemon=True).start()
    with NetSimThread("127.0.0.1:0", echo.getsockname()) as sim:
        with socket.create_connection(("127.0.0.1", sim.port), timeout=10) as sock:
            sock.sendall(b"x")
            echoed = sock.recv(1)

    loaded = sorted(m for m in sys.modules if m.startswith("tether."))
    print(json.dumps({"modules": names, "loaded": loaded, "latency": args.latency_ms, "jitter": args.jitter_ms,
                      "json": args.json, "help_rc": help_rc, "help": help_out.getvalue(), "echoed": echoed.decode()}))
    """
)


def test_every_netsim_module_imports_and_runs_without_the_rest_of_tether():
    env = {"PATH": "", "TETHER_JITTER_MS": "3", "TETHER_JSON": "yes", "TETHER_LATENCY_MS": "7"}
    proc = subprocess.run([sys.executable, "-c", PROBE, ",".join(OTHERS)], capture_output=True, text=True,
                          timeout=120, env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    (netsim_dir,) = tether.netsim.__path__
    on_disk = sorted(f"tether.netsim.{p.stem}" for p in Path(netsim_dir).glob("*.py") if p.stem != "__init__")
    assert out["modules"] == on_disk and "tether.netsim.cli" in on_disk
    assert all(m.startswith("tether.netsim") for m in out["loaded"]), out["loaded"]
    # The variables stand in for the defaults, the command line wins over them.
    assert (out["latency"], out["jitter"], out["json"]) == (5.0, 3.0, True)
    assert out["help_rc"] == 0 and "(env: TETHER_LATENCY_MS)" in " ".join(out["help"].split())
    assert out["echoed"] == "x"


def test_the_block_catches_an_import_made_on_the_way():
    # tether.netsim.proxy imports tether.netsim.scenario: blocked, the import of proxy fails in its turn.
    probe = BLOCK + "import tether.netsim.proxy\n"
    proc = subprocess.run([sys.executable, "-c", probe, "tether.netsim.scenario"], capture_output=True, text=True,
                          timeout=60, env={"PATH": ""})  # fmt: skip
    assert proc.returncode != 0 and "tether.netsim imported tether.netsim.scenario" in proc.stderr


def test_a_variable_that_does_not_parse_is_one_line_and_exit_2(monkeypatch, capsys):
    from tether.netsim.cli import main

    for name, value, said in (
        ("TETHER_LATENCY_MS", "abc", "TETHER_LATENCY_MS (for --latency-ms): invalid float value: 'abc'"),
        ("TETHER_UPSTREAM", "nowhere", "TETHER_UPSTREAM (for --upstream): expected HOST:PORT, got 'nowhere'"),
        ("TETHER_QUIET", "maybe", "TETHER_QUIET (for --quiet): expected one of 1, true, yes, 0, false, no"),
    ):
        monkeypatch.setenv(name, value)
        assert main(["--listen", "127.0.0.1:0"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"tether-netsim: error: {said}") and err.count("\n") == 1, err
        monkeypatch.delenv(name)
    monkeypatch.setenv("TETHER_LATENCY_MS", "")  # empty counts as unset: the flag keeps its default
    monkeypatch.setenv("TETHER_SCENARIO", "/nonexistent/scenario.json")
    assert main(["--listen", "127.0.0.1:0"]) == 2
    assert "scenario.json" in capsys.readouterr().err
