"""What an edge session gives its caller: its tokens, its events and state, its counters.

Contract:
- `SessionOutput(cfg, text, on_event, started_at, save)`: `emit(tokens, tag, logprobs)` appends tokens to the
  session's text (tether.client.session_text) as they are decided: at most up to `cfg.max_new_tokens`, through the
  first of `stop_ids`, at `cfg.pace_tokens_per_s` when it is set (a token at a time), each batch counted in
  `stats`, saved (`save`: the session file) and told as Event "tokens" (tag "verified" or "offline", with one
  TokenLogprobs per token when the caller asked for `logprobs`). `set_state(state, detail)` tells a change of
  State as Event "state"; `tell(event)` any other event.
- The caller's settings, read at every use so that they may change between generations: `on_event`, `stop_ids`
  (every end-of-text id and the config's stop ids once paired, and what a chat or the edge API adds), `logprobs`
  (report each token's logprob and this many top ones'; None: none).
- `stats`: this generation's Stats; `new_turn(reopened)` starts the next generation's (a chat's turn) and its time
  to first token.

Tests: tests/e2e (every generation), tests/client/test_outage_notes.py (the events a surface prints).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from tether.client.session_text import SessionText
from tether.client.session_types import ClientConfig, Event, State, Stats
from tether.shared.sampling import TokenLogprobs


class SessionOutput:
    """The tokens, events, state and counters a session gives its caller; see the module docstring."""

    def __init__(
        self,
        cfg: ClientConfig,
        text: SessionText,
        on_event: Callable[[Event], None] | None,
        started_at: float,
        save: Callable[[], None],
    ):
        self.cfg, self.text, self.save = cfg, text, save
        self.on_event = on_event or (lambda e: None)
        self.stop_ids: frozenset[int] | None = None  # tokens that end a generation (pairing adds end-of-text)
        # Report each token's logprob and this many top ones' (Event.logprobs; the edge's HTTP API sets it per
        # request): the server's for verified tokens, the drafter's own offline (tether.client.logprobs); None: none.
        self.logprobs: int | None = None
        self.stats = Stats()
        self.state = State.CONNECTING
        self.started_at = started_at  # when the command (or a chat's turn) began: Stats.ttft_from_start_s
        self.prompt_sent_at = 0.0  # when the prompt was sent: Stats.ttft_s
        self._last_emit = 0.0

    @property
    def ends(self) -> frozenset[int]:
        return self.stop_ids or frozenset()

    def tell(self, event: Event) -> None:
        self.on_event(event)

    def set_state(self, state: State, detail: str = "") -> None:
        if state != self.state:
            self.state = state
            self.on_event(Event("state", state=state, detail=detail))

    def new_turn(self, reopened: bool) -> None:
        """The next generation (a chat's turn) begins now: counters of its own, its own time to first token."""
        self.stats = Stats(reopened=int(reopened))
        self.prompt_sent_at = self.started_at = time.monotonic()

    def emit(self, tokens: list[int], tag: str, logprobs: list[TokenLogprobs] | None = None) -> None:
        room = self.cfg.max_new_tokens - len(self.text.tokens)
        tokens = tokens[:room]
        end = next((i + 1 for i, t in enumerate(tokens) if t in self.ends), None)
        tokens = tokens[:end]
        if not tokens:
            return
        if self.cfg.pace_tokens_per_s > 0:
            for i, t in enumerate(tokens):
                wait = self._last_emit + 1.0 / self.cfg.pace_tokens_per_s - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                self._last_emit = time.monotonic()
                self._append([t], tag, None if logprobs is None else logprobs[i : i + 1])
        else:
            self._append(tokens, tag, None if logprobs is None else logprobs[: len(tokens)])

    def _append(self, tokens: list[int], tag: str, logprobs: list[TokenLogprobs] | None) -> None:
        self.text.append(tokens, tag)
        self.stats.token_emitted(len(tokens), self.prompt_sent_at, time.monotonic(), self.started_at)
        self.save()
        self.on_event(Event("tokens", tokens=tokens, tag=tag, logprobs=logprobs))
