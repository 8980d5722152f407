"""Tokenizer: a thin, exact wrapper around the Hugging Face `tokenizers` library, for every family it loads.

Families: byte-level BPE (GPT-2 / Qwen2 / Llama-3; what `train` makes), SentencePiece-style BPE with a Metaspace
pre-tokenizer and byte fallback (Llama-2 / Mistral: `<0x0A>` tokens), Unigram (T5 / ALBERT) and WordPiece (BERT).

Contract:
- `encode(text)` and `decode(ids)` give what `tokenizers` gives for the same tokenizer.json, and what transformers'
  tokenizer built from the same model folder gives (`encode(text, add_special_tokens=False,
  split_special_tokens=True)`, `decode(ids)`), with this wrapper's stricter rules: no special tokens are added, none
  are recognised inside `text` (a source file containing "<|endoftext|>" stays text), no truncation, no padding.
  transformers' clean_up_tokenization_spaces is honoured where tokenizer_config.json asks for it (and transformers
  applies it: not for BPE).
- Byte-level BPE without a normalizer (what `train` makes; Qwen2 ships NFC, which composes characters) has a token
  for every byte: `decode(encode(text)) == text` for every str that UTF-8 can encode, and
  `decode_bytes(encode_bytes(data)) == data` for arbitrary bytes, invalid UTF-8 included (`encode_bytes` /
  `decode_bytes` exist for this family only; every family streams through `detokenizer()`).
  Byte-fallback BPE (the Llama-2 layout) round-trips text too, but for one leading space (its Metaspace
  pre-tokenizer prepends "▁" only to text that does not start with one, its decoder strips one) and a literal "▁"
  (Metaspace's spelling of a space, so it comes back as " "). WordPiece (lower-casing, accent stripping, unknown
  characters as [UNK]) and Unigram with a normalizer cannot round-trip by nature: decode(encode(x)) != x there,
  and it equals the library's and transformers'.
- A rendered chat prompt: `encode_with_specials(text)` reads the text of every added token, special ones included,
  as that token and encodes the text beside them as the library does there, as transformers' apply_chat_template
  (tether.shared.chat_template uses it; `encode` never does).
- Streaming: `detokenizer()` gives a tether.shared.detokenizer.Detokenizer, which turns ids pushed as they come
  into exactly the text `decode` gives for all of them, in pieces that never split a character.
  `detokenizer(context=prompt_ids)` and `decode(ids, after=prompt_ids)` give a continuation's text as it reads after
  its prompt: decoded alone, a SentencePiece-style continuation loses its first space ("▁brown" reads "brown").
- End of text: `eos_id` is one id (the first); `eos_ids` all of them (a tuple): a Llama-3 instruct model's
  generation_config.json lists `<|end_of_text|>` and `<|eot_id|>`.
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
    stream = tok.detokenizer()
    text = "".join(stream.push([i]) for i in tok.encode("数据 😀")) + stream.flush()

Tested by tests/shared/test_tokenizer.py and tests/shared/test_tokenizer_families.py
(`python -m pytest tests/shared/test_tokenizer.py tests/shared/test_tokenizer_families.py -q`).
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

from tether.shared.detokenizer import Detokenizer, clean_up_tokenization_spaces
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


def _decoder_types(backend: tokenizers.Tokenizer) -> set[str]:
    """The types of the backend's decoder and, for a Sequence, of its parts ("ByteLevel", "ByteFallback", ...)."""
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    parts = decoder.get("decoders", []) if decoder.get("type") == "Sequence" else [decoder]
    return {part.get("type") for part in parts if isinstance(part, dict)}


def _is_byte_level(backend: tokenizers.Tokenizer) -> bool:
    """True when the backend's decoder is ByteLevel, i.e. its vocabulary is spelled in the byte alphabet."""
    return "ByteLevel" in _decoder_types(backend)


_NOT_BYTE_LEVEL = "byte paths need a tokenizer whose decoder is ByteLevel; stream other families with detokenizer()"

# What the ByteFallback decoder reads as one byte: six characters, "<0x", what Rust's u8::from_str_radix(_, 16)
# accepts (an optional "+", hex digits), ">".
_BYTE_TOKEN = re.compile(r"<0x(?:\+[0-9A-Fa-f]|[0-9A-Fa-f]{2})>")


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def _model_eos_ids(directory: Path, backend: tokenizers.Tokenizer) -> tuple[int, ...]:
    """Every end-of-text id a model folder's configs name (Tokenizer.from_pretrained), in order, once each:
    config.json's eos_token_id (an int or a list), generation_config.json's, tokenizer_config.json's eos_token.
    Ids outside the vocabulary are left out."""
    size = backend.get_vocab_size(with_added_tokens=True)
    found: list[int] = []
    for name in ("config.json", "generation_config.json"):
        eos = _read_json(directory / name).get("eos_token_id")
        for i in eos if isinstance(eos, list) else [eos]:
            if isinstance(i, int) and not isinstance(i, bool) and 0 <= i < size:
                found.append(i)
    eos_token = _read_json(directory / "tokenizer_config.json").get("eos_token")
    if isinstance(eos_token, dict):
        eos_token = eos_token.get("content")
    if isinstance(eos_token, str) and (i := backend.token_to_id(eos_token)) is not None:
        found.append(i)
    return tuple(dict.fromkeys(found))


def _model_cleans_up_spaces(directory: Path, backend: tokenizers.Tokenizer) -> bool:
    """Whether transformers cleans up spaces when it decodes for this model folder: tokenizer_config.json asks
    (clean_up_tokenization_spaces; off by default) and the model is not BPE, for which transformers skips it."""
    if _read_json(directory / "tokenizer_config.json").get("clean_up_tokenization_spaces") is not True:
        return False
    return (json.loads(backend.to_str()).get("model") or {}).get("type") != "BPE"


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
    """A tokenizer of any family `tokenizers` loads (`train` makes byte-level BPE); build one with `train`,
    `from_file`, `from_pretrained`, `from_json` or `from_tokenizers`."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        eos_id: int | None,
        pad_id: int | None,
        eos_ids: Sequence[int] = (),
        clean_up_spaces: bool = False,
    ) -> None:
        # Takes ownership of `backend`; callers outside this module should use `from_tokenizers`, which copies
        # it and switches off the behaviours (special-token parsing, truncation, padding) that lose text.
        # `eos_ids` are further end-of-text ids, after `eos_id` (which is their first when not given).
        size = backend.get_vocab_size(with_added_tokens=True)
        eos_ids = tuple(dict.fromkeys([*([] if eos_id is None else [eos_id]), *(int(i) for i in eos_ids)]))
        for name, value in (*(("eos_id", i) for i in eos_ids), ("pad_id", pad_id)):
            if value is not None and not 0 <= value < size:
                raise ValueError(f"{name}={value} is outside the vocabulary (size {size})")
        self._backend = backend
        self._eos_ids = eos_ids
        self._pad_id = pad_id
        self._clean_up_spaces = clean_up_spaces

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
        cls,
        backend: tokenizers.Tokenizer,
        *,
        eos_id: int | None = None,
        pad_id: int | None = None,
        eos_ids: Sequence[int] = (),
        clean_up_spaces: bool = False,
    ) -> Tokenizer:
        """Wrap a copy of `backend`; eos/pad default to its `<|endoftext|>`/`<|pad|>` special tokens, if any;
        `eos_ids` adds further end-of-text ids (the first is eos when there is no other); `clean_up_spaces`: decode
        with transformers' clean_up_tokenization_spaces (`from_pretrained` reads it from the model folder)."""
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
            eos_ids=eos_ids,
            clean_up_spaces=clean_up_spaces,
        )

    @classmethod
    def from_file(
        cls, path: str | Path, *, eos_id: int | None = None, pad_id: int | None = None, eos_ids: Sequence[int] = ()
    ) -> Tokenizer:
        """Load a tokenizer.json written by `save` (or by any Hugging Face tokenizer)."""
        backend = tokenizers.Tokenizer.from_file(str(path))
        return cls.from_tokenizers(backend, eos_id=eos_id, pad_id=pad_id, eos_ids=eos_ids)

    @classmethod
    def from_pretrained(
        cls, directory: str | Path, *, eos_id: int | None = None, pad_id: int | None = None
    ) -> Tokenizer:
        """Load `directory`/tokenizer.json (a local folder; nothing is downloaded). `eos_ids` are the end-of-text
        ids `eos_id=` or the tokenizer's `<|endoftext|>` names, then every one the model's configs name:
        config.json's eos_token_id (an int or a list), generation_config.json's (Llama 3 instruct lists
        `<|end_of_text|>` and `<|eot_id|>`), tokenizer_config.json's eos_token. `eos_id` is the first of them, or
        None. Decoding cleans up spaces as transformers does when tokenizer_config.json asks for it."""
        directory = Path(directory)
        tok = cls.from_file(directory / "tokenizer.json", pad_id=pad_id)
        backend = tok._backend
        first = tok.eos_id if eos_id is None else eos_id  # the tokenizer's own <|endoftext|> unless told
        return cls(
            backend,
            eos_id=first,
            pad_id=tok.pad_id,
            eos_ids=_model_eos_ids(directory, backend),
            clean_up_spaces=_model_cleans_up_spaces(directory, backend),
        )

    @classmethod
    def from_json(
        cls,
        text: str,
        *,
        eos_id: int | None = None,
        pad_id: int | None = None,
        eos_ids: Sequence[int] = (),
        clean_up_spaces: bool = False,
    ) -> Tokenizer:
        """A tokenizer from tokenizer.json text (how the client receives it from the server), checked first
        (tether.shared.tokenizer_trust: a pattern that may backtrack for ever is a ValueError, one line). The rest of
        a model folder does not travel with it: an edge passes what the server says (ModelInfo.eos_ids and
        clean_up_tokenization_spaces, from the server's `eos_ids` and `clean_up_spaces`) to decode as it does."""
        check_tokenizer_json(text)
        backend = _guarded(tokenizers.Tokenizer.from_str, text)
        return cls.from_tokenizers(
            backend, eos_id=eos_id, pad_id=pad_id, eos_ids=eos_ids, clean_up_spaces=clean_up_spaces
        )

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
        """The first end-of-text id (what a single-id stop check uses), or None."""
        return self._eos_ids[0] if self._eos_ids else None

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """Every end-of-text id, `eos_id` first; empty when there is none."""
        return self._eos_ids

    @property
    def pad_id(self) -> int | None:
        return self._pad_id

    @property
    def clean_up_spaces(self) -> bool:
        """Whether decoding applies transformers' clean_up_tokenization_spaces (the model folder asked, not BPE)."""
        return self._clean_up_spaces

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

    def encode_with_specials(self, text: str) -> list[int]:
        """Token ids of a rendered chat prompt: the text of every added token, special ones included, is that token,
        and the text around them is encoded as the library does beside them (a Metaspace "first" prepends no "▁"
        after `<s>`), as transformers' apply_chat_template encodes. Encoded as a batch: the library lets other
        threads run during a batch (a single encode holds the GIL, and a megabyte prompt on a worker thread would
        stall an event loop for seconds)."""
        return _guarded(self._specials_backend.encode_batch, [text], add_special_tokens=False)[0].ids

    @functools.cached_property
    def _specials_backend(self) -> tokenizers.Tokenizer:
        # A second backend: encode_special_tokens is a flag of the object, and `encode` runs on other threads.
        backend = tokenizers.Tokenizer.from_str(self._backend.to_str())
        backend.no_truncation()
        backend.no_padding()
        return backend

    def decode(self, ids: Iterable[int], *, after: Sequence[int] = ()) -> str:
        """Text of `ids`; special tokens appear as their literal text, stray partial characters as U+FFFD. `after`:
        the ids they continue (a prompt): the text they add to it, as decoding both together reads (a Metaspace
        continuation's leading space kept; tether.shared.detokenizer says how)."""
        if after:
            stream = self.detokenizer(context=after)
            return stream.push(ids) + stream.flush()
        text = self._decode_raw([int(i) for i in ids])
        return clean_up_tokenization_spaces(text) if self._clean_up_spaces else text

    def _decode_raw(self, ids: list[int]) -> str:
        return _guarded(self._backend.decode, ids, skip_special_tokens=False)

    def detokenizer(self, context: Sequence[int] = ()) -> Detokenizer:
        """A streaming decoder for one generation: push ids as they come, get exactly `decode(ids, after=context)`'s
        text in pieces; `context`: the prompt the generation continues (its text is not shown again)."""
        return Detokenizer(
            self._decode_raw,
            byte_token_ids=self._byte_token_ids,
            clean_up_spaces=self._clean_up_spaces,
            context=context,
        )

    @functools.cached_property
    def _byte_token_ids(self) -> frozenset[int]:
        # Only a ByteFallback decoder reads `<0xNN>` tokens as bytes; elsewhere they are ordinary text.
        if "ByteFallback" not in _decoder_types(self._backend):
            return frozenset()
        vocab = self._backend.get_vocab(with_added_tokens=True)
        return frozenset(i for token, i in vocab.items() if _BYTE_TOKEN.fullmatch(token))

    # ---- bytes ----------------------------------------------------------------------------------------------

    @functools.cached_property
    def _bytes_of_id(self) -> dict[int, bytes]:
        # Built on first use: a 150k-entry foreign vocabulary takes a noticeable fraction of a second.
        if not _is_byte_level(self._backend):
            raise ValueError(_NOT_BYTE_LEVEL)
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
            raise ValueError(_NOT_BYTE_LEVEL)
        ids = [self._backend.token_to_id(c) for _, c in sorted(_byte_to_char().items())]
        missing = [b for b, i in enumerate(ids) if i is None]
        if missing:
            raise ValueError(f"tokenizer has no single-byte token for bytes {missing[:8]}")
        return ids

    def encode_bytes(self, data: bytes) -> list[int]:
        """Token ids of arbitrary bytes: valid UTF-8 runs encode as text, each other byte as its own token.

        A pre-tokenizer that adds a prefix space (ByteLevel's add_prefix_space) adds it to each valid UTF-8 run, so
        `decode_bytes(encode_bytes(data)) == data` holds only for tokenizers that add none (those `train` makes)."""
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
