"""`make demo`: why the edge drafter is there. The hybrid (the edge drafts, the server verifies) and a server-only
stream (the server decodes, nothing is drafted) generate the same prompt side by side, at the same pace, through
one tether-netsim link that is cut, then stalled.

It starts the server on the default models (deploy/models), tether-netsim in front of it, and two clients behind
that one proxy, so both see the same link and the same drops. The drops are struck on the streams' progress, not
on the clock: the link is cut once both texts hold a fifth of the tokens, and restored when the hybrid, having
written as many alone, tries to resync (and the server-only stream has met the cut); once the hybrid has verified
another fifth the link stalls (every byte held), and comes back when the hybrid, having noticed the silence, tries
to resync. Through both the hybrid keeps writing (offline tokens, yellow), while the server-only text stops once
what it had received is read, until the link returns. One 80x24 screen shows both texts above a status area that
stays put (tether.client.split_view): the link, tokens so far, tokens each wrote during the outages, the payload
bytes of each and the wire's bytes of both, tau; a table compares them at the end. Everything runs on the CPU, on
loopback, in well under two minutes.

    .venv/bin/python bench/demo.py                     # policy keep: the hybrid's offline text stands
    .venv/bin/python bench/demo.py --policy rewind     # offline text the target disagrees with is rewound
    .venv/bin/python bench/demo.py --pace 0            # as fast as each stream goes

The server-only stream (`ServerOnlyStream`) is tether.client.server_only's ServerOnlySession asked for the text
in slices of half a second at the pace, the next slice while the one before is being read: one Generate call
streams as fast as the server decodes, which would put the whole text on the edge before the first drop, and a
reader's pace is the point of the comparison. Each slice is a Generate call over the text so far (Generate holds
no session), which its payload counts; a broken link ends the call in flight, and the stream asks again, with
backoff, until the link is back.

Exit status: 0; 1 when a stream fails, or under rewind when the hybrid's text is not what the target alone writes;
130 after Ctrl-C (both streams stop, the screen and the table show what they wrote).

Tests: tests/e2e/test_demo.py (on a pipe under rewind, and on a forced 80x24 terminal, every frame checked).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import random
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait

import torch
from rich.console import Console

from tether.client.errors import ServerDataError
from tether.client.server_only import ServerOnlySession
from tether.client.session import ClientConfig, EdgeSession, Event, Result, State
from tether.client.session_types import Stats
from tether.client.split_view import SplitView
from tether.client.transport import Backoff, LinkDown, Replicas, ServerError
from tether.netsim.proxy import LinkConfig, NetSimThread
from tether.server.engine_core import Engine
from tether.server.model_loading import default_model_dir, load
from tether.server.rpc_server import make_server
from tether.server.serve_config import ServiceConfig
from tether.server.service import TetherService
from tether.shared.checkpoint import fingerprint
from tether.shared.drafter_loading import load_drafter
from tether.shared.tokenizer import Tokenizer
from tether.v1 import tether_pb2 as pb

PROMPT = "import os\n\n\ndef read_config(path):\n    "
SLICE_S = 0.5  # the server-only stream asks for this much text at a time, in seconds at the pace


class ServerOnlyStream:
    """The server-only side of the demo: the server decodes, the edge reads at the pace (module docstring).

    Two threads: `run`'s asks for the text a slice at a time, the next while the one before is still being read
    (so the text goes at the pace while the link is up, and at most two slices are on the edge when it drops); a
    writer takes the tokens at the pace. Events go to `view.server`, each token's arrival to the view's outage
    count, and `on_tokens(n, done)` hears the length of the text as it grows (the drops). `run(prompt_ids)` ->
    Result; `stop()` from any thread."""

    def __init__(self, cfg: ClientConfig, tokenizer: Tokenizer, view: SplitView):
        self.cfg, self.tok, self.view, self.pane = cfg, tokenizer, view, view.server
        self.replicas = Replicas(cfg.server, 0, keepalive_s=cfg.keepalive_s)  # a connection of its own
        self.backoff = Backoff(cfg.backoff_initial_s, cfg.backoff_max_s, cfg.backoff_jitter, random.Random(cfg.seed))
        self.stats = self.pane.stats = Stats(server_only=True)
        self.received: list[int] = []  # what came over the link
        self.tokens: list[int] = []  # what was written, at the pace
        self.calls = 0  # Generate calls, those the link broke included
        self.on_tokens = lambda n, done: None
        self._unread: collections.deque[int] = collections.deque()  # received, not yet written
        self._ready = threading.Condition()  # guards _unread and _fetched
        self._fetched = False  # no more tokens will come
        self._stopping = threading.Event()
        self._session: ServerOnlySession | None = None
        self._asked_in = 0  # the outage the call in flight was made in (0: the link was up)
        self._t0 = 0.0

    def _state(self, state: State, detail: str = "") -> None:
        if state != self.pane.state:
            self.pane.on_event(Event("state", state=state, detail=detail))

    def _slice(self) -> int:
        left = self.cfg.max_new_tokens - len(self.received)
        pace = self.cfg.pace_tokens_per_s
        return left if pace <= 0 else min(left, max(1, round(pace * SLICE_S)))

    def run(self, prompt: list[int]) -> Result:
        cfg = self.cfg
        self._t0 = time.monotonic()
        self._state(State.CONNECTING)
        writer = threading.Thread(target=self._write, name="server-only writer", daemon=True)
        writer.start()
        try:
            stub, ask = self.replicas.stub, pb.GetModelInfoRequest()
            info = self.backoff.retry(lambda: stub.GetModelInfo(ask, timeout=cfg.connect_timeout_s))
            ends = frozenset(info.eos_ids or self.tok.eos_ids)  # every end-of-text id: Generate stops after one
            while len(self.received) < cfg.max_new_tokens and not (self.received and self.received[-1] in ends):
                with self._ready:  # the next slice once the writer is into the last one
                    self._ready.wait_for(lambda: len(self._unread) < self._slice() or self._stopping.is_set())
                if self._stopping.is_set():
                    break
                self._call(info, prompt)
        finally:
            with self._ready:
                self._fetched = True
                self._ready.notify_all()
            writer.join()
        self.stats.stopped = self._stopping.is_set()
        self.stats.wall_s = time.monotonic() - self._t0
        self._state(State.DONE)
        self.on_tokens(len(self.tokens), True)
        return Result(list(prompt), self.tokens, ["verified"] * len(self.tokens), self.stats)

    def _call(self, info: pb.ModelInfo, prompt: list[int]) -> None:
        """One Generate call for the next slice, over everything received so far."""
        cfg = dataclasses.replace(self.cfg, max_new_tokens=self._slice())
        self._session = ServerOnlySession(self.replicas.stub, (), cfg, info, self.tok, on_event=self._arrived)
        self._asked_in = self.view.outage()
        self.calls += 1
        try:
            self._session.run(prompt + self.received)
            self.backoff.reset()
        except LinkDown as e:  # the link broke the call: no more text until it is back
            if self.pane.state != State.OFFLINE:
                self.stats.outages += 1
            self._state(State.OFFLINE, str(e).split("\n")[0][:120])
            self._stopping.wait(self.backoff.failed(e))
        finally:
            self.stats.bytes_up += self._session.stats.bytes_up
            self.stats.bytes_down += self._session.stats.bytes_down

    def _arrived(self, e: Event) -> None:
        if e.kind != "tokens":
            return  # each call's own connecting / online / done: this stream reports its own states
        self.pane.arrived(len(e.tokens), self._asked_in)
        self._state(State.ONLINE)
        with self._ready:
            self.received += e.tokens
            self._unread.extend(e.tokens)
            self._ready.notify_all()

    def _write(self) -> None:
        """The tokens received, one at a time at the pace."""
        pace, last = self.cfg.pace_tokens_per_s, 0.0
        while not self._stopping.is_set():
            with self._ready:
                self._ready.wait_for(lambda: self._unread or self._fetched or self._stopping.is_set())
                if not self._unread:
                    return
                t = self._unread.popleft()
                self._ready.notify_all()
            if pace > 0 and self._stopping.wait(max(0.0, last + 1.0 / pace - time.monotonic())):
                return
            last = time.monotonic()
            self.tokens.append(t)
            self.stats.token_emitted(1, self._t0, last)
            self.pane.on_event(Event("tokens", tokens=[t], tag="verified"))
            self.on_tokens(len(self.tokens), False)

    def stop(self) -> None:
        self._stopping.set()
        with self._ready:
            self._ready.notify_all()
        if self._session is not None:
            self._session.stop()

    def close(self) -> None:
        self.replicas.close()


class Drops:
    """The demo's two drops, struck on the streams' progress rather than the clock, so that both land mid-generation
    and each ends in a resync on a machine of any speed. The link is cut once both texts hold `cut_at` tokens (or
    the server-only one has ended), or once the hybrid holds twice that whatever the server-only text holds (on a
    busy machine the hybrid can run far ahead of it), and restored when the hybrid tries to resync having written
    `offline` tokens alone (it then waits for the link: ClientConfig.max_offline_tokens) and the server-only stream
    has met the cut (or ended); once `online` more tokens are verified, and at the latest at `last_stall` tokens (so
    that more than `offline` are left to write and the hybrid must resync before it ends), it stalls, and is
    restored when the hybrid, having noticed the silence (its round timeout), tries to resync.
    `finish()` restores a link still down once the hybrid is done, so that the server-only stream can end too."""

    def __init__(self, sim: NetSimThread, view: SplitView, session: EdgeSession, cut_at: int, offline: int,
                 online: int, last_stall: int):  # fmt: skip
        self.sim, self.view, self.session = sim, view, session
        self.cut_at, self.offline, self.online, self.last_stall = cut_at, offline, online, last_stall
        self.lock = threading.Lock()  # both streams' threads strike drops
        self.step = "before the cut"
        self.written = 0  # the hybrid's offline tokens during the cut
        self.server_ready = False  # the server-only text holds cut_at tokens, or has ended
        self.stall_at = 0

    def _cut_if_ready(self) -> None:
        n = len(self.session.tokens)
        if self.step == "before the cut" and n >= self.cut_at and (self.server_ready or n >= 2 * self.cut_at):
            self.view.link_change("cut", self.sim.cut)
            self.step = "cut"

    def _noticed(self) -> bool:
        """The server-only stream has met the cut (a call of its failed), or has ended."""
        return self.view.server.state in (State.OFFLINE, State.DONE)

    def on_server(self, n: int, done: bool) -> None:
        with self.lock:
            self.server_ready |= done or n >= self.cut_at
            self._cut_if_ready()

    def on_hybrid(self, e: Event) -> None:
        with self.lock:
            s = self.session
            resyncing = e.kind == "state" and e.state == State.RESYNCING
            if e.kind == "tokens" and e.tag == "offline" and self.step == "cut":
                self.written += len(e.tokens)
            if self.step == "before the cut" and e.kind == "tokens":
                self._cut_if_ready()
            elif self.step == "cut" and resyncing and (self.written >= self.offline or s.done) and self._noticed():
                self.view.link_change("up", self.sim.restore)
                self.step = "back"
            elif self.step == "back" and e.kind == "state" and e.state == State.ONLINE:
                self.stall_at = min(len(s.tokens) + self.online, self.last_stall)
                self.step = "before the stall"
            elif self.step == "before the stall" and e.kind == "tokens" and len(s.tokens) >= self.stall_at:
                self.view.link_change("stalled", self.sim.stall)
                self.step = "stall"
            elif self.step == "stall" and resyncing:
                self.view.link_change("up", self.sim.restore)
                self.step = "over"

    def finish(self) -> None:
        with self.lock:
            if self.view.link != "up":
                self.view.link_change("up", self.sim.restore)
            self.step = "over"


def run_both(session: EdgeSession, server_only: ServerOnlyStream, drops: Drops,
             prompt_ids: list[int]) -> tuple[Result, Result]:  # fmt: skip
    """Both generations at once, each on a thread; Ctrl-C stops both and keeps what they wrote."""

    def hybrid() -> Result:
        try:
            return session.run(prompt_ids)
        finally:
            drops.finish()

    with ThreadPoolExecutor(2, thread_name_prefix="demo") as pool:
        futures = pool.submit(hybrid), pool.submit(server_only.run, prompt_ids)
        try:
            wait(futures, return_when=FIRST_EXCEPTION)
        except KeyboardInterrupt:
            pass  # both stop below, with the text they have
        finally:
            if not all(f.done() and f.exception() is None for f in futures):
                session.stop()  # Ctrl-C, or the other stream failed: neither goes on alone
                server_only.stop()
        return futures[0].result(), futures[1].result()


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench/demo.py", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)  # fmt: skip
    ap.add_argument("--policy", choices=("keep", "rewind"), default="keep", help="what happens to offline text")
    ap.add_argument("--max-new-tokens", type=int, default=220, help="tokens each stream generates")
    ap.add_argument("--pace", type=float, default=20.0, help="tokens a second, each stream (0: as fast as it goes)")
    ap.add_argument("--prompt", default=PROMPT, help="the text to continue")
    ap.add_argument("--latency-ms", type=float, default=20.0, help="one-way link latency")
    args = ap.parse_args(argv)
    if args.max_new_tokens < 5 or args.pace < 0 or args.latency_ms < 0:
        ap.error("--max-new-tokens must be at least 5, --pace and --latency-ms at least 0")
    console = Console()
    torch.set_num_threads(1)  # the server and both clients share this machine's cores

    target, tok = load(default_model_dir(), "cpu")
    drafter = load_drafter(default_model_dir("drafter"), target)
    service = TetherService(
        Engine(target, drafter, tok, ServiceConfig(), model_fingerprint=fingerprint(default_model_dir()))
    )
    server, port = make_server(service, "127.0.0.1:0")
    server.start()
    sim = NetSimThread(("127.0.0.1", 0), ("127.0.0.1", port), LinkConfig(latency_ms=args.latency_ms, jitter_ms=2))
    sim.start()
    console.print(f"[dim]server 127.0.0.1:{port} <- netsim {sim.address} ({args.latency_ms:.0f} ms) <- hybrid & "
                  "server-only")  # fmt: skip
    server_only = None
    try:
        with tempfile.TemporaryDirectory() as cache:
            # Each drop a fifth of the text in: the cut after it, the cut's offline text, the stall after the resync.
            # The pane shows drafting here (mode hybrid), not auto's streaming from the server.
            fifth = max(1, args.max_new_tokens // 5)
            cfg = ClientConfig(server=sim.address, max_new_tokens=args.max_new_tokens, policy=args.policy,
                               cache_dir=cache, round_timeout_s=1.0, backoff_initial_s=0.1, backoff_max_s=0.5,
                               pace_tokens_per_s=args.pace, max_offline_tokens=fifth,
                               mode="hybrid")  # fmt: skip
            session = EdgeSession(cfg)
            try:
                t0 = time.monotonic()
                session.pair()
                console.print(f"[dim]paired in {time.monotonic() - t0:.2f} s: {session.stats.weights_bytes:,} B of "
                              f"client weights (MoA drafter, TLI {session.info.tli_layers})")  # fmt: skip
                view = SplitView(session.models.tokenizer, args.prompt, netsim=sim, console=console)
                view.hybrid.stats = session.stats
                server_only = ServerOnlyStream(cfg, session.models.tokenizer, view)
                drops = Drops(sim, view, session, cut_at=fifth, offline=fifth, online=fifth,
                              last_stall=args.max_new_tokens - fifth - 2)  # fmt: skip

                def on_hybrid(e: Event) -> None:
                    view.hybrid.on_event(e)
                    drops.on_hybrid(e)

                session.on_event = on_hybrid
                server_only.on_tokens = drops.on_server
                prompt_ids = session.models.tokenizer.encode(args.prompt)
                with view:
                    hybrid, alone = run_both(session, server_only, drops, prompt_ids)
                s = sim.stats()
                view.summary(hybrid, alone, wire=(s.up_bytes - view.wire0[0], s.down_bytes - view.wire0[1]),
                             server_calls=server_only.calls)  # fmt: skip
            finally:
                session.close()
                if server_only is not None:
                    server_only.close()
    except (LinkDown, ServerError, ServerDataError) as e:
        console.print(f"[red]demo: a stream failed: {e}")
        return 1
    finally:
        sim.stop()
        server.stop(None)
    console.print(f"During the outages the hybrid wrote {view.hybrid.in_outages} tokens alone; the server-only "
                  f"stream got {view.server.in_outages} (its text waited for the link).")  # fmt: skip
    if hybrid.stats.stopped or alone.stats.stopped:
        console.print("Stopped (Ctrl-C): both streams end with the text they had.")
        return 130
    if args.policy == "keep":
        console.print(f"Policy keep: the {hybrid.tags.count('offline')} tokens written offline stand, absorbed by the "
                      "target at each resync.")  # fmt: skip
        return 0
    plain = list(target.generate(torch.tensor([tok.encode(args.prompt)]), len(hybrid.token_ids)))
    same = plain == hybrid.token_ids
    console.print(f"Policy rewind: {hybrid.stats.retracted} offline tokens rewound; the hybrid's text "
                  f"{'equals' if same else 'DIFFERS FROM'} what the target alone writes (greedy).")  # fmt: skip
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
