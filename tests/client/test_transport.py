"""The client's one backoff policy (tether.client.transport.Backoff), which paces the connect loop, the weight
download's retries and reconnection: delays double up to the cap with jitter, a full server's advice is followed
when longer, and `retry` stops at its attempts or deadline with the error the caller chose. No sleeping: the pauses
are recorded."""

import random

import grpc
import pytest

from tether.client import transport
from tether.client.refusals import Refusal
from tether.client.transport import Backoff, LinkDown, ServerBusy, ServerError, parse_endpoints
from tether.v1 import tether_pb2 as pb


@pytest.fixture
def pauses(monkeypatch) -> list[float]:
    slept: list[float] = []
    monkeypatch.setattr(transport.time, "sleep", slept.append)
    return slept


def failing(errors: list[Exception], result="done"):
    """A call that raises each of `errors` in turn, then returns `result`."""
    left = list(errors)

    def call():
        if left:
            raise left.pop(0)
        return result

    return call


def test_retry_pauses_twice_as_long_each_time_up_to_the_cap_with_jitter(pauses):
    backoff = Backoff(0.1, 0.5, 0.2, random.Random(0))
    assert backoff.retry(failing([ConnectionError("reset")] * 5)) == "done"
    assert len(pauses) == 5
    for pause, delay in zip(pauses, [0.1, 0.2, 0.4, 0.5, 0.5], strict=True):
        assert 0.8 * delay <= pause <= 1.2 * delay
    backoff.reset()
    assert backoff.delay == 0.1 and backoff.fresh().delay == 0.1


def test_retry_gives_up_after_its_attempts_with_the_typed_error(pauses):
    seen = []
    with pytest.raises(LinkDown, match="reset"):
        Backoff(0.1, 0.5, 0.0, random.Random(0)).retry(failing([ConnectionError("reset")] * 3), attempts=3,
                                                       on_retry=seen.append)  # fmt: skip
    assert len(pauses) == len(seen) == 2


def test_retry_raises_a_refusal_retrying_cannot_fix_at_once(pauses):
    with pytest.raises(ServerError):
        Backoff(0.1, 0.5, 0.0, random.Random(0)).retry(failing([ServerError(grpc.StatusCode.PERMISSION_DENIED, "no")]))
    assert pauses == []


def test_retry_stops_before_the_deadline_and_raises_what_give_up_makes(pauses):
    with pytest.raises(ServerError, match="gave up"):
        Backoff(10.0, 10.0, 0.0, random.Random(0)).retry(
            failing([LinkDown("down")]), deadline=transport.time.monotonic() + 1.0,
            give_up=lambda e: ServerError(grpc.StatusCode.UNAVAILABLE, f"gave up: {e}"))  # fmt: skip
    assert pauses == []


def test_a_full_servers_advice_lengthens_the_pause():
    busy = ServerBusy(Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED, pb.REASON_CAPACITY, "full", retry_after_s=3.0))
    backoff = Backoff(0.1, 0.5, 0.0, random.Random(0))
    assert backoff.wait(busy) == 3.0 and backoff.wait(LinkDown("down")) == 0.1
    assert backoff.failed(busy) == 3.0 and backoff.delay == 0.2


@pytest.mark.parametrize("server", ["127.0.0.1:50051", "localhost:1", "[::1]:50051", "a.example:443, b-2:50052"])
def test_server_lists_of_host_port_pass(server):
    assert parse_endpoints(server) == [e.strip() for e in server.split(",")]


@pytest.mark.parametrize("server", ["localhost", "127.0.0.1", "host:0", "host:65536", "::1:50051", "host:50051/x",
                                    "http://host:50051", " , ", "a:1,b"])  # fmt: skip
def test_an_address_without_a_port_is_refused_before_dialing(server):
    with pytest.raises(ValueError, match="HOST:PORT"):
        parse_endpoints(server)
