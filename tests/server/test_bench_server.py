"""Smoke test of bench/server.py: a tiny run of each mode against the in-process server, checking the JSON record's
fields and counts (never its timings)."""

import asyncio

import grpc
import pytest
from bench_modules import load_bench
from toy_models import toy_model_flags

pytestmark = pytest.mark.heavy  # a long file, started first (tests/conftest.py)


@pytest.fixture(scope="module")
def bench():
    return load_bench("server")


def test_random_rounds_record(bench):
    record = bench.main(["--device", "cpu", "--clients", "1", "3", "--rounds", "2", "--warmup-rounds", "1",
                         "--k", "3", "--prompt-len", "16", "--channels", "2", "--timeout", "120",
                         *toy_model_flags()])  # fmt: skip
    assert record["bench"] == "server" and record["mode"] == "random" and record["torch"]
    assert record["args"]["clients"] == [1, 3] and record["args"]["k"] == 3
    one, three = record["rows"]
    for row, n in ((one, 1), (three, 3)):
        assert row["clients"] == n and row["rounds"] == 2 * n
        assert row["rounds_per_s"] > 0 and row["scored_tokens_per_s"] == pytest.approx(4 * row["rounds_per_s"])
        assert row["tau"] >= 1 and row["accepted_tokens_per_s"] >= row["rounds_per_s"]
        assert 0 < row["p50_ms"] <= row["p99_ms"] <= row["max_ms"]
        assert 1 <= row["mean_batch"] <= n and row["server_verify_ms"] > 0
        assert row["server_cpu_s"] > 0 and row["server_cpu_ms_per_round"] > 0 and row["wall_s"] > 0
    assert one["speedup"] == 1.0 and three["speedup"] > 0


def test_clients_resync_when_the_server_evicts_their_sessions(bench):
    """Three clients, two sessions held: an open or a resync evicts the least recently used idle session, whose next
    round is refused (REASON_SESSION_EVICTED); its client resyncs with the full history, attaches and goes on. After
    the warm-up at most two of the three sessions are held, so the timed rounds see a resync whatever the timing."""
    argv = ["--device", "cpu", "--clients", "3", "--rounds", "3", "--warmup-rounds", "1", "--k", "3", "--prompt-len",
            "16", "--max-sessions", "2", "--timeout", "120"]  # fmt: skip
    record = bench.main([*argv, *toy_model_flags()])
    (row,) = record["rows"]
    assert record["args"]["max_sessions"] == 2 and row["clients"] == 3
    assert row["rounds"] == 9 and row["tau"] >= 1  # every client sent every round: none died
    assert row["resyncs"] >= 1 and row["evicted"] >= row["resyncs"] and row["capacity_retries"] >= 0


def test_random_rounds_through_a_front_end_process(bench):
    """--frontends: the same rounds, gRPC in another process; its CPU time is counted as the server's."""
    record = bench.main(["--device", "cpu", "--clients", "2", "--rounds", "2", "--warmup-rounds", "1", "--k", "3",
                         "--prompt-len", "16", "--frontends", "1", "--timeout", "120", *toy_model_flags()])  # fmt: skip
    (row,) = record["rows"]
    assert record["args"]["frontends"] == 1 and row["clients"] == 2 and row["rounds"] == 4
    assert row["tau"] >= 1 and row["mean_batch"] >= 1 and row["server_cpu_ms_per_round"] > 0


def test_generate_streams_record(bench):
    record = bench.main(["--mode", "generate", "--device", "cpu", "--clients", "2", "--tokens", "6",
                         "--prompt-len", "8", "--timeout", "120", *toy_model_flags()])  # fmt: skip
    (row,) = record["rows"]
    assert record["mode"] == "generate" and row["clients"] == 2 and row["tokens"] == 12
    assert row["tokens_per_s"] > 0 and row["tokens_per_s_per_stream"] > 0 and row["speedup"] == 1.0
    assert 0 < row["ttft_p50_ms"] <= row["ttft_p99_ms"] and row["server_cpu_ms_per_token"] > 0


def test_trace_record_and_replay(bench, tmp_path):
    path = tmp_path / "traces.json"
    out = bench.main(["--device", "cpu", "--record-traces", str(path), "--prompts", "2", "--prompt-len", "32",
                      "--trace-tokens", "16", "--k", "4", *toy_model_flags()])  # fmt: skip
    assert out["bench"] == "traces" and out["prompts"] == 2 and out["tau"] >= 1
    recorded = bench.sibling("traces").load(path)
    assert recorded["format"] == "tether-draft-traces" and recorded["version"] == 1
    assert recorded["k"] == 4 and recorded["temperature"] == 0.0 and recorded["prompt_len"] == 32
    assert recorded["tokens"] == 16 and len(recorded["target_fingerprint"]) == 64 and recorded["drafter"] == "drafter"
    assert len(recorded["traces"]) == 2
    for t in recorded["traces"]:
        assert t["source"].endswith(".py") and t["offset"] >= 0 and len(t["prompt"]) == 32
        root = t["first"]
        for r in t["rounds"]:  # each round is rooted at the last one's bonus
            assert r["root"] == root and len(r["drafts"]) <= 4 and 0 <= r["accepted"] <= len(r["drafts"])
            root = r["bonus"]
        assert 1 + sum(r["accepted"] + 1 for r in t["rounds"]) == 16  # the first token, then each round's tau

    record = bench.main(["--device", "cpu", "--mode", "trace", "--traces", str(path), "--clients", "1", "2",
                         "--rounds", "3", "--warmup-rounds", "1", "--timeout", "120", *toy_model_flags()])  # fmt: skip
    assert record["mode"] == "trace" and record["traces"]["prompts"] == 2 and record["traces"]["k"] == 4
    for row, n in zip(record["rows"], (1, 2), strict=True):
        assert row["clients"] == n and row["rounds"] == 3 * n and row["reopens"] >= 0
        assert row["tau"] >= 1 and row["tau_recorded"] >= 1 and 0 <= row["trace_match"] <= 1
        assert row["accepted_tokens_per_s"] == pytest.approx(row["tau"] * row["rounds_per_s"])
        assert 0 < row["p50_ms"] <= row["p99_ms"] <= row["max_ms"] and 1 <= row["mean_batch"] <= n


def test_each_client_channel_is_a_connection_of_its_own():
    """The clients' channels reach the server as separate TCP connections (distinct peers), as separate clients
    would: on one shared connection, SO_REUSEPORT would hand every client of a process to one front end."""
    clients = load_bench("server_clients")

    async def run() -> set[str]:
        peers: set[str] = set()

        async def echo(request: bytes, context) -> bytes:
            peers.add(context.peer())
            return request

        server = grpc.aio.server()
        handler = grpc.method_handlers_generic_handler("t.T", {"Echo": grpc.unary_unary_rpc_method_handler(echo)})
        server.add_generic_rpc_handlers((handler,))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        channels = clients.open_channels(f"127.0.0.1:{port}", 5)
        try:
            for ch in channels:
                assert await ch.unary_unary("/t.T/Echo")(b"x", timeout=30) == b"x"
        finally:
            for ch in channels:
                await ch.close()
            await server.stop(None)
        return peers

    assert len(asyncio.run(run())) == 5


def test_a_generate_load_client_refused_for_capacity_tries_again(monkeypatch):
    """bench/link.py's --load full on the CPU fills the KV pool: a stream refused for REASON_CAPACITY is tried again
    after the server's advice and counted; it used to end every client of the load's process (the cells after it
    then ran on an idle server). The client's clock is virtual: it ends when the stream after the refusal ends."""
    from types import SimpleNamespace

    from google.protobuf import any_pb2
    from google.rpc import status_pb2

    from tether.v1 import tether_pb2 as pb

    clients = load_bench("server_clients")
    detail = any_pb2.Any()
    detail.Pack(pb.ErrorDetail(reason=pb.REASON_CAPACITY, retry_after_ms=1))
    status = status_pb2.Status(code=grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], details=[detail])
    full = grpc.aio.AioRpcError(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.aio.Metadata(),
        grpc.aio.Metadata(("grpc-status-details-bin", status.SerializeToString())),
        "the KV pool is full; try again shortly",
    )
    clock = SimpleNamespace(now=0.0)
    monkeypatch.setattr(clients, "time", SimpleNamespace(perf_counter=lambda: clock.now))

    class Call:
        def __init__(self, refused: bool):
            self.refused, self.messages = refused, [pb.GeneratedTokens(tokens=[1, 2])]

        async def read(self):
            if self.refused:
                raise full
            if self.messages:
                return self.messages.pop()
            clock.now = 100.0  # the stream after the refusal ended: the client's time is up
            return grpc.aio.EOF

        def cancel(self) -> None:
            pass

    class Stub:
        calls = 0

        def Generate(self, req, timeout):
            self.calls += 1
            return Call(refused=self.calls == 1)

    stub = Stub()
    args = SimpleNamespace(rtt_ms=0.0, tokens=2, timeout=10.0)
    out = asyncio.run(asyncio.wait_for(clients.generate_until(stub, args, lambda: [5], "", 10.0), 30))
    assert stub.calls == 2 and out["capacity_retries"] == 1 and out["tokens"] == 2 and out["streams"] == 2
