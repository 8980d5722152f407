"""The engine's event loop: uvloop's where it is installed (the test environment installs it), asyncio's without."""

import asyncio
import sys

import pytest

from tether.server.rpc_server import new_event_loop


def test_the_loop_is_uvloops_where_installed():
    uvloop = pytest.importorskip("uvloop")
    loop = new_event_loop()
    try:
        assert isinstance(loop, uvloop.Loop)
        assert loop.run_until_complete(asyncio.sleep(0, "ran")) == "ran"
    finally:
        loop.close()


def test_without_uvloop_the_loop_is_asyncios(monkeypatch):
    monkeypatch.setitem(sys.modules, "uvloop", None)  # `import uvloop` raises ImportError
    loop = new_event_loop()
    try:
        assert type(loop).__module__.startswith("asyncio.")  # e.g. asyncio.unix_events._UnixSelectorEventLoop
    finally:
        loop.close()
