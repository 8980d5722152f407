"""A real gRPC server behind netsim: calls go through, fail with UNAVAILABLE under a cut, time out under a stall,
and succeed again after restore."""

from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tether.netsim.proxy import NetSimThread

# Reconnect quickly after a cut: the default backoff (1 s, growing to 120 s) would outlast the test.
FAST_RECONNECT = [
    ("grpc.initial_reconnect_backoff_ms", 50),
    ("grpc.min_reconnect_backoff_ms", 50),
    ("grpc.max_reconnect_backoff_ms", 200),
]
SERVING = health_pb2.HealthCheckResponse.SERVING


@pytest.fixture
def health_server():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(grace=None)


def check(stub, **kwargs) -> int:
    return stub.Check(health_pb2.HealthCheckRequest(), **kwargs).status


def test_health_check_through_cut_stall_and_restore(health_server):
    with NetSimThread("127.0.0.1:0", health_server) as sim:
        with grpc.insecure_channel(sim.address, options=FAST_RECONNECT) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            assert check(stub, timeout=5) == SERVING

            sim.cut()
            for _ in range(3):  # on the reset connection, then on new ones the proxy refuses: all UNAVAILABLE
                with pytest.raises(grpc.RpcError) as err:
                    check(stub, timeout=10)  # refused at once; the deadline only bounds a broken proxy
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE

            sim.restore()  # the same channel reconnects (wait_for_ready rides out its backoff)
            assert check(stub, timeout=5, wait_for_ready=True) == SERVING

            sim.stall()
            with pytest.raises(grpc.RpcError) as err:
                check(stub, timeout=0.3)
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            sim.restore()
            assert check(stub, timeout=5) == SERVING

        stats = sim.stats()
    assert stats.connections_reset == 1
    assert stats.up_bytes > 0 and stats.down_bytes > 0
