"""A link cut at the client's first contact is an outage: the client backs off and tries again within its connect
deadline, and never takes the resets for "an HTTP server" (tether.client.transport.first_contact, diagnose).

A gRPC server answering GetModelInfo sits behind a netsim proxy on 127.0.0.1 that is cut before the first contact
(every connection reset at once). The proxy is restored when the client makes its second attempt (an event: the
call itself, not a clock), which a client that gave up after the first never makes.
"""

import random
import time
from concurrent import futures

import grpc
import pytest

from tether.client.transport import Backoff, Hint, diagnose, first_contact
from tether.netsim.proxy import NetSimThread
from tether.v1 import tether_pb2 as pb
from tether.v1 import tether_pb2_grpc

MAX_ATTEMPTS = 50  # a bound on the loop, far above the few attempts the restored link needs


class InfoOnly(tether_pb2_grpc.TetherServicer):
    def GetModelInfo(self, request, context):
        return pb.ModelInfo(protocol_version=1, model_id="behind-a-cut-link")


@pytest.fixture
def cut_link():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    tether_pb2_grpc.add_TetherServicer_to_server(InfoOnly(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    sim = NetSimThread("127.0.0.1:0", f"127.0.0.1:{port}")
    sim.start()
    sim.cut()
    try:
        yield sim
    finally:
        sim.stop()
        server.stop(None)


def test_a_reset_is_no_answer_from_an_http_server(cut_link):
    assert diagnose(f"127.0.0.1:{cut_link.port}", tls=False) is None


def test_a_link_cut_at_first_contact_is_retried_until_it_is_back(cut_link):
    address = f"127.0.0.1:{cut_link.port}"
    channel = grpc.insecure_channel(address, options=[("grpc.initial_reconnect_backoff_ms", 10),
                                                      ("grpc.min_reconnect_backoff_ms", 10)])  # fmt: skip
    stub = tether_pb2_grpc.TetherStub(channel)
    attempts = []

    def ask() -> pb.ModelInfo:
        attempts.append(1)
        assert len(attempts) <= MAX_ATTEMPTS
        if len(attempts) == 2:
            cut_link.restore()  # the client tried again after its first attempt failed: the link comes back
        return stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=5)

    hints = []
    try:
        info = first_contact(ask, Backoff(0.01, 0.05, 0.0, random.Random(0)), address=address, tls=False,
                             deadline=time.monotonic() + 60, on_wait=hints.append)  # fmt: skip
    finally:
        channel.close()
    assert info.model_id == "behind-a-cut-link"
    assert len(attempts) >= 2 and Hint.NOT_GRPC not in hints
    assert cut_link.stats().connections_refused >= 1
