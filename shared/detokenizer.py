"""Streaming detokenisation: token ids in as they are generated, text out in pieces, for every tokenizer family.

Contract: `Tokenizer.detokenizer()` makes one per stream (tether.shared.tokenizer). `push(ids)` returns the text
those ids add that no later id can change; `flush()` returns the rest once no more ids come. For any ids, pushed
in any chunks, `"".join(pieces) + flush() == tokenizer.decode(all ids)`: the same text the full decode gives,
Metaspace's dropped leading space and a WordPiece or Unigram family's spacing included. A character whose bytes
arrive over several tokens (byte-level BPE, byte fallback) comes out once, whole: never split, never as U+FFFD.
`Tokenizer.detokenizer(context=prompt_ids)` streams a continuation: the text the ids add after the prompt, as the
decode of prompt and continuation together reads (`Tokenizer.decode(ids, after=prompt_ids)`, what transformers'
text-generation pipeline and vLLM return): a SentencePiece-style continuation's first word keeps its space ("The
quick" + "▁brown" reads "The quick brown", where decoding "▁brown" alone drops it). Only the last CONTEXT_IDS ids
of the prompt are decoded (vLLM's window; with byte fallback, from the start of the run of byte tokens it ends
in), so a prompt ending inside a character (its bytes cut short) reads as the library decodes that window.

How: the vLLM / `tokenizers.decoders.DecodeStream` window. Each push decodes ids[prefix:] and ids[prefix:read]
(the context: ids already shown, decoded again so that a decoder's first-token rules, such as stripping the
leading space, treat both alike) and shows the difference. Text is held back while it may still change:
- it ends in U+FFFD: the last character may be incomplete (its other bytes come with the next token);
- the last id is a byte-fallback token (`<0xE4>`): the ByteFallback decoder turns a whole run of such tokens into
  U+FFFD, one per byte, as soon as one byte of the run is not valid UTF-8, so a later byte can change a character
  already complete;
- transformers' clean_up_tokenization_spaces (" ." -> "." and the like, on the whole text) is on: text after the
  last character that no clean-up pattern contains, since such a character is never part of a match and splits
  the clean-up exactly.
Cost per token is bounded by the window (the ids since the last text shown), not the whole text.

Tested by tests/shared/test_tokenizer_families.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

CONTEXT_IDS = 5  # prompt ids decoded before a continuation: enough for any decoder's first-token rule

# transformers' PreTrainedTokenizerBase.clean_up_tokenization, in its order (each replace sees the previous one's
# output); decoding applies it when tokenizer_config.json asks (clean_up_tokenization_spaces) and the model is not BPE.
_CLEANUPS = (
    (" .", "."),
    (" ?", "?"),
    (" !", "!"),
    (" ,", ","),
    (" ' ", "'"),
    (" n't", "n't"),
    (" 'm", "'m"),
    (" 's", "'s"),
    (" 've", "'ve"),
    (" 're", "'re"),
)
_CLEANUP_CHARS = frozenset("".join(dirty for dirty, _ in _CLEANUPS))


def clean_up_tokenization_spaces(text: str) -> str:
    """transformers' clean-up of spaces before punctuation and English contractions, exactly as it applies it."""
    for dirty, clean in _CLEANUPS:
        text = text.replace(dirty, clean)
    return text


class Detokenizer:
    """One stream's decoder: `push(ids) -> str`, then `flush() -> str`; see the module docstring."""

    def __init__(
        self,
        decode: Callable[[list[int]], str],
        *,
        byte_token_ids: frozenset[int] = frozenset(),
        clean_up_spaces: bool = False,
        context: Sequence[int] = (),
    ) -> None:
        # `decode` is the library's decode without clean-up; `byte_token_ids` the ids a ByteFallback decoder reads
        # as bytes (empty when the decoder has none); `context` the ids the stream continues (a prompt).
        self._decode = decode
        self._byte_token_ids = byte_token_ids
        self._clean_up_spaces = clean_up_spaces
        start = max(0, len(context) - CONTEXT_IDS)
        # ByteFallback reads a run of byte tokens as one: a window starting inside a run would read it otherwise.
        while 0 < start < len(context) and context[start] in byte_token_ids and context[start - 1] in byte_token_ids:
            start -= 1
        self._ids: list[int] = [int(i) for i in context[start:]]
        self._prefix, self._read = 0, len(self._ids)  # ids[prefix:read] were shown and are decoded again as context
        self._unclean = ""  # shown-to-be text that a clean-up pattern may still span

    def push(self, ids: Iterable[int]) -> str:
        """The text `ids` (appended to those pushed before) add, as far as later ids cannot change it."""
        self._ids.extend(int(i) for i in ids)
        return self._clean(self._advance(final=False), final=False)

    def flush(self) -> str:
        """Everything held back, once no more ids come (a character still incomplete then shows as U+FFFD)."""
        return self._clean(self._advance(final=True), final=True)

    def _advance(self, *, final: bool) -> str:
        if self._read == len(self._ids):
            return ""
        if not final and self._ids[-1] in self._byte_token_ids:
            return ""
        context = self._decode(self._ids[self._prefix : self._read])
        text = self._decode(self._ids[self._prefix :])
        if not final and text.endswith("\ufffd"):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(context) :]

    def _clean(self, text: str, *, final: bool) -> str:
        if not self._clean_up_spaces:
            return text
        held = self._unclean + text
        cut = len(held)
        if not final:
            while cut > 0 and held[cut - 1] in _CLEANUP_CHARS:
                cut -= 1
        self._unclean = held[cut:]
        return clean_up_tokenization_spaces(held[:cut])
