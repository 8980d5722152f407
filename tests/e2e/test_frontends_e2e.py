"""The edge client (tether.client) against the toy models served through two front-end processes
(`launch.listen` with two front ends, what `tether-server serve --frontends 2` runs): pairing downloads the client part
through them, the rounds (pipelined, overlapping the verdicts: several messages of a stream in flight) cross the
engine's socket, the bearer key is checked in a front end and the caller it names reaches the engine, which closes
the session at the end. The greedy text equals plain decoding by the target.

No link fault here: the deadlines are generous so that a busy machine never makes a slow round look like an outage
(an outage would leave offline text)."""

import torch
from edge_text import run_text
from toy_models import toy_model_dir

from tether.client.session import ClientConfig, EdgeSession
from tether.server.engine_core import Engine
from tether.server.launch import LaunchPlan, listen
from tether.server.model_loading import load
from tether.server.serve_config import ServiceConfig
from tether.server.service import TetherService
from tether.shared.checkpoint import fingerprint
from tether.shared.drafter_loading import load_drafter

PROMPT = "def write_lines(path, lines):\n    "
NEW = 24
PATIENT = {"round_timeout_s": 120.0, "connect_timeout_s": 120.0, "mode": "hybrid"}  # rounds, not a stream


def test_the_edge_client_through_front_ends_writes_the_targets_greedy_text(tmp_path):
    target, tok = load(toy_model_dir(), "cpu")
    drafter = load_drafter(toy_model_dir("drafter"), target)
    service = TetherService(Engine(target, drafter, tok, ServiceConfig(api_keys=frozenset({"edge-key"})),
                            model_fingerprint=fingerprint(toy_model_dir())))  # fmt: skip
    try:
        server, port = listen(service, "127.0.0.1:0", LaunchPlan(frontends=2))
        server.start()
        try:
            cfg = ClientConfig(server=f"127.0.0.1:{port}", max_new_tokens=NEW, api_key="edge-key",
                               cache_dir=str(tmp_path), **PATIENT)  # fmt: skip
            session = EdgeSession(cfg)
            try:
                result = run_text(session, PROMPT)
            finally:
                session.close()
            opened = service.engine.metrics.registry.get_sample_value("tether_sessions_opened_total")
            left = set(service.engine.sessions)
        finally:
            server.stop(None)
    finally:
        service.engine.close()
    assert result.stats.outages == 0 and set(result.tags) == {"verified"}
    assert result.stats.rounds > 0 and result.stats.weights_bytes > 0
    assert opened == 1 and not left  # one session, the key's, and the client's Close under that key reached it
    assert result.token_ids == list(target.generate(torch.tensor([tok.encode(PROMPT)]), NEW))
