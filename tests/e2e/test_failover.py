"""Replicas: the client holds a list of endpoints; when its replica dies mid-generation it fails over to another
through a full-history resync, loses nothing, and under rewind still writes exactly what the target alone would.
Many clients spread over the replicas all finish.

The replica dies on the client's own event (its 30th token), not after a delay, and the client waits for the next
replica rather than finish alone, so the failover lands mid-generation on a machine of any speed."""

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from edge_text import generate_text, run_text
from toy_models import toy_model_dir

from tether.client.session import ClientConfig, EdgeSession
from tether.server.engine_core import Engine
from tether.server.model_loading import load
from tether.server.rpc_server import make_server
from tether.server.serve_config import ServiceConfig
from tether.server.service import TetherService
from tether.shared.checkpoint import fingerprint
from tether.shared.drafter_loading import load_drafter

pytestmark = pytest.mark.heavy  # a long file, started first (tests/conftest.py)

PROMPT = "def parse_args(argv):\n    "


def replicas(n: int):
    target, tok = load(toy_model_dir(), "cpu")
    drafter = load_drafter(toy_model_dir("drafter"), target)
    fp = fingerprint(toy_model_dir())
    out = []
    for _ in range(n):
        service = TetherService(Engine(target, drafter, tok, ServiceConfig(), model_fingerprint=fp))
        server, port = make_server(service, "127.0.0.1:0")
        server.start()
        out.append((service, server, f"127.0.0.1:{port}"))
    return target, tok, out


def sessions_opened(service: TetherService) -> float:
    return service.engine.metrics.registry.get_sample_value("tether_sessions_opened_total") or 0.0


def stop(server) -> None:
    stopped = server.stop(None)
    if hasattr(stopped, "wait"):
        stopped.wait(30)


def test_client_fails_over_to_another_replica_without_loss(tmp_path):
    target, tok, reps = replicas(3)
    endpoints = ",".join(a for _, _, a in reps)
    # max_offline_tokens: the client waits for a replica after 16 tokens alone, so the failover happens
    # mid-generation however long finding the next replica takes.
    cfg = ClientConfig(mode="hybrid", server=endpoints, max_new_tokens=100, policy="rewind", cache_dir=str(tmp_path),
                       round_timeout_s=5.0, connect_timeout_s=5.0, backoff_initial_s=0.05, backoff_max_s=0.2,
                       pace_tokens_per_s=100, max_offline_tokens=16)  # fmt: skip
    session = EdgeSession(cfg)
    killed = []

    def kill_its_replica(e) -> None:
        # Between two rounds, once 30 tokens are written: the replica that opened the session dies with it.
        if not killed and e.kind == "tokens" and len(session.tokens) >= 30:
            for service, server, address in reps:
                if sessions_opened(service):
                    stop(server)
                    killed.append(address)
                    return

    try:
        session.pair()
        session.on_event = kill_its_replica
        result = run_text(session, PROMPT)
    finally:
        session.close()
        for _, server, _ in reps:
            stop(server)
    assert killed and result.stats.failovers >= 1 and result.stats.rebuilt >= 1
    assert result.token_ids == list(target.generate(torch.tensor([tok.encode(PROMPT)]), 100))


def test_64_concurrent_clients_spread_over_three_replicas_all_finish(tmp_path):
    _, _, reps = replicas(3)
    endpoints = ",".join(a for _, _, a in reps)
    EdgeSession(ClientConfig(server=endpoints, cache_dir=str(tmp_path))).pair()  # one download fills the cache
    # Generous deadlines: an open that timed out on a busy machine would be sent again and counted twice.
    cfg = ClientConfig(mode="hybrid", server=endpoints, max_new_tokens=8, cache_dir=str(tmp_path), round_timeout_s=120,
                       connect_timeout_s=120)  # fmt: skip
    try:
        with ThreadPoolExecutor(16) as pool:
            results = list(pool.map(lambda i: generate_text(cfg, f"x{i} = "), range(64)))
    finally:
        for _, server, _ in reps:
            stop(server)
    assert all(len(r.token_ids) == 8 for r in results)
    opened = [sessions_opened(s) for s, _, _ in reps]
    assert sum(opened) == 64 and min(opened) >= 5, opened  # every replica took its share
