"""The edge session's text: the prompt, the tokens generated after it with their tags, and the verified length.

One record, one owner (tether.client.session.EdgeSession holds it; its rounds, resync and online modes hold a
reference): the methods below are its only writers, so where the text or the verified length changes is a short
list to read. It holds token ids only; text is the callers' (tether.client.cli, chat, edge_api).

Contract:
- `prompt` [P], `tokens` [T] (generated and emitted, the root included; retracted ones removed), `tags` [T]
  ("verified" or "offline", one per token), `verified` (positions of `sequence` whose verified states the drafter
  holds, the prompt included; the token at `verified` is the root, the target's last decision).
- Writers: `start(prompt, verified)` (a generation's prompt: a new one, or a chat's next turn over a session that
  holds `verified` positions of it), `restore(prompt, tokens, tags)` (a session file's), `append(tokens, tag)`,
  `retract(n)` (the last n, offline ones), `adopt(length)` (a delta adopted: the drafter now holds `length`
  verified positions), `verify(length)` (the same after a resync: the offline tokens it kept are tagged verified
  here, the one place tags change, and their runs are returned for the caller to tell as Event "verify").
- Readers take the lists as they are and do not change them.

Tests: tests/client/test_session_text.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SessionText:
    """The session's text as token ids; see the module docstring."""

    prompt: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    tags: list[str] = field(default_factory=list)
    verified: int = 0

    @property
    def sequence(self) -> list[int]:
        """The prompt and the tokens generated after it."""
        return self.prompt + self.tokens

    def start(self, prompt: list[int], verified: int = 0) -> None:
        """A generation's prompt, nothing generated yet; `verified`: positions of it the drafter holds already."""
        self.prompt, self.tokens, self.tags, self.verified = list(prompt), [], [], verified

    def restore(self, prompt: list[int], tokens: list[int], tags: list[str]) -> None:
        """A saved generation's text; nothing verified until the drafter holds its states again."""
        self.prompt, self.tokens, self.tags, self.verified = list(prompt), list(tokens), list(tags), 0

    def append(self, tokens: list[int], tag: str) -> None:
        self.tokens += tokens
        self.tags += [tag] * len(tokens)

    def retract(self, n: int) -> None:
        """Take back the last `n` tokens (offline ones a resync under rewind did not keep)."""
        del self.tokens[len(self.tokens) - n :]
        del self.tags[len(self.tags) - n :]

    def adopt(self, length: int) -> None:
        """The drafter holds the verified states of the first `length` positions now."""
        self.verified = length

    def verify(self, length: int) -> list[tuple[int, int]]:
        """As adopt(), after a resync kept the positions up to `length`: the offline tokens among them are tagged
        verified. Returns each run of them as (index among the generated tokens, count)."""
        start, self.verified = self.verified, length
        i, end = max(start - len(self.prompt), 0), min(max(length - len(self.prompt), 0), len(self.tags))
        runs = []
        while i < end:
            j = i
            while j < end and self.tags[j] == "offline":
                j += 1
            if j > i:
                self.tags[i:j] = ["verified"] * (j - i)
                runs.append((i, j - i))
            i = j + 1
        return runs
