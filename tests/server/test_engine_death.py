"""An engine process dies under `tether-server serve --engines 3 --frontends 1`: the server serves on with the
others, grpc.health.v1 says capacity was lost (tether.server.engine_health), and a front end killed afterwards is
replaced by one that links to the live engines alone (no crash loop) and serves the survivors' sessions.

The command runs on the CPU, start to SIGTERM; the deaths are os.kill on the processes' ids. Every wait is a bounded
poll on something observable (until's bound is only a safety net); nothing asserts a duration.
"""

import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from test_engines import drain
from test_frontends import Stream, until
from test_serve_frontends import children
from toy_models import toy_model_flags

from tether.server.engine_health import CAPACITY_NAME, engine_name, statuses
from tether.server.rpc_server import SERVICE_NAME
from tether.shared.ids import engine_of
from tether.v1 import tether_pb2 as pb
from tether.v1 import tether_pb2_grpc

pytestmark = pytest.mark.heavy  # a long file, started first (tests/conftest.py)

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


def test_health_names_say_serving_while_any_engine_lives_and_full_capacity_only_while_all_do():
    assert statuses([True, True]) == {"": SERVING, SERVICE_NAME: SERVING, CAPACITY_NAME: SERVING,
                                      engine_name(0): SERVING, engine_name(1): SERVING}  # fmt: skip
    lost = statuses([True, False])
    assert lost[""] == lost[SERVICE_NAME] == lost[engine_name(0)] == SERVING
    assert lost[CAPACITY_NAME] == lost[engine_name(1)] == NOT_SERVING
    none = statuses([False, False])
    assert none[""] == none[SERVICE_NAME] == none[CAPACITY_NAME] == NOT_SERVING


def health(address: str) -> dict[str, int] | None:
    """Every name's status as the front end at `address` answers now (None while none answers)."""
    names = ["", SERVICE_NAME, CAPACITY_NAME] + [engine_name(k) for k in range(3)]
    try:
        with grpc.insecure_channel(address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            return {n: stub.Check(health_pb2.HealthCheckRequest(service=n), timeout=10).status for n in names}
    except grpc.RpcError:
        return None


def role(pid: int) -> str:
    """'engine K' or 'frontend', from the process's command line."""
    args = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    if "tether.server.engines" in args:
        return f"engine {args[args.index('--index') + 1]}"
    return "frontend" if "tether.server.frontend" in args else "?"


def live_children(pid: int) -> dict[str, list[int]]:
    """The serving process's children by role, zombies left out."""
    out: dict[str, list[int]] = {}
    for child in children(pid):
        try:
            if Path(f"/proc/{child}/stat").read_text().split()[2] != "Z":
                out.setdefault(role(child), []).append(child)
        except (FileNotFoundError, ProcessLookupError):
            pass
    return out


def open_on(stub, opening: pb.ClientMessage, k: int) -> pb.Opened:
    """A session on engine k (streams are opened and held until one lands there; the streams then end)."""
    streams = []
    try:
        for _ in range(6):
            streams.append(Stream(stub))
            opened = streams[-1].send(opening).opened
            if engine_of(opened.session_id, 3) == k:
                return opened
        raise AssertionError(f"no session opened on engine {k}")
    finally:
        for s in streams:
            s.close()


def test_after_an_engine_dies_a_replaced_front_end_serves_the_survivors_and_health_reports_lost_capacity():
    exe = Path(sys.executable).parent / "tether-server"
    cmd = [str(exe), "serve", *toy_model_flags(), "--port", "0", "--device", "cpu", "--log-level", "warning",
           "--engines", "3", "--frontends", "1"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline().strip()
        assert line.startswith("listening on 127.0.0.1:"), line
        address = line.removeprefix("listening on ").split(" ")[0]
        errors: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [errors.put(x) for x in proc.stderr], daemon=True).start()
        procs = live_children(proc.pid)
        (front,), (doomed,) = procs["frontend"], procs["engine 2"]
        assert until(lambda: health(address), "health answered")[CAPACITY_NAME] == SERVING
        with grpc.insecure_channel(address) as channel:
            stub = tether_pb2_grpc.TetherStub(channel)
            info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=120)
            opening = pb.ClientMessage(open=pb.OpenSession(prompt=[5, 6, 7], max_new_tokens=8,
                                                           model_fingerprint=info.model_fingerprint))  # fmt: skip
            survivor = open_on(stub, opening, 1)  # held by engine 1, which lives on

        os.kill(doomed, signal.SIGKILL)
        lost = until(lambda: (h := health(address)) and h[CAPACITY_NAME] == NOT_SERVING and h, "capacity lost")
        assert lost[""] == lost[SERVICE_NAME] == lost[engine_name(0)] == lost[engine_name(1)] == SERVING
        assert lost[engine_name(2)] == NOT_SERVING

        os.kill(front, signal.SIGKILL)
        replaced = lambda: [p for p in live_children(proc.pid).get("frontend", []) if p != front]  # noqa: E731
        (replacement,) = until(replaced, "a front end started again")
        again = until(lambda: health(address), "the replacement answers health")
        assert again == lost  # it starts knowing engine 2 is gone
        with grpc.insecure_channel(address) as channel:
            stub = tether_pb2_grpc.TetherStub(channel)
            stream = Stream(stub)
            attach = pb.AttachSession(session_id=survivor.session_id, resume_token=survivor.resume_token)
            attached = stream.send(pb.ClientMessage(attach=attach)).attached
            assert (attached.session_id, attached.root) == (survivor.session_id, survivor.first_token)
            stream.close()
            streams = [Stream(stub) for _ in range(4)]
            try:
                ids = [s.send(opening).opened.session_id for s in streams]
            finally:
                for s in streams:
                    s.close()
        assert {engine_of(sid, 3) for sid in ids} == {0, 1}  # new sessions go to the live engines alone
        assert live_children(proc.pid)["frontend"] == [replacement]  # the same one: no crash loop
        restarts = [x for x in drain(errors, []) if "starting another" in x]
        assert len(restarts) == 1, restarts

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0
    finally:
        proc.kill()
        proc.communicate()
