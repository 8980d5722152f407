"""The netsim tests' fixture: a TCP echo server on loopback (tests/netsim/netsim_helpers.py)."""

import threading

import pytest
from netsim_helpers import EchoServer


@pytest.fixture
def echo():
    server = EchoServer()
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join(5)
