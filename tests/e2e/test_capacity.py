"""Sixteen real clients on a server too small for them all: running out of room is retryable, never fatal.

With the session limit at 8, or a KV pool that holds a few sessions' memory, the server evicts idle sessions and
refuses what it cannot place with REASON_CAPACITY and retry advice; each client backs off, drafts alone meanwhile
and resyncs (rebuilding its session from its history when it was evicted). Under policy rewind every one of them
ends with exactly the text plain greedy decoding gives for its prompt. Nothing here depends on timing: the
pressure comes from the limits (every client holds after its first token until all have opened), and every client
keeps at most a few offline tokens before it waits.
"""

import threading

import pytest
import torch
from edge_text import run_text
from toy_models import toy_model_dir

from tether.client.session import ClientConfig, EdgeSession
from tether.server.engine_core import Engine
from tether.server.kv_pool import KVPool
from tether.server.model_loading import load
from tether.server.rpc_server import make_server
from tether.server.serve_config import ServiceConfig
from tether.server.service import TetherService
from tether.shared.checkpoint import fingerprint
from tether.shared.drafter_loading import load_drafter

pytestmark = pytest.mark.heavy  # a long file, started first (tests/conftest.py)

CLIENTS = 16
N_NEW = 32
PROMPTS = [f"def task_{i}(items):\n    return [x for x in items if x" for i in range(CLIENTS)]


@pytest.fixture(scope="module")
def models():
    target, tok = load(toy_model_dir(), "cpu")
    drafter = load_drafter(toy_model_dir("drafter"), target)
    plain = [list(target.generate(torch.tensor([tok.encode(p)]), N_NEW)) for p in PROMPTS]
    return target, drafter, tok, plain


def _pool_bytes(target, blocks: int, block_size: int = 16) -> int:
    return blocks * KVPool.block_bytes(target.cfg, block_size, torch.float32)


@pytest.mark.parametrize("limit", ["sessions", "kv_memory"])
def test_sixteen_clients_on_a_server_too_small_for_them_all_finish_with_plain_greedy_text(models, tmp_path, limit):
    target, drafter, tok, plain = models
    prompt_len = max(len(tok.encode(p)) for p in PROMPTS)
    # kv_memory: blocks for about 5 of the 16 sessions at their full length (prompt + N_NEW + a round's drafts).
    per_session = -(-(prompt_len + N_NEW + 8) // 16)
    config = ServiceConfig(max_sessions=8) if limit == "sessions" else ServiceConfig(
        kv_pool_bytes=_pool_bytes(target, 5 * per_session)
    )  # fmt: skip
    service = TetherService(Engine(target, drafter, tok, config, model_fingerprint=fingerprint(toy_model_dir())))
    server, port = make_server(service, "127.0.0.1:0")
    server.start()
    cfg = ClientConfig(mode="hybrid", server=f"127.0.0.1:{port}", max_new_tokens=N_NEW, policy="rewind", k=4,
                       cache_dir=str(tmp_path / "cache"), round_timeout_s=60.0, connect_timeout_s=60.0,
                       backoff_initial_s=0.05, backoff_max_s=0.5, max_offline_tokens=4,
                       final_resync_s=600.0)  # fmt: skip
    # Every client waits after its session opened until all sixteen have opened: the pressure is then real whatever
    # the scheduling (each open past the limit evicts an idle one), not only when no client finishes early.
    all_opened = threading.Barrier(CLIENTS, timeout=600)

    def wait_for_the_rest(seen: list[bool]):
        def on_event(e) -> None:
            if e.kind == "tokens" and not seen:
                seen.append(True)
                all_opened.wait()

        return on_event

    sessions = [EdgeSession(cfg, on_event=wait_for_the_rest([])) for _ in range(CLIENTS)]
    results: list = [None] * CLIENTS
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            results[i] = run_text(sessions[i], PROMPTS[i])
        except BaseException as e:  # reported below, with which client it was
            errors.append(e)

    try:
        for s in sessions:  # the weights download once; the rest find them in the cache
            s.pair()
        threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(CLIENTS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=600)
        assert not errors, errors
        assert all(not t.is_alive() for t in threads), "a client never finished"
    finally:
        for s in sessions:
            s.close()
        server.stop(None)
    for i, r in enumerate(results):
        assert r.token_ids == plain[i], f"client {i} differs from plain greedy decoding"
    get = service.engine.metrics.registry.get_sample_value
    if limit == "sessions":
        assert get("tether_evictions_total", {"reason": "sessions"}) >= CLIENTS - 8  # the pressure was real
        assert sum(r.stats.rebuilt for r in results) >= 1
    else:
        pressure = (get("tether_evictions_total", {"reason": "memory"}) or 0) + sum(
            r.stats.outages for r in results
        )  # fmt: skip
        assert pressure >= 1
    assert not service.engine.sessions and service.engine.pool.used_blocks == 0  # every client closed its session
