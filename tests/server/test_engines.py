"""Several engines behind the front ends (`serve --engines E`, tether.server.engines): the routing of each call to the
engine that holds its session, and the command's path to engine processes.

In process: two services (engine 0 served by make_server with one front end, engine 1 on an EngineSocket on the
same loop), so the front end routes between two session tables as it does between two processes. Then the command:
`tether-server serve --engines 2 --frontends 1` on the CPU, start to SIGTERM. Every wait is a bounded poll on
something observable; nothing asserts a duration.
"""

import asyncio
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
from test_frontends import BOUND_S, Stream, service_for, until
from test_serve_frontends import children
from test_service import FP, VOCAB, open_msg, plain, run_session, to_delta
from tiny_models import tiny_moa_drafter, tiny_target
from toy_models import toy_model_flags

from tether.server.engines import EngineSocket, engine_share
from tether.server.launch import LaunchPlan, listen
from tether.server.serve_config import ServeConfig
from tether.shared.ids import engine_of, is_session_id, new_session_id
from tether.shared.tokenizer import Tokenizer
from tether.v1 import tether_pb2 as pb
from tether.v1 import tether_pb2_grpc


@pytest.fixture(scope="module")
def engines():
    target = tiny_target(vocab_size=VOCAB)
    drafter = tiny_moa_drafter(target)
    tok = Tokenizer.train(texts=["def f(x):\n    return x\n"] * 20, vocab_size=260)
    services = [service_for(target, drafter, tok, engine=k) for k in (0, 1)]
    folder = tempfile.mkdtemp(prefix="te-")  # a short path: Unix socket paths are limited to ~100 bytes
    handle, other = None, None
    try:
        from tether.server.rpc_server import event_loop

        other = EngineSocket(services[1], event_loop(), str(Path(folder) / "e1.sock"))
        asyncio.run_coroutine_threadsafe(other.start(), other.loop).result(timeout=BOUND_S)
        handle, port = listen(services[0], "127.0.0.1:0", LaunchPlan(frontends=1), engine_sockets=[other.path])
        handle.start()
        until(lambda: len(other.connections) == 1, "the front end linked to engine 1")
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield SimpleNamespace(target=target, drafter=drafter, services=services, other=other, port=port,
                                  stub=tether_pb2_grpc.TetherStub(channel))  # fmt: skip
    finally:
        try:
            if handle is not None:
                handle.stop(None)
            if other is not None:
                asyncio.run_coroutine_threadsafe(other.stop(), other.loop).result(timeout=BOUND_S)
        finally:
            for s in services:
                s.engine.close()
            shutil.rmtree(folder, ignore_errors=True)


def holder(engines, session_id: str) -> int:
    """Which service holds the session (exactly one must)."""
    (k,) = [k for k, s in enumerate(engines.services) if session_id in s.engine.sessions]
    return k


def test_session_ids_carry_their_engine_and_stay_session_ids():
    for k in (0, 1, 17, 255):
        sid = new_session_id(k)
        assert is_session_id(sid) and engine_of(sid, 256) == k
    assert engine_of(new_session_id(3), 3) is None  # past the engines there are
    assert engine_of("zz" + "0" * 30, 2) is None and engine_of("01", 2) is None and engine_of("", 2) is None
    with pytest.raises(ValueError):
        new_session_id(256)


def test_each_engine_gets_an_even_share_of_the_pool_and_the_limits_and_only_the_first_the_http_api():
    cfg = ServeConfig(engines=3, kv_pool_mb=1000, max_sessions=256, max_sessions_per_key=64, metrics_port=9100,
                      http_port=8000, onnx_precisions="fp32")  # fmt: skip
    first, third = engine_share(cfg, 0), engine_share(cfg, 2)
    assert (first.kv_pool_mb, first.max_sessions, first.max_sessions_per_key) == (333, 86, 22)
    assert first.max_model_calls_per_caller == third.max_model_calls_per_caller == 43  # of 128
    assert (first.metrics_port, first.http_port, first.onnx_precisions) == (9100, 8000, "fp32")
    assert (third.metrics_port, third.http_port, third.onnx_precisions) == (9102, -1, "")
    assert engine_share(ServeConfig(), 0) == ServeConfig()


def test_streams_open_on_the_least_busy_engine_and_each_session_stays_on_its_engine(engines):
    prompt = [1, 2, 3, 4, 5, 6, 0, 1]
    streams = [Stream(engines.stub) for _ in range(4)]
    try:
        ids = [s.send(open_msg(prompt)).opened.session_id for s in streams]  # each held open while the next opens
    finally:
        for s in streams:
            s.close()
    assert [holder(engines, sid) for sid in ids] == [0, 1, 0, 1]
    assert [engine_of(sid, 2) for sid in ids] == [0, 1, 0, 1]
    out, sid, *_ = run_session(engines.stub, engines.drafter, prompt, 24, repeat_every=3)
    assert out == plain(engines.target, prompt, len(out))


def open_on(engines, k: int, prompt: list[int]):
    """A stream whose session engine k holds (streams are opened, held, until one lands there)."""
    held = []
    try:
        for _ in range(4):
            s = Stream(engines.stub)
            opened = s.send(open_msg(prompt)).opened
            if engine_of(opened.session_id, 2) == k:
                return s, opened
            held.append(s)
        raise AssertionError(f"no session opened on engine {k}")
    finally:
        for s in held:
            s.close()


def test_attach_resync_and_close_reach_the_engine_that_holds_the_session(engines):
    prompt = [3, 1, 4, 1, 5]
    drafter = engines.drafter
    stream, opened = open_on(engines, 1, prompt)
    drafter.begin(to_delta(opened.delta))
    root = opened.first_token
    drafts, _, _ = drafter.draft(root, 3)
    v = stream.send(pb.ClientMessage(round=pb.DraftRound(round=1, root=root, tokens=drafts))).verdict
    drafter.commit(to_delta(v.delta))
    out, root = [opened.first_token] + drafts[: v.accepted] + [v.bonus], v.bonus
    stream.close()

    with grpc.insecure_channel(f"127.0.0.1:{engines.port}") as channel:  # a new connection, as after a drop
        again = Stream(tether_pb2_grpc.TetherStub(channel))
        attach = pb.AttachSession(session_id=opened.session_id, resume_token=opened.resume_token)
        attached = again.send(pb.ClientMessage(attach=attach)).attached
        assert (attached.verified_length, attached.root, attached.last_round) == (len(prompt) + len(out) - 1, root, 1)
        again.close()

    V = len(prompt) + len(out) - 1
    resync = pb.ResyncRequest(session_id=opened.session_id, resume_token=opened.resume_token, verified_length=V,
                              offline_tokens=[root], model_fingerprint=FP)  # fmt: skip
    reply = engines.stub.Resync(resync, timeout=BOUND_S)  # held: extended in place (no history needed)
    assert reply.session_id == opened.session_id and holder(engines, opened.session_id) == 1

    engines.stub.Close(pb.CloseRequest(session_id=opened.session_id), timeout=BOUND_S)
    assert all(opened.session_id not in s.engine.sessions for s in engines.services)


def test_an_engine_gone_ends_its_streams_unavailable_and_its_sessions_are_rebuilt_on_a_live_one(engines):
    """Last of the module's in-process tests: engine 1 stays unlinked after it."""
    prompt = [2, 6, 1, 5]
    stream, opened = open_on(engines, 1, prompt)
    other = engines.other
    for conn in list(other.connections.values()):  # as if engine 1's process died
        other.loop.call_soon_threadsafe(conn.transport.close)
    with pytest.raises(grpc.RpcError) as e:
        stream.send(pb.ClientMessage(round=pb.DraftRound(round=1, root=opened.first_token, tokens=[1, 2])))
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    stream.close()

    V = len(prompt)  # the client's verified history: the prompt; the first token is its offline root
    resync = pb.ResyncRequest(session_id=opened.session_id, resume_token=opened.resume_token, verified_length=V,
                              offline_tokens=[opened.first_token], history=prompt, model_fingerprint=FP)  # fmt: skip
    reply = engines.stub.Resync(resync, timeout=BOUND_S)
    assert engine_of(reply.session_id, 2) == 0 and holder(engines, reply.session_id) == 0
    streams = [Stream(engines.stub) for _ in range(2)]  # new sessions all go to the live engine now
    try:
        ids = [s.send(open_msg(prompt)).opened.session_id for s in streams]
    finally:
        for s in streams:
            s.close()
    assert [engine_of(sid, 2) for sid in ids] == [0, 0]


# ---- the command -------------------------------------------------------------------------------------------------


def serve(*flags: str) -> subprocess.Popen:
    exe = Path(sys.executable).parent / "tether-server"
    cmd = [str(exe), "serve", *toy_model_flags(), "--port", "0", "--device", "cpu", "--log-level", "warning", *flags]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_serve_with_two_engines_routes_sessions_to_both_then_stops_every_process_on_sigterm():
    proc = serve("--engines", "2", "--frontends", "1")
    try:
        line = proc.stdout.readline().strip()
        assert line.startswith("listening on 127.0.0.1:") and line.endswith("(1 front-end processes, 2 engine "
                                                                            "processes)"), line  # fmt: skip
        address = line.removeprefix("listening on ").split(" ")[0]
        procs = children(proc.pid)
        assert len(procs) == 2  # engine 1 and the front end
        with grpc.insecure_channel(address) as channel:
            stub = tether_pb2_grpc.TetherStub(channel)
            info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=120)
            opening = pb.ClientMessage(open=pb.OpenSession(prompt=[5, 6, 7], max_new_tokens=8,
                                                           model_fingerprint=info.model_fingerprint))  # fmt: skip
            streams = [Stream(stub) for _ in range(2)]
            try:
                ids = [s.send(opening).opened.session_id for s in streams]
            finally:
                for s in streams:
                    s.close()
        assert sorted(engine_of(sid, 2) for sid in ids) == [0, 1]
        (engine,) = [pid for pid in procs if "tether.server.engines" in Path(f"/proc/{pid}/cmdline").read_text()]
        os.kill(engine, signal.SIGKILL)  # engine 1 dies: logged, and engine 0 serves on
        errors: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [errors.put(line) for line in proc.stderr], daemon=True).start()
        seen: list[str] = []
        until(lambda: any("engine 1 exited" in line for line in drain(errors, seen)), "the death logged")
        with grpc.insecure_channel(address) as channel:  # engine 0 serves on (routing around the dead one: above)
            again = tether_pb2_grpc.TetherStub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=120)
            assert again.model_fingerprint == info.model_fingerprint
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0
        assert "stopped" in proc.stdout.read()
        for pid in procs:
            until(lambda pid=pid: not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text()
                  .split()[2], f"process {pid} gone")  # fmt: skip
    finally:
        proc.kill()
        proc.communicate()


def drain(lines: queue.Queue, seen: list[str]) -> list[str]:
    """Every line read so far (those waiting in `lines` added to `seen`)."""
    while not lines.empty():
        seen.append(lines.get_nowait())
    return seen


def test_serve_refuses_engines_without_front_ends_with_one_line():
    proc = serve("--engines", "2")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2 and "--engines E > 1 needs --frontends" in err and not out
