"""`tether-client chat`: a conversation with the model, drafted on the edge and verified by the server, that goes on
answering while the link is down.

    tether-client chat --server HOST:PORT [--system TEXT] [--history-file PATH]
    printf 'hello\\nand then?\\n' | tether-client chat --server HOST:PORT     # one message a line, replies on stdout

Contract:
- `Conversation(chat_format, system="")` keeps the messages (an optional system message, then user and assistant
  in turn) and renders them with the model's chat template (tether.shared.chat_template: the server sends it in
  ModelInfo.chat_format_json), as the server's HTTP API renders them. `ask(text, held)` adds a user message and
  returns the token ids of the whole conversation with the generation prompt; `answer(ids)` adds the assistant's
  message: the reply's text without the tokens the template hides (its end of turn, special tokens). The built-in
  template renders a reply exactly as the model wrote it. A template that changes the whitespace around it (one
  that writes "assistant: " + content, or trims it) would render the reply as the model did not write it; the
  assistant message then keeps the copy without its leading whitespace when its rendering keeps more of `held`
  (the session's tokens), so that the server session can be extended rather than reopened. A message the template
  refuses (ChatTemplateError) is not added.
- `Chat(engine, chat_format, system="")`: `reply(text, on_event)` -> Result, one turn, over one of two engines.
  An EdgeSession, paired, kept open across turns: each turn extends the one server session with only the new
  tokens (EdgeSession.extend: a Resync) and drafts offline when the server is gone; its greedy reply is what a fresh
  session over the whole rendered conversation gives. A ServerOnlySession, for a server without a drafter: each
  turn is a Generate over the whole conversation (such a server holds no session). A reply ends at the template's
  end of turn, any end-of-text id, a stop token id or max_new_tokens (none of those ids is part of its text).
  Ctrl-C while it streams (`interruptible`) stops it after the step in progress: what was shown stays in the
  conversation. `close()` closes the server session.
- `LineReader(history_file, interactive)`: a line at a time; on a terminal through the standard library's readline
  (line editing, history kept in `history_file`, at most HISTORY_LENGTH lines, owner-only), from a pipe one message
  a line. EOFError at the end of input, KeyboardInterrupt on Ctrl-C.
- `repl(chat, reader, ...)` -> exit status: 0 at the end of input or Ctrl-D, 130 on Ctrl-C at the prompt (both
  end the chat cleanly); a message the chat template refuses is answered with one line and the chat goes on; what
  the server refuses propagates (tether-client prints one line, status 1).
- `interruptible(stop)`: Ctrl-C calls stop() (the generation ends at its next step); a second Ctrl-C raises
  KeyboardInterrupt. Only in the main thread (elsewhere signals are not ours). `generate` uses it too.

Tests: tests/client/test_chat.py (the conversation, the reader, Ctrl-C), tests/e2e/test_chat_e2e.py (a real server:
one server session across turns, replies equal to fresh sessions', a dead server, a server without a drafter).
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TextIO

from rich.console import Console

from tether.client.live_view import ChatStream, summary_line
from tether.client.server_only import ServerOnlySession
from tether.client.session import EdgeSession, Event, LinkDown, Result
from tether.shared import env  # the one module that reads the environment
from tether.shared.chat_template import ChatFormat, ChatTemplateError

HISTORY_LENGTH = 1000  # lines of input history kept
HISTORY_NAME = "chat_history"
MIN_RESERVE = 1024  # positions a chat's session keeps for later turns at least (drafter caches: ~KBs a position)


def default_history_file() -> Path:
    """$XDG_STATE_HOME/tether/chat_history, or ~/.local/state/tether/chat_history (the XDG base directory spec)."""
    state = env.value("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "tether" / HISTORY_NAME


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


class Conversation:
    """The messages of a chat and their rendering; see the module docstring."""

    def __init__(self, chat_format: ChatFormat, system: str = ""):
        self.format = chat_format
        self.messages: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
        self.hidden = chat_format.hidden_ids | chat_format.stop_ids

    def ids(self, messages: list[dict[str, str]]) -> list[int]:
        return self.format.encode(self.format.render(messages))

    def ask(self, text: str, held: list[int]) -> list[int]:
        """Add the user's message; the ids of the conversation to generate after."""
        user = {"role": "user", "content": text}
        last = self.messages[-1] if self.messages else None
        if last is not None and last["role"] == "assistant":
            reply = last["content"]
            variants = [reply] + [v for v in (reply.strip(), reply[1:] if reply[:1].isspace() else reply) if v != reply]
            earlier = self.messages[:-1]
            # The first of the best: the reply as shown unless another copy keeps more of the session's tokens.
            last["content"] = max(
                variants,
                key=lambda v: _common_prefix(self.ids([*earlier, {"role": "assistant", "content": v}, user]), held),
            )
        ids = self.ids([*self.messages, user])  # a refusal (ChatTemplateError) leaves the conversation as it was
        self.messages.append(user)
        return ids

    def answer(self, token_ids: list[int]) -> str:
        """Add the assistant's message from the reply's tokens; returns its text."""
        text = self.format.tokenizer.decode([t for t in token_ids if t not in self.hidden])
        self.messages.append({"role": "assistant", "content": text})
        return text

    def withdraw(self) -> None:
        """Take back the last user message (its turn failed before any reply)."""
        if self.messages and self.messages[-1]["role"] == "user":
            self.messages.pop()


class Chat:
    """One conversation over an EdgeSession (paired) or a ServerOnlySession; see the module docstring."""

    def __init__(self, engine: EdgeSession | ServerOnlySession, chat_format: ChatFormat, system: str = ""):
        self.engine = engine
        self.conversation = Conversation(chat_format, system)
        self.turns = 0
        # The template's end of turn besides every end-of-text id and stop id the engine ends at already; none of
        # them is part of a reply's text.
        engine.stop_ids = (engine.stop_ids or frozenset()) | chat_format.stop_ids
        self.conversation.hidden |= engine.stop_ids
        if isinstance(engine, EdgeSession):
            engine.keep_open = True  # the next turn extends the server session

    def reply(self, text: str, on_event: Callable[[Event], None] | None = None) -> Result:
        """One turn: the reply to `text`, streamed to `on_event` as it comes (Ctrl-C stops it)."""
        e = self.engine
        held = e.sequence if isinstance(e, EdgeSession) else []
        ids = self.conversation.ask(text, held)
        try:
            if isinstance(e, EdgeSession) and self.turns and e.extend(ids):
                ids = []  # the session holds them now: run() resyncs only the new ones in
            elif isinstance(e, EdgeSession):
                e.reserve = self._reserve(e, ids)  # a new server session: room for a few more turns in it
            e.on_event = on_event or (lambda ev: None)
            with interruptible(e.stop):
                result = e.run(ids) if ids else e.run()
        except BaseException:
            self.conversation.withdraw()
            raise
        self.turns += 1
        self.conversation.answer(result.token_ids)
        return result

    @staticmethod
    def _reserve(session: EdgeSession, ids: list[int]) -> int:
        """Positions a new session keeps for later turns: as many as this turn takes (so a long chat reopens its
        session a logarithmic number of times) and at least MIN_RESERVE, within the model's context."""
        need = len(ids) + session.cfg.max_new_tokens + session.cfg.k + 2
        return max(0, min(max(need, MIN_RESERVE), session.max_positions - need))

    def close(self) -> None:
        if isinstance(self.engine, EdgeSession):
            self.engine.close()


@contextlib.contextmanager
def interruptible(stop: Callable[[], None]) -> Iterator[None]:
    """Within: Ctrl-C calls `stop()`, a second one raises KeyboardInterrupt (see the module docstring)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pressed = False

    def on_sigint(signum, frame) -> None:
        nonlocal pressed
        if pressed:
            raise KeyboardInterrupt
        pressed = True
        stop()

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


class LineReader:
    """A message a line from the user; see the module docstring."""

    def __init__(self, history_file: str | Path | None, *, interactive: bool, stdin: TextIO | None = None):
        self.stdin = stdin or sys.stdin
        self.history = Path(history_file).expanduser() if history_file else None
        self.readline = None
        if interactive:
            try:
                import readline  # line editing and history; absent on some platforms: plain input() then
            except ImportError:
                readline = None
            self.readline = readline
        if self.readline is not None:
            self.readline.set_history_length(HISTORY_LENGTH)
            if self.history is not None and self.history.is_file():
                with contextlib.suppress(OSError):
                    self.readline.read_history_file(self.history)
        self.interactive = interactive

    def __call__(self, prompt: str) -> str:
        if self.interactive:
            return input(prompt)
        line = self.stdin.readline()
        if not line:
            raise EOFError
        return line.rstrip("\r\n")

    def close(self) -> None:
        """Save the history (owner-only: a chat may hold what others should not read)."""
        if self.readline is None or self.history is None:
            return
        with contextlib.suppress(OSError):
            self.history.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            self.readline.write_history_file(self.history)
            self.history.chmod(0o600)


def repl(chat: Chat, reader: Callable[[str], str], *, out: Console, err: TextIO) -> int:
    """Read messages and answer them until the input ends; see the module docstring."""
    tokenizer = chat.conversation.format.tokenizer
    while True:
        try:
            line = reader("> ")
        except EOFError:
            return 0
        except KeyboardInterrupt:
            err.write("\n")
            return 130
        if not line.strip():
            continue
        view = ChatStream(tokenizer, chat.conversation.hidden, console=out, err=err)
        try:
            result = chat.reply(line, view.on_event)
        except LinkDown as e:  # a server without a drafter gone: nothing to answer from, the chat goes on
            out.print()
            err.write(f"[tether: no reply: the server is unreachable ({e}); send again when it is back]\n")
            continue
        except ChatTemplateError as e:  # the model's template refuses this message: say so, nothing was sent
            err.write(f"[tether: not sent: {e}]\n")
            continue
        out.print()
        err.write(f"[{summary_line(result)}]\n")
