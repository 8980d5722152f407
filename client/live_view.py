"""What the user sees while the client generates: the text as it grows, verified and offline tokens in different
colours, the link state, tau and bytes; and a summary table at the end.

Contract: `LiveView(tokenizer, prompt_text, netsim=None)` is an event sink for tether.client.session
(`view.on_event`); use it as a context manager around the generation (rich.live.Live underneath), then
`view.summary(result)` prints the closing table. `PlainStream` is the sink for a pipe or a log: it writes text
as it is produced and notes state changes and retractions on stderr.

    with LiveView(tok, prompt) as view:
        result = generate(cfg, prompt, on_event=view.on_event)
    view.summary(result)
"""

from __future__ import annotations

import codecs
import sys
import threading
import time

from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from tether.client.session import Event, Result, State
from tether.shared.tokenizer import Tokenizer

STYLE = {"verified": "bold green", "offline": "yellow"}
STATE_STYLE = {State.CONNECTING: "cyan", State.ONLINE: "green", State.OFFLINE: "red", State.RESYNCING: "magenta",
               State.DONE: "blue"}  # fmt: skip


def token_texts(tokenizer: Tokenizer, ids: list[int]) -> list[str]:
    """The characters each token completes (a multi-byte character split across tokens shows at its last)."""
    dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
    return [dec.decode(tokenizer.decode_bytes([t])) for t in ids]


class LiveView:
    def __init__(self, tokenizer: Tokenizer, prompt: str, *, netsim=None, console: Console | None = None):
        self.tok, self.prompt, self.netsim = tokenizer, prompt, netsim
        self.console = console or Console()
        self.tokens: list[int] = []
        self.tags: list[str] = []
        self.state = State.CONNECTING
        self.log: list[str] = []
        self.retracted = 0
        self.t0 = time.monotonic()
        self.lock = threading.Lock()
        self.live = Live(self._render(), console=self.console, refresh_per_second=12, transient=False)

    def __enter__(self) -> LiveView:
        self.live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.live.update(self._render())
        self.live.__exit__(*exc)

    def on_event(self, e: Event) -> None:
        with self.lock:
            t = time.monotonic() - self.t0
            if e.kind == "tokens":
                self.tokens += e.tokens
                self.tags += [e.tag] * len(e.tokens)
            elif e.kind == "retract":
                del self.tokens[len(self.tokens) - e.count :]
                del self.tags[len(self.tags) - e.count :]
                self.retracted += e.count
                self.log.append(f"{t:6.2f}s  rewind: {e.count} offline tokens retracted")
            elif e.kind == "state":
                self.state = e.state
                self.log.append(f"{t:6.2f}s  {e.state.value}" + (f" ({e.detail})" if e.detail else ""))
            elif e.detail:
                self.log.append(f"{t:6.2f}s  {e.detail}")
            self.live.update(self._render())

    def _render(self):
        text = Text(self.prompt, style="dim")
        for piece, tag in zip(token_texts(self.tok, self.tokens), self.tags, strict=True):
            text.append(piece, style=STYLE[tag])
        n_off = self.tags.count("offline")
        status = Text.assemble(
            ("state ", "dim"), (self.state.value.upper(), f"bold {STATE_STYLE[self.state]}"),
            ("   tokens ", "dim"), (str(len(self.tokens)), "bold"),
            ("   verified ", "dim"), (str(len(self.tokens) - n_off), STYLE["verified"]),
            ("   offline ", "dim"), (str(n_off), STYLE["offline"]),
            ("   retracted ", "dim"), (str(self.retracted), "bold"),
        )  # fmt: skip
        if self.netsim is not None:
            s = self.netsim.stats()
            status.append(f"   wire up {s.up_bytes:,} B  down {s.down_bytes:,} B  link {s.state}", "dim")
        body = [text, Text(""), status, Text("\n".join(self.log[-6:]), style="dim")]
        legend = Text.assemble(("verified", STYLE["verified"]), "  ", ("offline", STYLE["offline"]))
        return Panel(Group(*body), title="tether", subtitle=legend, border_style=STATE_STYLE[self.state])

    def summary(self, result: Result, wire: dict | None = None) -> None:
        s = result.stats
        t = Table(title="summary", show_header=False)
        t.add_column(style="dim")
        t.add_column(justify="right")
        n_off = result.tags.count("offline")
        rows = [("tokens", len(result.token_ids)), ("verified", len(result.token_ids) - n_off),
                ("offline (kept)", n_off), ("offline drafted", s.offline_tokens), ("retracted", s.retracted),
                ("rounds", s.rounds), ("tau", f"{s.tau:.2f}"), ("outages", s.outages), ("resyncs", s.resyncs),
                ("rebuilt sessions", s.rebuilt), ("payload up / down", f"{s.bytes_up:,} / {s.bytes_down:,} B"),
                ("wall", f"{s.wall_s:.2f} s")]  # fmt: skip
        if s.resync_s:
            rows.append(("resync time", f"{1000 * sum(s.resync_s) / len(s.resync_s):.0f} ms mean"))
        if wire:
            rows.append(("wire up / down (netsim)", f"{wire['up_bytes']:,} / {wire['down_bytes']:,} B"))
        for k, v in rows:
            t.add_row(k, str(v))
        self.console.print(t)


class PlainStream:
    """Text to stdout as it is produced; state changes and retractions as notes on stderr."""

    def __init__(self, tokenizer: Tokenizer, *, out=None, err=None):
        self.tok = tokenizer
        self.out, self.err = out or sys.stdout, err or sys.stderr
        self.dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def on_event(self, e: Event) -> None:
        if e.kind == "tokens":
            self.out.write(self.dec.decode(self.tok.decode_bytes(e.tokens)))
            self.out.flush()
        elif e.kind == "retract":
            self.err.write(f"\n[tether: rewound {e.count} offline tokens; the text goes on from there]\n")
        elif e.kind == "state" and e.state in (State.OFFLINE, State.RESYNCING):
            self.err.write(f"\n[tether: {e.state.value}{': ' + e.detail if e.detail else ''}]\n")
        elif e.kind == "state" and e.state == State.ONLINE and e.detail:
            self.err.write(f"\n[tether: online ({e.detail})]\n")
