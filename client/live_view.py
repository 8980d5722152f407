"""What the user sees while the client generates: the text as it grows, verified and offline tokens in different
colours, the link state, tau and bytes; and a summary table at the end.

Contract: `LiveView(tokenizer, prompt_text, netsim=None, context=(), hidden=())` is an event sink for
tether.client.session (`view.on_event`); use it as a context manager around the generation (rich.live.Live
underneath), then `view.summary(result)` prints the closing table. `PlainStream` is the sink for a pipe or a log: it
writes text as it is produced and notes the link's state changes and retractions on stderr; `summary(result)` ends
with one line there. Both decode the continuation after `context`, the prompt's ids (a SentencePiece-style
continuation keeps its first space), and leave out the text of `hidden` ids (`tether-client generate` gives the ids
the generation ends at: every end-of-text id and the stop token ids, as Result.continuation leaves them out). Both say
the link's state changes alike, one line each (tether.client.outage.LinkNotes: "offline: server unreachable",
"resyncing", "online ..."), and re-colour nothing already printed but the live view's text, whose offline tokens
turn verified when a resync keeps them (Event "verify"). Both summaries give time to first token from the command's
start and after pairing, tokens/s, and say when the server decoded alone (server-only).
`ChatStream` is a chat's: each reply as it comes (offline text in yellow on a terminal), without the tokens a
template hides (end of turn, special tokens), notes on stderr. `Connecting` is the sink while pairing: what the
connect loop reports, and a rich progress bar on stderr for the client part's first download (bytes, rate), shown
on a terminal or when asked, and nothing at all when the weights are cached (no download events come).

    with LiveView(tok, prompt) as view:
        result = generate(cfg, tok.encode(prompt), on_event=view.on_event)
    view.summary(result)
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Collection, Sequence

from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn
from rich.table import Table
from rich.text import Text

from tether.client.outage import LinkNotes
from tether.client.session import Event, Result, State
from tether.shared.tokenizer import Tokenizer

STYLE = {"verified": "bold green", "offline": "yellow"}
STATE_STYLE = {
    State.CONNECTING: "cyan",
    State.ONLINE: "green",
    State.OFFLINE: "red",
    State.RESYNCING: "magenta",
    State.DONE: "blue",
}


def summary_line(result: Result) -> str:
    """One line: tokens (verified / offline), time to first token (from the start, and after pairing), tokens/s, tau,
    wall."""
    s = result.stats
    n, off = len(result.token_ids), result.tags.count("offline")
    parts = [
        f"{n} tokens" + (f" ({n - off} verified, {off} offline)" if off else ""),
        f"first token {1000 * s.ttft_from_start_s:.0f} ms ({1000 * s.ttft_s:.0f} ms after pairing)",
        f"{s.tokens_per_s:.1f} tokens/s",
    ]
    parts.append("server-only (nothing drafted)" if s.server_only else f"tau {s.tau:.2f}")
    if s.stream_tokens and not s.server_only:
        parts.append(f"{s.stream_tokens} streamed, {s.mode_switches} mode switches")
    if s.retracted:
        parts.append(f"{s.retracted} retracted")
    if s.stopped:
        parts.append("stopped")
    return ", ".join(parts) + f", {s.wall_s:.2f} s"


def token_texts(tokenizer: Tokenizer, ids: list[int], context: Sequence[int] = ()) -> list[str]:
    """The text each token releases (a character split across tokens shows once whole, at the token that completes
    it or, with byte fallback, at the token after its bytes); joined, exactly `tokenizer.decode(ids, after=context)`
    (`context`: the prompt's ids)."""
    stream = tokenizer.detokenizer(context=context)
    pieces = [stream.push([t]) for t in ids]
    if pieces:
        pieces[-1] += stream.flush()
    return pieces


class LiveView:
    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt: str,
        *,
        netsim=None,
        console: Console | None = None,
        context: Sequence[int] = (),
        hidden: Collection[int] = (),
    ):
        self.tok, self.prompt, self.netsim = tokenizer, prompt, netsim
        self.context, self.hidden = list(context), frozenset(hidden)
        self.console = console or Console()
        self.tokens: list[int] = []
        self.tags: list[str] = []
        self.state = State.CONNECTING
        self.log: list[str] = []
        self.retracted = 0
        self.notes = LinkNotes()
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
            lines = self.notes.lines(e)
            if e.kind == "tokens":
                self.tokens += e.tokens
                self.tags += [e.tag] * len(e.tokens)
            elif e.kind == "verify":
                self.tags[e.start : e.start + e.count] = ["verified"] * e.count
            elif e.kind == "retract":
                del self.tokens[len(self.tokens) - e.count :]
                del self.tags[len(self.tags) - e.count :]
                self.retracted += e.count
            elif e.kind == "state":
                self.state = e.state
            elif e.kind == "mode":  # tether.client.adaptive switched the online mode
                lines = ["streaming the server's decoding" if e.detail == "stream" else "drafting here"]
            elif e.kind == "info" and e.detail and not (self.log and self.log[-1].endswith("  " + e.detail)):
                lines = [e.detail]  # a note the connect loop repeats at each try: once
            self.log += [f"{t:6.2f}s  {line}" for line in lines]
            self.live.update(self._render())

    def _render(self):
        text = Text(self.prompt, style="dim")
        shown = [(t, tag) for t, tag in zip(self.tokens, self.tags, strict=True) if t not in self.hidden]
        pieces = token_texts(self.tok, [t for t, _ in shown], self.context)
        for piece, (_, tag) in zip(pieces, shown, strict=True):
            text.append(piece, style=STYLE[tag])
        n_off = self.tags.count("offline")
        status = Text.assemble(
            ("state ", "dim"),
            (self.state.value.upper(), f"bold {STATE_STYLE[self.state]}"),
            ("   tokens ", "dim"),
            (str(len(self.tokens)), "bold"),
            ("   verified ", "dim"),
            (str(len(self.tokens) - n_off), STYLE["verified"]),
            ("   offline ", "dim"),
            (str(n_off), STYLE["offline"]),
            ("   retracted ", "dim"),
            (str(self.retracted), "bold"),
        )
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
        rows = [
            ("tokens", len(result.token_ids)),
            ("verified", len(result.token_ids) - n_off),
            ("offline, unverified", n_off),
            ("offline drafted", s.offline_tokens),
            ("retracted", s.retracted),
            ("rounds", s.rounds),
            ("tau", f"{s.tau:.2f}"),
            ("outages", s.outages),
            ("resyncs", s.resyncs),
            ("rebuilt sessions", s.rebuilt),
            ("payload up / down", f"{s.bytes_up:,} / {s.bytes_down:,} B"),
            ("time to first token", f"{1000 * s.ttft_from_start_s:.0f} ms"),
            ("... after pairing", f"{1000 * s.ttft_s:.0f} ms"),
            ("tokens/s", f"{s.tokens_per_s:.1f}"),
            ("wall", f"{s.wall_s:.2f} s"),
        ]
        if s.server_only:
            rows[3:10] = [("decoded by", "the server alone (server-only: no drafter)")]
        if s.stopped:
            rows.append(("stopped", "Ctrl-C"))
        if s.resync_s:
            rows.append(("resync time", f"{1000 * sum(s.resync_s) / len(s.resync_s):.0f} ms mean"))
        if wire:
            rows.append(("wire up / down (netsim)", f"{wire['up_bytes']:,} / {wire['down_bytes']:,} B"))
        for k, v in rows:
            t.add_row(k, str(v))
        self.console.print(t)


class PlainStream:
    """Text to stdout as it is produced; the link's state changes (one line each) and retractions as notes on
    stderr."""

    def __init__(
        self, tokenizer: Tokenizer, *, out=None, err=None, context: Sequence[int] = (), hidden: Collection[int] = ()
    ):
        self.tok, self.hidden = tokenizer, frozenset(hidden)
        self.out, self.err = out or sys.stdout, err or sys.stderr
        self.text = tokenizer.detokenizer(context=context)
        self.notes = LinkNotes()

    def on_event(self, e: Event) -> None:
        for line in self.notes.lines(e):
            self.err.write(f"\n[tether: {line}]\n")
        if e.kind == "tokens" or (e.kind == "state" and e.state == State.DONE):
            # The end (DONE) releases what the detokenizer held back: a last character still waiting for more.
            shown = [t for t in e.tokens if t not in self.hidden] if e.kind == "tokens" else []
            self.out.write(self.text.push(shown) if e.kind == "tokens" else self.text.flush())
            self.out.flush()
        elif e.kind == "retract":
            self.err.write(f"\n[tether: rewound {e.count} offline tokens; the text goes on from there]\n")

    def summary(self, result: Result) -> None:
        self.err.write(f"[tether: {summary_line(result)}]\n")


class ChatStream:
    """A chat reply as it comes: verified text as is, offline text in yellow on a terminal, without `hidden`
    tokens (the template's end of turn and special tokens); notes on stderr as PlainStream's."""

    def __init__(self, tokenizer: Tokenizer, hidden: Collection[int], *, console: Console, err=None):
        self.tok, self.hidden, self.console = tokenizer, frozenset(hidden), console
        self.notes = PlainStream(tokenizer, out=console.file, err=err)
        self.text = tokenizer.detokenizer()

    def on_event(self, e: Event) -> None:
        if e.kind != "tokens":
            self.notes.on_event(e)
        if e.kind == "tokens":
            text = self.text.push(t for t in e.tokens if t not in self.hidden)
        elif e.kind == "state" and e.state == State.DONE:
            text = self.text.flush()  # the end releases what the detokenizer held back
        else:
            return
        if text:
            self.console.print(Text(text, style=STYLE["offline"] if e.tag == "offline" else ""), end="")
            self.console.file.flush()


class Connecting:
    """The sink while pairing: notes from the connect loop on `console`, and a progress bar of the client part's
    download there when `bar` (the CLI asks for one on a terminal, or with --progress)."""

    def __init__(self, console: Console, *, bar: bool):
        self.console, self.bar = console, bar
        self.progress: Progress | None = None

    def on_event(self, e: Event) -> None:
        if e.kind == "info":
            self.console.print(Text(e.detail, style="dim"))
        elif e.kind == "download" and self.bar:
            if self.progress is None:
                self.progress = Progress(
                    TextColumn("client part"),
                    BarColumn(),
                    DownloadColumn(),
                    TransferSpeedColumn(),
                    TimeRemainingColumn(),
                    console=self.console,
                    transient=False,
                )
                self.task = self.progress.add_task("download", total=e.total)
                self.progress.start()
            self.progress.update(self.task, completed=e.count, total=e.total)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None
