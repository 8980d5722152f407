"""Failover between replicas: how long from a replica's death to the client's first new verified token, and what
the full-history resync that moves the session costs, for contexts of `--contexts` tokens.

Two replicas of a target (`--model`, with its `--drafter`; the default ones unless given) on loopback (their RoPE
limit raised to fit the longest context: positions past the 2,048 the model was trained on make poor text but cost
exactly what they would otherwise, which is what is measured here). The client opens a session on replica A with a
prompt of N tokens (standard-library source), generates a few rounds, then A is stopped. Reported per N: detection
(kill to the client going offline: the round deadline `--round-timeout-s`), resync (the Resync call on B that
rebuilds the session from the history: upload, B's prefill of N tokens, the delta back), total (kill to the first
verified token from B), and the resync's bytes each way. Prints a table, then one JSON line.

    python bench/failover.py                        # contexts 256, 2048, 8192
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import threading
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from tether.client.session import ClientConfig, EdgeSession, Event
from tether.server.engine_core import Engine
from tether.server.model_loading import default_model_dir, load
from tether.server.rpc_server import make_server
from tether.server.serve_config import ServiceConfig
from tether.server.service import TetherService
from tether.shared.checkpoint import fingerprint
from tether.shared.drafter_loading import load_drafter
from tether.shared.model import Transformer


def prompt_of(tok, n: int) -> str:
    """About n tokens of real Python source (decoded back to text so the client can encode it)."""
    text = "".join(Path(m.__file__).read_text() for m in (json, argparse, dataclasses, threading))
    ids = tok.encode(text)
    while len(ids) < n:
        ids += ids
    return tok.decode(ids[:n])


def measure(target: Transformer, drafter, tok, n: int, args, cache: str) -> dict:
    fp = fingerprint(args.model)
    config = ServiceConfig(max_prompt_tokens=n + 64, max_new_tokens=256, kv_pool_bytes=1 << 30)
    reps = []
    for _ in range(2):
        service = TetherService(Engine(target, drafter, tok, config, model_fingerprint=fp))
        server, port = make_server(service, "127.0.0.1:0")
        server.start()
        reps.append((service, server, f"127.0.0.1:{port}"))
    marks: dict[str, float] = {}

    def on_event(e: Event) -> None:
        if e.kind == "state" and e.state.value == "offline" and "kill" in marks:
            marks.setdefault("offline", time.monotonic())
        if e.kind == "tokens" and "offline" in marks and e.tag == "verified":
            marks.setdefault("verified", time.monotonic())

    cfg = ClientConfig(server=",".join(a for _, _, a in reps), max_new_tokens=48, cache_dir=cache,
                       round_timeout_s=args.round_timeout_s, backoff_initial_s=0.05, backoff_max_s=0.2,
                       connect_timeout_s=120, pace_tokens_per_s=40)  # fmt: skip
    session = EdgeSession(cfg, on_event)
    edge_tok = session.pair().tokenizer  # the session takes token ids, encoded as the edge encodes

    def killer():
        while len(session.tokens) < 12:
            time.sleep(0.005)
        for service, server, _ in reps:
            if service.engine.sessions:
                marks["kill"] = time.monotonic()
                server.stop(None)
                return

    t = threading.Thread(target=killer, daemon=True)
    t.start()
    try:
        result = session.run(edge_tok.encode(prompt_of(tok, n)))
    finally:
        t.join(30)
        session.close()
        for _, server, _ in reps:
            server.stop(None)
    s = result.stats
    up, down = s.resync_bytes[0] if s.resync_bytes else (0, 0)
    return {"context": len(result.prompt_ids) + 12, "detect_ms": 1000 * (marks["offline"] - marks["kill"]),
            "resync_ms": 1000 * s.resync_s[0], "total_ms": 1000 * (marks["verified"] - marks["kill"]),
            "resync_up_B": up, "resync_down_B": down, "failovers": s.failovers, "rebuilt": s.rebuilt}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[256, 2048, 8192])
    ap.add_argument("--round-timeout-s", type=float, default=0.5, help="the client's round deadline")
    ap.add_argument("--model", default=str(default_model_dir()), help="target directory (default: the default one)")
    ap.add_argument("--drafter", default=str(default_model_dir("drafter")), help="drafter directory trained for it")
    args = ap.parse_args()
    torch.set_num_threads(2)
    target, tok = load(args.model, "cpu")
    longest = max(args.contexts) + 512
    if longest > target.cfg.max_seq_len:
        target.cfg = dataclasses.replace(target.cfg, max_seq_len=longest)
        for block in target.layers:
            block.cfg = block.attn.cfg = target.cfg
    drafter = load_drafter(args.drafter, target)
    rows = []
    with tempfile.TemporaryDirectory() as cache:
        for n in args.contexts:
            rows.append(measure(target, drafter, tok, n, args, cache))
    t = Table(title=f"failover to a second replica (round deadline {args.round_timeout_s:g} s), CPU")
    for c in ("context", "detect ms", "resync ms", "kill -> verified ms", "resync up B", "resync down B"):
        t.add_column(c, justify="right")
    for r in rows:
        t.add_row(str(r["context"]), f"{r['detect_ms']:.0f}", f"{r['resync_ms']:.0f}", f"{r['total_ms']:.0f}",
                  f"{r['resync_up_B']:,}", f"{r['resync_down_B']:,}")  # fmt: skip
    Console().print(t)
    print(json.dumps({"bench": "failover", "torch": torch.__version__, "round_timeout_s": args.round_timeout_s,
                      "rows": rows}))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
