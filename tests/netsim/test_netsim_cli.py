"""`tether-netsim` end to end: a subprocess proxying a plain echo server, stopped by SIGTERM or its scenario."""

import json
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path

from netsim_helpers import connect, recv_exactly

from tether.netsim.cli import main

CLI = [sys.executable, "-m", "tether.netsim.cli"]


class Run:
    """The CLI in a subprocess, its stdout read line by line on a thread so every wait has a timeout."""

    def __init__(self, *args: str):
        self.proc = subprocess.Popen([*CLI, "--listen", "127.0.0.1:0", *args], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)  # fmt: skip
        self.lines: queue.Queue = queue.Queue()
        self.reader = threading.Thread(target=lambda: [self.lines.put(ln) for ln in self.proc.stdout], daemon=True)
        self.reader.start()

    def line(self, timeout_s: float) -> str:
        try:
            return self.lines.get(timeout=timeout_s)
        except queue.Empty:
            self.proc.kill()
            raise AssertionError(f"no output; stderr: {self.proc.stderr.read()}") from None

    def finish(self) -> tuple[str, str]:
        """Wait for the exit; returns the last stdout line and all of stderr."""
        try:
            self.proc.wait(timeout=10)
        finally:
            self.proc.kill()
        out = self.line(5)
        self.reader.join(5)
        err = self.proc.stderr.read()
        self.proc.stdout.close()
        self.proc.stderr.close()
        return out, err


def start(*args: str) -> tuple[Run, int]:
    """Run the CLI; returns it and its port, from the `listening on` line."""
    run = Run(*args)
    first = run.line(20)
    assert first.startswith("listening on 127.0.0.1:"), first
    return run, int(first.rsplit(":", 1)[1])


def test_sigterm_prints_byte_counts_as_json(echo):
    run, port = start("--upstream", echo.address, "--latency-ms", "5", "--json")
    with connect(port) as sock:
        sock.sendall(b"a" * 1000)
        assert recv_exactly(sock, 1000) == b"a" * 1000
    run.proc.send_signal(signal.SIGTERM)
    out, err = run.finish()
    assert run.proc.returncode == 0, err
    stats = json.loads(out)
    assert (stats["up_bytes"], stats["down_bytes"], stats["connections_accepted"]) == (1000, 1000, 1)
    assert stats["connections_reset"] == 0 and stats["up"]["latency_ms"] == 5.0
    assert "accepted conn=1" in err  # the event log


def test_a_scenario_with_end_stops_by_itself(echo, tmp_path):
    scenario = tmp_path / "s.json"
    scenario.write_text(json.dumps([{"at": 0.1, "event": "stall"}, {"at": 0.2, "event": "restore"},
                                    {"at": 0.3, "event": "end"}]))  # fmt: skip
    run, _ = start("--upstream", echo.address, "--scenario", str(scenario), "--quiet")
    out, err = run.finish()
    assert run.proc.returncode == 0, err
    assert out.strip() == "up 0 bytes, down 0 bytes; connections: 0 accepted, 0 reset, 0 refused, 0 failed"
    assert err == ""


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text('[{"at": 1, "event": "explode"}]')
    assert main(["--scenario", str(bad)]) == 2
    assert "tether-netsim: error: " in capsys.readouterr().err
    assert main(["--listen", "nowhere"]) == 2
    assert "expected HOST:PORT, got 'nowhere'" in capsys.readouterr().err
    assert main(["--latency-ms", "-5"]) == 2
    assert "latency_ms must be a number >= 0" in capsys.readouterr().err
    assert main(["--scenario", str(tmp_path / "missing.json")]) == 2
    assert "missing.json" in capsys.readouterr().err


def test_console_script_has_useful_help():
    exe = Path(sys.executable).parent / "tether-netsim"
    out = subprocess.run([str(exe), "--help"], check=True, capture_output=True, text=True, timeout=30).stdout
    for word in ("--listen", "--upstream", "--latency-ms", "--jitter-ms", "--bandwidth-kbps", "--scenario", "--json"):
        assert word in out
