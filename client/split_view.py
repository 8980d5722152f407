"""The demo's screen: the hybrid (the edge drafts, the server verifies) beside a server-only stream on one 80x24
terminal, over a status area that never scrolls away; then one table that compares the two.

Contract:
- `SplitView(tokenizer, prompt, *, netsim=None, console=None)` holds two panes, `view.hybrid` and `view.server`
  (`Pane`), each an event sink for tether.client.session's events (`pane.on_event`, from any thread): the tail of its
  text that fits (decoded after the prompt as tether-client generate shows it, no end-of-text; the prompt dim,
  verified tokens green, offline ones yellow; a retraction removes its tokens, counts them and notes it in the log
  line, as tether.client.live_view.LiveView does; offline ones a resync kept turn green; each change of its link's
  state is one note, tether.client.outage.LinkNotes), its state, tokens so far and payload bytes (`pane.stats`: the
  session's Stats, read as it changes; the hybrid pane adds tau).
- The link is what the caller makes it: `view.link_change(state, act)` records "up", "cut" or "stalled" around
  `act()` (netsim's restore, cut or stall): going down, `act` runs first; coming back, the state changes first, so
  the view never says "down" while bytes still pass, nor "up" before they can.
- Tokens during outages, the comparison the screen is for: the hybrid's offline tokens written while the link is
  down (its drafter writes them alone), and the server-only stream's tokens that came over the link in the very
  outage its request was sent in (`view.outage()` when asking, `view.server.arrived(n, asked_in)` as they come):
  none, unless the link leaks. Neither count depends on when a thread happens to run.
- With `netsim` (a tether.netsim.proxy.NetSimThread carrying both streams), the bytes on the wire since the view
  opened, both streams together (the proxy cannot tell which connection is whose).
- A context manager (rich.live.Live: 12 refreshes a second on a terminal, the last screen alone on a pipe).
  `render()` is the screen: at most 80 columns and 24 rows (fewer when the console is smaller), the status area's
  STATUS_ROWS rows at the bottom and the panes above, each showing as much of the end of its text as fits.
- `summary(hybrid, server, *, wire=None, server_calls=0)`: the closing table, at most 80 columns.

    with SplitView(tok, prompt, netsim=sim) as view:
        hybrid.on_event, server_only.on_event = view.hybrid.on_event, view.server.on_event
        ...
    view.summary(hybrid_result, server_result, wire=sim.stats().summary())

Tests: tests/e2e/test_demo.py (the screen's size with long texts, and `make demo`'s program end to end).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from rich import box
from rich.console import Console, ConsoleOptions, Group, RenderableType, RenderResult
from rich.layout import Layout
from rich.live import Live
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from tether.client.live_view import STATE_STYLE, STYLE, token_texts
from tether.client.outage import LinkNotes
from tether.client.session_types import Event, Result, State, Stats
from tether.shared.tokenizer import Tokenizer

MAX_WIDTH, MAX_HEIGHT = 80, 24  # one classic terminal
STATUS_ROWS = 8  # link, header, state, tokens, outages, drafting, payload, log
LINK_STYLE = {"up": "bold green", "cut": "bold red", "stalled": "bold magenta"}
# What each state means in each pane, in a few words.
HYBRID_STATES = {
    State.CONNECTING: "opening",
    State.ONLINE: "drafting, verified",
    State.OFFLINE: "drafting alone",
    State.RESYNCING: "resyncing",
    State.DONE: "done",
}
SERVER_STATES = {
    State.CONNECTING: "asking",
    State.ONLINE: "streaming",
    State.OFFLINE: "no text: link down",
    State.RESYNCING: "asking again",
    State.DONE: "done",
}
# Control characters a model may write would move the cursor or restyle the terminal: each shows as one cell.
_SHOWN = {c: "\ufffd" for c in (*range(0x00, 0x09), *range(0x0B, 0x20), *range(0x7F, 0xA0))}


def shown(piece: str) -> str:
    """A token's text as the screen shows it: newlines and tabs kept, other control characters made visible."""
    return piece.translate(_SHOWN)


class Pane:
    """One stream's text, state and counters (see the module docstring)."""

    def __init__(self, view: SplitView, name: str, title: str, states: dict[State, str]):
        self.view, self.name, self.title, self.states = view, name, title, states
        self.tokens: list[int] = []
        self.tags: list[str] = []
        self.state = State.CONNECTING
        self.retracted = 0
        self.in_outages = 0  # see the module docstring: written alone (hybrid), came over a down link (server)
        self.stats: Stats | None = None  # the stream's own counters, set by the caller
        self.notes = LinkNotes()  # one note per change of the link's state, as every client surface says it

    def on_event(self, e: Event) -> None:
        with self.view.lock:
            for line in self.notes.lines(e):
                self.view.note(f"{self.name}: {line}")
            if e.kind == "tokens":
                self.tokens += e.tokens
                self.tags += [e.tag] * len(e.tokens)
                if e.tag == "offline" and self.view.link != "up":
                    self.in_outages += len(e.tokens)
            elif e.kind == "verify":
                self.tags[e.start : e.start + e.count] = ["verified"] * e.count
            elif e.kind == "retract":
                del self.tokens[len(self.tokens) - e.count :]
                del self.tags[len(self.tags) - e.count :]
                self.retracted += e.count
                self.view.note(f"{self.name}: rewind: {e.count} offline tokens retracted")
            elif e.kind == "state":
                self.state = e.state
            elif e.detail:
                self.view.note(f"{self.name}: {e.detail}")

    def arrived(self, n: int, asked_in: int) -> None:
        """`n` tokens came over the link for a request sent in outage `asked_in` (0: the link was up then)."""
        with self.view.lock:
            if asked_in and asked_in == self.view.outage():
                self.in_outages += n

    def text(self, cells: int) -> Text:
        """The prompt and the tokens, enough of their end to fill `cells` cells."""
        # A token shows as one cell or more, so the last `cells` tokens fill the pane; a multi-byte character cut
        # off at that start would show as a replacement character, above what fits anyway.
        start = max(0, len(self.tokens) - cells)
        out = Text(shown(self.view.prompt), style="dim") if start == 0 else Text()
        hidden = self.view.hidden
        context = [*self.view.context, *(t for t in self.tokens[:start] if t not in hidden)]
        kept = [(t, tag) for t, tag in zip(self.tokens[start:], self.tags[start:], strict=True) if t not in hidden]
        pieces = token_texts(self.view.tok, [t for t, _ in kept], context)
        for piece, (_, tag) in zip(pieces, kept, strict=True):
            out.append(shown(piece), style=STYLE[tag])
        return out

    def panel(self, cells: int) -> Panel:
        return Panel(
            _Tail(self.text(cells)),
            title=self.title,
            title_align="left",
            padding=(0, 1),
            border_style=STATE_STYLE[self.state],
        )


class _Tail:
    """The end of a text: the last lines of it, wrapped to the width given, that fit the height given."""

    def __init__(self, text: Text):
        self.text = text

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        height = options.height or options.size.height
        lines = self.text.wrap(console, options.max_width, overflow="fold")[-height:] if height > 0 else []
        yield Text("\n").join(lines) if lines else Text()


class _Fit:
    """A renderable drawn at most `width` x `height` cells, whatever the console's size."""

    def __init__(self, renderable: RenderableType, width: int, height: int):
        self.renderable, self.width, self.height = renderable, width, height

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        width = min(options.max_width, self.width)
        height = min(options.height or console.height, self.height)
        yield from console.render(self.renderable, options.update_dimensions(width, height))


class SplitView:
    def __init__(self, tokenizer: Tokenizer, prompt: str, *, netsim=None, console: Console | None = None):
        self.tok, self.prompt, self.netsim = tokenizer, prompt, netsim
        # As tether-client generate shows a text: after the prompt's ids (as both streams encode it), no end of text.
        self.context, self.hidden = tokenizer.encode(prompt), frozenset(tokenizer.eos_ids)
        self.console = console or Console()
        self.lock = threading.RLock()
        self.hybrid = Pane(self, "hybrid", "hybrid: the edge drafts", HYBRID_STATES)
        self.server = Pane(self, "server-only", "server-only: no drafter", SERVER_STATES)
        self.link = "up"
        self.outages = 0  # outages so far; the current one's number while the link is down
        self.link_since = self.t0 = time.monotonic()
        self.log = ""
        self.wire0 = (0, 0)  # netsim's counts when the view opened
        self.live = Live(console=self.console, get_renderable=self.render, refresh_per_second=12)

    def __enter__(self) -> SplitView:
        if self.netsim is not None:
            s = self.netsim.stats()
            self.wire0 = (s.up_bytes, s.down_bytes)
        self.t0 = self.link_since = time.monotonic()
        self.live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.live.__exit__(*exc)
        if not self.console.is_terminal:
            self.console.line()  # Live leaves its last screen without one on a pipe

    # ---- the link ----------------------------------------------------------------------------------------

    def link_change(self, state: str, act: Callable[[], object]) -> None:
        """Make the link `state` ("up", "cut", "stalled") by `act()`, recorded in the order the module docstring
        gives."""
        if state not in LINK_STYLE:
            raise ValueError(f"link state must be one of {', '.join(LINK_STYLE)}, not {state!r}")
        with self.lock:
            if state != "up":
                act()
            if self.link == "up" and state != "up":
                self.outages += 1
            self.link, self.link_since = state, time.monotonic()
            if state == "up":
                act()
            self.note(f"link {state}")

    def outage(self) -> int:
        """The number of the outage under way (1, 2, ...), or 0 while the link is up."""
        with self.lock:
            return 0 if self.link == "up" else self.outages

    def note(self, line: str) -> None:
        with self.lock:
            self.log = f"{time.monotonic() - self.t0:6.2f}s  {line}"

    # ---- the screen --------------------------------------------------------------------------------------

    def render(self) -> RenderableType:
        wire = None
        if self.netsim is not None:  # asked before the lock: the proxy's thread answers it
            s = self.netsim.stats()
            wire = (s.up_bytes - self.wire0[0], s.down_bytes - self.wire0[1])
        width = min(self.console.width, MAX_WIDTH)
        height = min(self.console.height, MAX_HEIGHT)
        cells = width * height  # more than a pane can show
        with self.lock:
            layout = Layout()
            layout.split_column(Layout(name="panes"), Layout(self._status(wire), size=STATUS_ROWS))
            layout["panes"].split_row(Layout(self.hybrid.panel(cells)), Layout(self.server.panel(cells)))
        return _Fit(layout, width, height)

    def _status(self, wire: tuple[int, int] | None) -> Group:
        now = time.monotonic()
        link = Text.assemble(("link ", "dim"), (self.link.upper(), LINK_STYLE[self.link]))
        if self.link != "up":
            link.append(f" {now - self.link_since:.1f} s")
        if wire is not None:
            link.append(f"   wire (both): up {wire[0]:,} B  down {wire[1]:,} B", "dim")
        link.append(f"   {now - self.t0:.1f} s", "dim")
        link.no_wrap, link.overflow = True, "ellipsis"
        table = Table.grid(expand=True, padding=(0, 1))
        table.add_column(width=15, no_wrap=True, style="dim")
        for _ in range(2):
            table.add_column(ratio=1, no_wrap=True, overflow="ellipsis")
        h, s = self.hybrid, self.server
        table.add_row("", Text("hybrid", "bold"), Text("server-only", "bold"))
        table.add_row("state", *(self._state(p) for p in (h, s)))
        table.add_row("tokens", *(self._tokens(p) for p in (h, s)))
        table.add_row(
            "in outages",
            Text(f"{h.in_outages} written alone", STYLE["offline"] if h.in_outages else ""),
            f"{s.in_outages} came over the link",
        )
        hs = h.stats or Stats()
        table.add_row("drafting", f"tau {hs.tau:.2f} in {hs.rounds} rounds", "none: the server decodes")
        table.add_row("payload up/dn", *(self._payload(p) for p in (h, s)))
        log = Text(self.log, style="dim", no_wrap=True, overflow="ellipsis")
        return Group(link, table, log)

    @staticmethod
    def _state(p: Pane) -> Text:
        return Text.assemble((p.state.value.upper(), f"bold {STATE_STYLE[p.state]}"), f" {p.states[p.state]}")

    @staticmethod
    def _tokens(p: Pane) -> Text:
        off = p.tags.count("offline")
        out = Text(str(len(p.tokens)), "bold")
        if off:
            out.append(f" ({off} offline)", STYLE["offline"])
        if p.retracted:
            out.append(f" {p.retracted} retracted")
        return out

    @staticmethod
    def _payload(p: Pane) -> str:
        st = p.stats or Stats()
        return f"{st.bytes_up:,} / {st.bytes_down:,} B"

    # ---- the end -----------------------------------------------------------------------------------------

    def summary(
        self, hybrid: Result, server: Result, *, wire: tuple[int, int] | None = None, server_calls: int = 0
    ) -> None:
        """The comparison, side by side; `wire` is netsim's (up, down) bytes of both streams together."""
        hs, ss = hybrid.stats, server.stats
        t = Table(
            title="hybrid and server-only: one prompt, one link, the same drops",
            box=box.SIMPLE_HEAD,
            width=min(self.console.width, MAX_WIDTH),
        )
        t.add_column("", style="dim", ratio=4)
        t.add_column("hybrid", justify="right", ratio=3)
        t.add_column("server-only", justify="right", ratio=3)
        h_off = hybrid.tags.count("offline")
        rows = [
            ("tokens", f"{len(hybrid.token_ids)} ({h_off} offline)", str(len(server.token_ids))),
            ("during outages", f"{self.hybrid.in_outages} written alone", f"{self.server.in_outages} over the link"),
            ("retracted (rewind)", str(hs.retracted), "-"),
            ("outages / resyncs", f"{hs.outages} / {hs.resyncs}", f"{ss.outages} / -"),
            ("tau / rounds", f"{hs.tau:.2f} / {hs.rounds}", "-"),
            ("payload up / down", f"{hs.bytes_up:,} / {hs.bytes_down:,} B", f"{ss.bytes_up:,} / {ss.bytes_down:,} B"),
            ("time to first token", f"{1000 * hs.ttft_s:.0f} ms", f"{1000 * ss.ttft_s:.0f} ms"),
            ("tokens/s", f"{hs.tokens_per_s:.1f}", f"{ss.tokens_per_s:.1f}"),
            ("wall", f"{hs.wall_s:.2f} s", f"{ss.wall_s:.2f} s"),
        ]
        if server_calls:
            rows.append(("Generate calls", "-", str(server_calls)))
        if hs.stopped or ss.stopped:
            rows.append(("stopped (Ctrl-C)", "yes" if hs.stopped else "no", "yes" if ss.stopped else "no"))
        for row in rows:
            t.add_row(*row)
        if wire is not None:
            t.caption = f"on the wire (netsim, both streams): up {wire[0]:,} B, down {wire[1]:,} B"
        self.console.print(t)
