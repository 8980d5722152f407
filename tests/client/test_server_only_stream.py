"""A server-only Generate stream (ServerOnlySession) against a stub that keeps gRPC's deadline rule: a long
generation is read to its end whatever it lasts, and a stream that stops sending is a stalled link, not a hang."""

import threading
from types import SimpleNamespace

import grpc
import pytest

from tether.client.outage import Cause
from tether.client.server_only import ServerOnlySession
from tether.client.session_types import ClientConfig
from tether.client.transport import LinkDown
from tether.v1 import tether_pb2 as pb

CHUNK_S = 1.0  # the stub's clock: each chunk takes this long to come


class DeadlineExceeded(grpc.RpcError, grpc.Call):
    def code(self):
        return grpc.StatusCode.DEADLINE_EXCEEDED

    def details(self):
        return "Deadline Exceeded"

    def trailing_metadata(self):
        return ()


class Call:
    """A Generate call of `chunks` one-token chunks on a virtual clock: past `timeout` (the call's deadline, as gRPC
    enforces one) it fails; after `stall_after` chunks it sends nothing more until cancelled."""

    def __init__(self, chunks: int, timeout: float | None, stall_after: int | None):
        self.chunks, self.timeout, self.stall_after = chunks, timeout, stall_after
        self.cancelled = threading.Event()

    def __iter__(self):
        for i in range(self.chunks):
            if self.stall_after is not None and i >= self.stall_after:
                self.cancelled.wait(30)  # bounded: a client that never gives up gets a short text, and fails
                return
            if self.timeout is not None and (i + 1) * CHUNK_S > self.timeout:
                raise DeadlineExceeded()
            yield pb.GeneratedTokens(tokens=[i % 50])

    def cancel(self):
        self.cancelled.set()


class Stub:
    def __init__(self, chunks: int, stall_after: int | None = None):
        self.chunks, self.stall_after, self.calls = chunks, stall_after, []

    def Generate(self, request, metadata=(), timeout=None):
        self.calls.append(Call(self.chunks, timeout, self.stall_after))
        return self.calls[-1]


def session(stub: Stub, **cfg) -> ServerOnlySession:
    config = ClientConfig(max_new_tokens=stub.chunks, **cfg)
    return ServerOnlySession(stub, (), config, pb.ModelInfo(), SimpleNamespace(vocab_size=100), stop_ids=())


def test_a_generation_longer_than_any_fixed_deadline_is_read_to_its_end():
    stub = Stub(chunks=400)  # 400 s on the stub's clock
    result = session(stub).run([1, 2, 3])
    assert result.token_ids == [i % 50 for i in range(400)]
    assert stub.calls[0].cancelled.is_set()  # the call is closed when the text ends


def test_a_stream_that_stops_sending_is_a_stalled_link():
    stub = Stub(chunks=10, stall_after=3)
    with pytest.raises(LinkDown) as e:
        session(stub, round_timeout_s=0.2).run([1, 2, 3])
    assert e.value.cause == Cause.STALLED
    assert stub.calls[0].cancelled.is_set()  # and its call is cancelled: the server frees the generation
