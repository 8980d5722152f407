"""Byte-level BPE tokenizer: a thin, lossless wrapper around the Hugging Face `tokenizers` library.

Contract:
- `encode(text)` never adds special tokens and never turns special-token text that occurs inside `text`
  (say a source file containing "<|endoftext|>") into a special id; `decode(encode(text)) == text` for every
  str that UTF-8 can encode. There is no normalizer, so whitespace, "\\r\\n" and any Unicode survive as-is.
- Every one of the 256 byte values has its own token, so `decode_bytes(encode_bytes(data)) == data` for
  arbitrary bytes, invalid UTF-8 included. `decode_bytes` is what a streaming printer wants: one token may
  hold part of a multi-byte character, and only the concatenated bytes decode cleanly.
- Text from the other end (`from_json`, how the client receives the server's) is checked before the library loads
  it (tether.shared.tokenizer_trust: size, nesting, regexes that may backtrack for ever), a ValueError in one
  line; a failure inside the library while encoding or decoding (a Rust panic) is TokenizerFailed, a ValueError.
- `sha256` identifies the tokenizer (vocabulary, merges, special tokens, pre-tokenizer, decoder); the client
  and the server compare it before they agree to share token ids.
- Tokenizers trained here have `<|endoftext|>` as id 0 (eos, also the document separator in corpora) and
  `<|pad|>` as id 1. A wrapped foreign tokenizer (say a Qwen2 tokenizer.json) keeps its own ids; its eos is
  `<|endoftext|>` when it has that special token, else whatever `eos_id=` says, else (from_pretrained, a model
  folder) the end-of-text its configs name, else None.

    from tether.shared.tokenizer import Tokenizer
    tok = Tokenizer.train(["a.py", "b.py"], vocab_size=4096)
    tok.save_pretrained("runs/tok")                      # writes runs/tok/tokenizer.json
    tok = Tokenizer.from_pretrained("runs/tok")
    assert tok.decode(tok.encode("def f(x):\\n\\treturn x")) == "def f(x):\\n\\treturn x"

Tested by tests/shared/test_tokenizer.py (`python -m pytest tests/shared/test_tokenizer.py -q`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from tether.shared.tokenizer_trust import check_tokenizer_json
from tether.shared.weights import canonical_tokenizer_json

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = (EOS_TOKEN, PAD_TOKEN)  # trainer order fixes their ids: eos 0, pad 1

# `surrogateescape` turns each byte that is not part of valid UTF-8 into one lone surrogate U+DC80..U+DCFF.
# Strictly decoded UTF-8 never yields those code points (Python rejects encoded surrogates), so every one
# of them in the decoded string stands for exactly one raw byte.
_ESCAPED_BYTES = re.compile("([\udc80-\udcff]+)")


@functools.cache
def _byte_to_char() -> dict[int, str]:
    """GPT-2's byte -> printable character table, the alphabet the ByteLevel pre-tokenizer writes tokens in.

    `pre_tokenizers.ByteLevel.alphabet()` gives the same 256 characters but as an unordered set, so the
    byte each one stands for has to be rebuilt with the published algorithm; we check the two agree.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + shifted)
            shifted += 1
    if set(table.values()) != set(pre_tokenizers.ByteLevel.alphabet()):
        raise RuntimeError("this `tokenizers` build uses a different byte-level alphabet than GPT-2's")
    return table


def _read_utf8(path: str | Path) -> str:
    # Decode the raw bytes ourselves: Path.read_text would translate "\r\n" to "\n" and the tokenizer
    # would never learn (or reproduce) the file as it is on disk.
    return Path(path).read_bytes().decode("utf-8")


def _is_byte_level(backend: tokenizers.Tokenizer) -> bool:
    """True when the backend's decoder is ByteLevel, i.e. its vocabulary is spelled in the byte alphabet."""
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    parts = decoder.get("decoders", []) if decoder.get("type") == "Sequence" else [decoder]
    return any(part.get("type") == "ByteLevel" for part in parts)


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def _model_eos_id(directory: Path, backend: tokenizers.Tokenizer) -> int | None:
    """The end-of-text id a model folder's configs name (Tokenizer.from_pretrained), or None."""
    size = backend.get_vocab_size(with_added_tokens=True)
    for name in ("config.json", "generation_config.json"):
        eos = _read_json(directory / name).get("eos_token_id")
        eos = eos[0] if isinstance(eos, list) and eos else eos
        if isinstance(eos, int) and not isinstance(eos, bool) and 0 <= eos < size:
            return eos
    eos_token = _read_json(directory / "tokenizer_config.json").get("eos_token")
    if isinstance(eos_token, dict):
        eos_token = eos_token.get("content")
    return backend.token_to_id(eos_token) if isinstance(eos_token, str) else None


class TokenizerFailed(ValueError):
    """The library failed inside encoding or decoding (a Rust panic: a regex past its retry limit, ...)."""


def _guarded(call, *args, **kwargs):
    """`call(...)` with the library's Rust panics, which pyo3 raises as PanicException (a BaseException, so past
    `except Exception`), turned into TokenizerFailed: one line, the process goes on."""
    try:
        return call(*args, **kwargs)
    except (Exception, KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except BaseException as e:
        detail = " ".join(str(e).split())[:200]
        raise TokenizerFailed(f"the tokenizer failed on this text: {detail}") from None


class Tokenizer:
    """A byte-level BPE tokenizer; build one with `train`, `from_file`, `from_pretrained` or `from_tokenizers`."""

    def __init__(self, backend: tokenizers.Tokenizer, *, eos_id: int | None, pad_id: int | None) -> None:
        # Takes ownership of `backend`; callers outside this module should use `from_tokenizers`, which copies
        # it and switches off the behaviours (special-token parsing, truncation, padding) that lose text.
        size = backend.get_vocab_size(with_added_tokens=True)
        for name, value in (("eos_id", eos_id), ("pad_id", pad_id)):
            if value is not None and not 0 <= value < size:
                raise ValueError(f"{name}={value} is outside the vocabulary (size {size})")
        self._backend = backend
        self._eos_id = eos_id
        self._pad_id = pad_id

    # ---- construction ---------------------------------------------------------------------------------------

    @classmethod
    def train(
        cls,
        files: Iterable[str | Path] | None = None,
        *,
        texts: Iterable[str] | None = None,
        vocab_size: int = 4096,
        min_frequency: int = 2,
        show_progress: bool = False,
    ) -> Tokenizer:
        """Train a byte-level BPE on UTF-8 `files` and/or `texts` (files first); `vocab_size` counts specials.

        Each file or text is one training sequence. The vocabulary ends up smaller than `vocab_size` only
        when the data run out of pairs seen `min_frequency` times.
        """
        if files is None and texts is None:
            raise ValueError("Tokenizer.train needs files, texts, or both")
        smallest = 256 + len(SPECIAL_TOKENS)
        if vocab_size < smallest:
            raise ValueError(f"vocab_size={vocab_size} is below {smallest} (one token per byte plus the specials)")

        backend = tokenizers.Tokenizer(models.BPE())
        # No normalizer: any normalization (NFC, stripping) would break the exact text round trip.
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            min_frequency=min_frequency,
            special_tokens=list(SPECIAL_TOKENS),
            # Seeding all 256 bytes means no input is ever out of vocabulary, even bytes the data never had.
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=show_progress,
        )

        def sequences() -> Iterator[str]:
            # Whole documents, not lines (which is what `backend.train(files)` would feed): the ByteLevel
            # regex keeps runs such as "\n\n    " together, and those are the commonest tokens in code.
            for path in files or ():
                yield _read_utf8(path)
            yield from texts or ()

        backend.train_from_iterator(sequences(), trainer=trainer)
        tok = cls.from_tokenizers(backend)
        if (tok.eos_id, tok.pad_id) != (0, 1):
            raise RuntimeError(f"trainer placed the special tokens at {tok.eos_id}, {tok.pad_id}, expected 0, 1")
        return tok

    @classmethod
    def from_tokenizers(
        cls, backend: tokenizers.Tokenizer, *, eos_id: int | None = None, pad_id: int | None = None
    ) -> Tokenizer:
        """Wrap a copy of `backend`; eos/pad default to its `<|endoftext|>`/`<|pad|>` special tokens, if any."""
        # A copy, because the switches below would otherwise change the caller's object behind its back.
        backend = tokenizers.Tokenizer.from_str(backend.to_str())
        # `tokenizers` matches added special tokens in raw input even with add_special_tokens=False; this
        # runtime flag (not saved in tokenizer.json, hence set on every load) makes them plain text.
        backend.encode_special_tokens = True
        # Some Hugging Face tokenizer.json files ship with truncation or padding on; both alter the ids.
        backend.no_truncation()
        backend.no_padding()
        specials = {t.content: i for i, t in backend.get_added_tokens_decoder().items() if t.special}
        return cls(
            backend,
            eos_id=specials.get(EOS_TOKEN) if eos_id is None else eos_id,
            pad_id=specials.get(PAD_TOKEN) if pad_id is None else pad_id,
        )

    @classmethod
    def from_file(cls, path: str | Path, *, eos_id: int | None = None, pad_id: int | None = None) -> Tokenizer:
        """Load a tokenizer.json written by `save` (or by any Hugging Face tokenizer)."""
        return cls.from_tokenizers(tokenizers.Tokenizer.from_file(str(path)), eos_id=eos_id, pad_id=pad_id)

    @classmethod
    def from_pretrained(
        cls, directory: str | Path, *, eos_id: int | None = None, pad_id: int | None = None
    ) -> Tokenizer:
        """Load `directory`/tokenizer.json (a local folder; nothing is downloaded). A model folder's tokenizer
        without `<|endoftext|>` (and no `eos_id=`) takes the model's end-of-text where transformers keeps it:
        config.json's eos_token_id (the first of a list; Llama 3's `<|end_of_text|>`), else
        generation_config.json's, else tokenizer_config.json's eos_token; else there is none."""
        directory = Path(directory)
        tok = cls.from_file(directory / "tokenizer.json", eos_id=eos_id, pad_id=pad_id)
        if tok.eos_id is None and (eos := _model_eos_id(directory, tok._backend)) is not None:
            tok._eos_id = eos
        return tok

    @classmethod
    def from_json(cls, text: str, *, eos_id: int | None = None, pad_id: int | None = None) -> Tokenizer:
        """A tokenizer from tokenizer.json text (how the client receives it from the server), checked first
        (tether.shared.tokenizer_trust: a pattern that may backtrack for ever is a ValueError, one line)."""
        check_tokenizer_json(text)
        return cls.from_tokenizers(_guarded(tokenizers.Tokenizer.from_str, text), eos_id=eos_id, pad_id=pad_id)

    def to_json(self) -> str:
        """tokenizer.json text (Hugging Face format)."""
        return self._backend.to_str()

    def save(self, path: str | Path) -> None:
        """Write the tokenizer as one tokenizer.json file (Hugging Face format)."""
        self._backend.save(str(path), pretty=True)

    def save_pretrained(self, directory: str | Path) -> None:
        """Write `directory`/tokenizer.json, creating the folder if needed."""
        Path(directory).mkdir(parents=True, exist_ok=True)
        self.save(Path(directory) / "tokenizer.json")

    # ---- identity -------------------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of ids, special tokens included."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def eos_id(self) -> int | None:
        return self._eos_id

    @property
    def pad_id(self) -> int | None:
        return self._pad_id

    @property
    def sha256(self) -> str:
        """Hex sha256 of the canonical tokenizer.json: the library's serialization, keys sorted, no whitespace.

        Independent of how a file was formatted on disk; it does depend on the serialization format of the
        `tokenizers` version, so client and server should run compatible versions.
        """
        return hashlib.sha256(canonical_tokenizer_json(self._backend.to_str())).hexdigest()

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size}, eos_id={self.eos_id}, pad_id={self.pad_id})"

    # ---- text -----------------------------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; no special tokens are added and none are recognised inside it."""
        try:
            return _guarded(self._backend.encode, text, add_special_tokens=False).ids
        except TypeError as err:
            # The library's message for a lone surrogate ("TextInputSequence must be str") hides the cause.
            if isinstance(text, str):
                raise ValueError("text contains a lone surrogate, which UTF-8 cannot encode") from err
            raise

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """`encode` over many texts at once, in parallel inside the library."""
        return [e.ids for e in _guarded(self._backend.encode_batch, list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`; special tokens appear as their literal text, stray partial characters as U+FFFD."""
        return _guarded(self._backend.decode, [int(i) for i in ids], skip_special_tokens=False)

    # ---- bytes ----------------------------------------------------------------------------------------------

    @functools.cached_property
    def _bytes_of_id(self) -> dict[int, bytes]:
        # Built on first use: a 150k-entry foreign vocabulary takes a noticeable fraction of a second.
        if not _is_byte_level(self._backend):
            raise ValueError("byte-level encoding needs a tokenizer whose decoder is ByteLevel")
        byte_of_char = {c: b for b, c in _byte_to_char().items()}
        table: dict[int, bytes] = {}
        for token, i in self._backend.get_vocab(with_added_tokens=False).items():
            try:
                table[i] = bytes(byte_of_char[c] for c in token)
            except KeyError as err:
                raise ValueError(f"token {i} ({token!r}) is not spelled in the byte-level alphabet") from err
        # Added tokens (specials included) are stored as their literal text, not in the byte alphabet.
        for i, added in self._backend.get_added_tokens_decoder().items():
            table[i] = added.content.encode("utf-8")
        return table

    @functools.cached_property
    def _id_of_byte(self) -> list[int]:
        if not _is_byte_level(self._backend):
            raise ValueError("byte-level encoding needs a tokenizer whose decoder is ByteLevel")
        ids = [self._backend.token_to_id(c) for _, c in sorted(_byte_to_char().items())]
        missing = [b for b, i in enumerate(ids) if i is None]
        if missing:
            raise ValueError(f"tokenizer has no single-byte token for bytes {missing[:8]}")
        return ids

    def encode_bytes(self, data: bytes) -> list[int]:
        """Token ids of arbitrary bytes: valid UTF-8 runs encode as text, each other byte as its own token."""
        pieces = _ESCAPED_BYTES.split(bytes(data).decode("utf-8", errors="surrogateescape"))
        # split() with a capturing group alternates: text, escaped bytes, text, ..., text.
        texts = pieces[0::2]
        encoded = self.encode_batch(texts) if len(texts) > 1 else [self.encode(texts[0])]
        id_of_byte = self._id_of_byte
        ids: list[int] = []
        for n, text_ids in enumerate(encoded):
            ids.extend(text_ids)
            if 2 * n + 1 < len(pieces):
                ids.extend(id_of_byte[ord(c) - 0xDC00] for c in pieces[2 * n + 1])
        return ids

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        """Exact bytes of `ids` (inverse of `encode_bytes`); special tokens give their literal UTF-8 text."""
        table = self._bytes_of_id
        try:
            return b"".join([table[int(i)] for i in ids])
        except KeyError as err:
            raise ValueError(f"token id {err.args[0]} is not in the vocabulary") from err
