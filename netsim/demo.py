"""`make demo`: the whole tether on one machine, rehearsing two network drops.

It starts the server on the default models (deploy/models), tether-netsim in front of it, and the edge client
behind that. Once the client has paired, the link is cut and later blackholed (a stall), each on the client's own
progress rather than the clock; the client keeps writing alone through both and resyncs when the link returns. A
live view shows verified tokens (green) and offline ones (yellow), the link state, tau and the bytes on the wire; a
summary table closes it. Everything runs on the CPU, on loopback, in well under two minutes.

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
from tether.client.session import ClientConfig, EdgeSession, Event, State
from tether.netsim.proxy import LinkConfig, NetSimThread
from tether.server.generate import default_model_dir, load
from tether.server.rpc_server import make_server
from tether.server.service import ServiceConfig, TetherService
from tether.shared.checkpoint import fingerprint
from tether.shared.drafter import load_drafter

PROMPT = "import os\n\n\ndef read_config(path):\n    "


class Drops:
    """The demo's two drops, struck on the client's events rather than the clock, so that both land mid-generation
    and each ends in a resync on a machine of any speed. The link is cut once the text holds `cut_at` tokens and
    restored when the client tries to resync having written `offline` tokens alone (it then waits for the link:
    ClientConfig.max_offline_tokens); once `online` more tokens are verified it stalls, and is restored when the
    client, having noticed the silence (its round timeout), tries to resync."""

    def __init__(self, sim: NetSimThread, session: EdgeSession, cut_at: int, offline: int, online: int):
        self.sim, self.session = sim, session
        self.cut_at, self.offline, self.online = cut_at, offline, online
        self.step = "before the cut"
        self.written = 0  # offline tokens during the cut
        self.stall_at = 0

    def on_event(self, e: Event) -> None:
        s = self.session
        resyncing = e.kind == "state" and e.state == State.RESYNCING
        if e.kind == "tokens" and e.tag == "offline":
            self.written += len(e.tokens)
        if self.step == "before the cut" and e.kind == "tokens" and len(s.tokens) >= self.cut_at:
            self.sim.cut()
            self.step = "cut"
        elif self.step == "cut" and resyncing and (self.written >= self.offline or s.done):
            self.sim.restore()
            self.step = "back"
        elif self.step == "back" and e.kind == "state" and e.state == State.ONLINE:
            self.stall_at = len(s.tokens) + self.online
            self.step = "before the stall"
        elif self.step == "before the stall" and e.kind == "tokens" and len(s.tokens) >= self.stall_at:
            self.sim.stall()
            self.step = "stall"
        elif self.step == "stall" and resyncing:
            self.sim.restore()
            self.step = "over"


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
        # Each drop a fifth of the text in: the cut after it, the cut's offline text, the stall after the resync.
        fifth = max(1, args.max_new_tokens // 5)
        cfg = ClientConfig(server=sim.address, max_new_tokens=args.max_new_tokens, policy=args.policy,
                           cache_dir=cache, round_timeout_s=1.0, backoff_initial_s=0.1, backoff_max_s=0.5,
                           pace_tokens_per_s=args.pace, max_offline_tokens=fifth)  # fmt: skip
        session = EdgeSession(cfg)
        drops = Drops(sim, session, cut_at=fifth, offline=fifth, online=fifth)
        try:
            t0 = time.monotonic()
            session.pair()
            console.print(f"[dim]paired in {time.monotonic() - t0:.2f} s: {session.stats.weights_bytes:,} B of "
                          f"client weights (MoA drafter, TLI {session.info.tli_layers})")  # fmt: skip
            with LiveView(session.models.tokenizer, args.prompt, netsim=sim, console=console) as view:

                def on_event(e: Event) -> None:
                    view.on_event(e)
                    drops.on_event(e)

                session.on_event = on_event
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
