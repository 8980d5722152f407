"""`tether-server serve --frontends 2`: the command's path to front-end processes, start to SIGTERM."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import grpc
from toy_models import toy_model_flags

from tether.v1 import tether_pb2 as pb
from tether.v1 import tether_pb2_grpc


def children(pid: int) -> list[int]:
    """The processes `pid` started, from any of its threads (Linux lists each thread's own)."""
    tasks = Path(f"/proc/{pid}/task")
    return [int(c) for t in tasks.iterdir() for c in (t / "children").read_text().split()]


def test_serve_with_front_ends_answers_then_stops_them_all_on_sigterm():
    exe = Path(sys.executable).parent / "tether-server"
    cmd = [str(exe), "serve", *toy_model_flags(), "--port", "0", "--device", "cpu", "--frontends", "2", "--log-level",
           "warning"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline().strip()
        assert line.startswith("listening on 127.0.0.1:") and line.endswith("(2 front-end processes)"), line
        address = line.removeprefix("listening on ").split(" ")[0]
        fronts = children(proc.pid)
        assert len(fronts) == 2
        with grpc.insecure_channel(address) as channel:
            info = tether_pb2_grpc.TetherStub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=120)
        assert info.tli_layers == 3 and len(info.model_fingerprint) == 64
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0
        assert "stopped" in proc.stdout.read()
        for pid in fronts:  # reaped by the engine: no process of that id is left (nor a zombie)
            assert not os.path.exists(f"/proc/{pid}") or "Z" not in open(f"/proc/{pid}/stat").read().split()[2]
    finally:
        proc.kill()
