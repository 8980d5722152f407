"""Test configuration. Its presence puts tests/ on sys.path, so test modules share tiny_models.py.

The repository root is taken off sys.path before anything is imported (`python -m pytest` puts it first, and its
kernels/ would shadow Hugging Face's `kernels` package, which transformers imports), and PYTHONSAFEPATH keeps it off
for every Python the tests start: `make test` exports the same, this covers a developer's own pytest run.

Every gRPC server a test module leaves serving is stopped, and every TetherService it made is closed, once the
module's own fixtures are done (`_servers_released`): a service's batcher threads keep it alive to the
end of the run otherwise, its KV pool (256 MB by default) among it, and each of `make test`'s worker processes
runs many test files.

Torch computes on one thread in the tests and in every process they start (OMP_NUM_THREADS, unless set already):
`make test` runs a worker per core, and a second OpenMP thread per worker only spins waiting for a core the other
worker holds (a sample of the suite's heaviest files took 199 s with two threads, 119 s with one, both cores busy).

Files marked `heavy` (pytestmark) are collected first, the rest in their usual order; `make test` passes
--no-loadscope-reorder so the workers take files in that order. xdist's own order (most tests first) left files of
one long test to the end, where one worker ran them alone for a minute and a half while the other sat idle.
"""

import faulthandler
import functools
import os
import sys
import weakref
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if p not in ("", ".") and Path(p).resolve() != _ROOT]
os.environ["PYTHONSAFEPATH"] = "1"
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))  # for a plugin that imported torch before this file


@pytest.fixture(autouse=True)
def _grad_mode_restored():
    """Entry points such as `serve` and `warm` switch autograd off for their thread (what a server process wants);
    run in a test's thread, that must not leak into the tests after it."""
    enabled = torch.is_grad_enabled()
    yield
    torch.set_grad_enabled(enabled)


_made: dict[str, weakref.WeakSet] = {"servers": weakref.WeakSet(), "services": weakref.WeakSet()}


def _track(cls, kind: str) -> None:
    """Wrap cls.__init__ so that every instance made from now on joins _made[kind] (weakly: tracking keeps none)."""
    if getattr(cls.__init__, "_tracked", False):
        return
    real = cls.__init__

    @functools.wraps(real)
    def init(self, *args, **kwargs):
        real(self, *args, **kwargs)
        _made[kind].add(self)

    init._tracked = True
    cls.__init__ = init


@pytest.fixture(scope="module", autouse=True)
def _servers_released():
    """After the module (this autouse fixture is set up before, so torn down after, the module's own): stop the gRPC
    servers still serving, then close the services. Only classes already imported are tracked: test modules import
    what they use at collection, before any fixture runs, and a suite that never imports the server pays nothing."""
    if "tether.server.service" in sys.modules:
        _track(sys.modules["tether.server.service"].TetherService, "services")
    if "tether.server.rpc_server" in sys.modules:
        _track(sys.modules["tether.server.rpc_server"].ServerHandle, "servers")
    yield
    for server in list(_made["servers"]):
        server.stop(None)  # a no-op for one already stopped
    for service in list(_made["services"]):
        service.engine.close()
    _made["servers"] = weakref.WeakSet()
    _made["services"] = weakref.WeakSet()


def pytest_collection_modifyitems(items):
    """Heavy files first (module docstring); the sort is stable, so each file's tests stay together and in order."""
    heavy = {item.path for item in items if item.get_closest_marker("heavy")}
    items.sort(key=lambda item: item.path not in heavy)


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    """A crash dumps the crashing thread alone: CI shows the tail of the output, and with every thread dumped that
    tail is the main thread's (the oldest), not the one that crashed."""
    from _pytest.faulthandler import fault_handler_stderr_fd_key

    if fault_handler_stderr_fd_key in config.stash:
        faulthandler.enable(file=config.stash[fault_handler_stderr_fd_key], all_threads=False)
