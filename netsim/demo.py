"""`make demo`: the whole tether on one machine, rehearsing two network drops.

It starts the server on the default models (deploy/models), tether-netsim in front of it, and the edge client
behind that. Once the client has paired, a scenario cuts the link and later blackholes it (a stall); the client
keeps writing alone through both and resyncs when the link returns. A live view shows verified tokens (green)
and offline ones (yellow), the link state, tau and the bytes on the wire; a summary table closes it. Everything
runs on the CPU, on loopback, in well under two minutes.

    python -m tether.netsim.demo                     # policy keep: the offline text stands
    python -m tether.netsim.demo --policy rewind     # offline text the target disagrees with is rewound
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Sequence

import torch
from rich.console import Console

from tether.client.live_view import LiveView
from tether.client.session import ClientConfig, EdgeSession
from tether.netsim.proxy import LinkConfig, NetSimThread
from tether.server.generate import default_model_dir, load
from tether.server.service import ServiceConfig, TetherService, make_server
from tether.shared.checkpoint import fingerprint
from tether.shared.drafter import load_drafter

PROMPT = "import os\n\n\ndef read_config(path):\n    "


def scenario(pace: float) -> list[dict]:
    """Two drops, timed from the start of generation: a cut and, later, a stall."""
    t = 40 / pace  # after ~40 tokens online
    # At least 3 s between the two: the client must reconnect (gRPC's own reconnect backoff reaches 1 s during
    # the cut, the client's 0.5 s) and resync before the stall, or the stall only prolongs the first outage.
    gap = max(3.0, 60 / pace)
    return [
        {"at": t, "event": "cut"},
        {"at": t + 2.0, "event": "restore"},
        {"at": t + 2.0 + gap, "event": "stall"},
        {"at": t + 5.0 + gap, "event": "restore"},  # 3 s: well past the client's 1 s round timeout
    ]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tether demo", description=__doc__.split("\n\n")[0])
    ap.add_argument("--policy", choices=("keep", "rewind"), default="keep", help="what happens to offline text")
    ap.add_argument("--max-new-tokens", type=int, default=220, help="tokens to generate")
    ap.add_argument("--pace", type=float, default=20.0, help="tokens per second shown (a reader's pace)")
    ap.add_argument("--prompt", default=PROMPT, help="the text to continue")
    ap.add_argument("--latency-ms", type=float, default=20.0, help="one-way link latency")
    args = ap.parse_args(argv)
    console = Console()
    torch.set_num_threads(1)  # server and client share this machine's cores

    target, tok = load(default_model_dir(), "cpu")
    drafter = load_drafter(default_model_dir("drafter"), target)
    service = TetherService(target, drafter, tok, ServiceConfig(), model_fingerprint=fingerprint(default_model_dir()))
    server, port = make_server(service, "127.0.0.1:0")
    server.start()
    sim = NetSimThread(("127.0.0.1", 0), ("127.0.0.1", port), LinkConfig(latency_ms=args.latency_ms, jitter_ms=2))
    sim.start()
    console.print(f"[dim]server 127.0.0.1:{port}  <-  netsim {sim.address} ({args.latency_ms:.0f} ms)  <-  client")
    with tempfile.TemporaryDirectory() as cache:
        cfg = ClientConfig(server=sim.address, max_new_tokens=args.max_new_tokens, policy=args.policy,
                           cache_dir=cache, round_timeout_s=1.0, backoff_initial_s=0.1, backoff_max_s=0.5,
                           pace_tokens_per_s=args.pace)  # fmt: skip
        session = EdgeSession(cfg)
        try:
            t0 = time.monotonic()
            session.pair()
            console.print(f"[dim]paired in {time.monotonic() - t0:.2f} s: {session.stats.weights_bytes:,} B of "
                          f"client weights (MoA drafter, TLI {session.info.tli_layers})")  # fmt: skip
            sim.play(scenario(args.pace))
            with LiveView(session.models.tokenizer, args.prompt, netsim=sim, console=console) as view:
                session.on_event = view.on_event
                result = session.run(args.prompt)
            view.summary(result, wire=sim.stats().summary())
        finally:
            session.close()
            sim.stop()
            server.stop(None)
    if args.policy == "keep":
        console.print(f"Policy keep: the {result.tags.count('offline')} tokens written offline stand, absorbed by the "
                      "target at each resync.")  # fmt: skip
        return 0
    plain = list(target.generate(torch.tensor([tok.encode(args.prompt)]), len(result.token_ids)))
    same = plain == result.token_ids
    console.print(f"Policy rewind: {result.stats.retracted} offline tokens rewound; the text "
                  f"{'equals' if same else 'DIFFERS FROM'} what the target alone writes (greedy).")  # fmt: skip
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
