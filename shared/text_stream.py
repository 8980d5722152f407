"""Generated token ids -> the text to show: characters whole, stop strings and stop ids honoured, special tokens
hidden. What an OpenAI choice's text is made of (tether.shared.openai_generation), on the server and the edge alike.

Contract: `TextStream(tokenizer, stop, stop_ids, hidden_ids, context)`: `push(token)` returns the text that may be
shown now (a character split across tokens waits until whole; text that could be the start of a stop string waits
until it is known not to be). A stop id (end of text) or a stop string ends it with finish_reason "stop"; the text
returned ends before the stop string; hidden ids (special tokens) add no text. `flush()` gives what was held.
`context`: the prompt ids the tokens continue, so the text reads as it does after the prompt (a SentencePiece-style
continuation's first space kept: Tokenizer.detokenizer(context=...)). Torch- and gRPC-free.

    text = TextStream(tokenizer, req.stop, stop_ids=fmt.stop_ids)
    for token in tokens:
        piece = text.push(token)
        if text.finish_reason:
            break

Tests: tests/shared/test_openai_api.py, tests/server/test_continuation_space.py.
"""

from __future__ import annotations

from collections.abc import Sequence

from tether.shared.tokenizer import Tokenizer


class TextStream:
    """Generated token ids -> the text to show, with stop ids and stop strings; see the module docstring."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        stop: Sequence[str] = (),
        *,
        stop_ids: frozenset[int] = frozenset(),
        hidden_ids: frozenset[int] = frozenset(),
        context: Sequence[int] = (),
    ):
        self.tokenizer, self.stop, self.stop_ids = tokenizer, tuple(stop), stop_ids
        self.hidden_ids = hidden_ids | stop_ids
        self.tokens = 0  # tokens consumed, the one that stopped it included
        self.finish_reason: str | None = None  # "stop" once a stop id or string was met
        self._held = ""  # decoded text that may be the start of a stop string
        self._detokenizer = tokenizer.detokenizer(context=context)

    def push(self, token: int) -> str:
        if self.finish_reason is not None:
            raise ValueError("the stream has finished")
        self.tokens += 1
        if token in self.stop_ids:
            text = self._cut(self._detokenizer.flush())  # what the detokenizer held back is final now
            self.finish_reason = "stop"
            return self._release(text + self._held)
        return "" if token in self.hidden_ids else self._cut(self._detokenizer.push([token]))

    def flush(self) -> str:
        """The text held back, once no more tokens come (the generation reached its length)."""
        if self.finish_reason is not None:
            return ""
        return self._release(self._cut(self._detokenizer.flush()) + self._held)

    def _release(self, text: str) -> str:
        self._held = ""
        return text

    def _cut(self, piece: str) -> str:
        """Add `piece` to the held text; return what is known not to be, or to precede, a stop string."""
        text = self._held + piece
        if not self.stop:
            return self._release(text)
        found = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        if found:
            self.finish_reason = "stop"
            return self._release(text[: min(found)])
        hold = 0
        for n in range(min(len(text), max(map(len, self.stop)) - 1), 0, -1):
            if any(s.startswith(text[-n:]) for s in self.stop):
                hold = n
                break
        self._held = text[len(text) - hold :]
        return text[: len(text) - hold]
