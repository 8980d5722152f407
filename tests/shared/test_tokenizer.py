"""Tokenizer: exact text and byte round trips, special-token text kept literal, save/load identity, vocab size.

Trains on a few standard-library files (well under a second). Run: `python -m pytest tests/shared/test_tokenizer.py -q`.
"""

from __future__ import annotations

import codecs
import random
import sysconfig
from pathlib import Path

import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from tether.shared.tokenizer import EOS_TOKEN, PAD_TOKEN, Tokenizer

STDLIB = Path(sysconfig.get_paths()["stdlib"])
SAMPLE = [STDLIB / name for name in ("textwrap.py", "string.py", "shlex.py", "difflib.py", "json/decoder.py")]

TEXTS = [
    "",
    "def f(x):\n\treturn x  # done\n",
    "Windows\r\nline\r\nends\r\n",
    "    \n\n\t\t  \t\n   ",
    "emoji 😀👍🏽 family 👨‍👩‍👧 and flags 🇯🇵",
    "中文字符，日本語のテキスト，한국어 텍스트",
    "combining e\u0301 vs \u00e9, NFC and NFD must both survive",
    "zero width\u200bjoiner, BOM \ufeff, NUL \x00, DEL \x7f, C1 \x85",
    "a<|endoftext|>b",
    "<|endoftext|>",
    "<|pad|><|endoftext|><|pad|>",
    "  leading and trailing spaces  ",
    "\U0010ffff highest code point",
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.train(SAMPLE, vocab_size=1024)


@pytest.mark.parametrize("text", TEXTS)
def test_text_round_trips_exactly(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.decode_bytes(ids) == text.encode("utf-8")
    assert all(0 <= i < tok.vocab_size for i in ids)


def test_random_text_round_trips(tok: Tokenizer) -> None:
    rng = random.Random(20240601)
    ranges = [(0x00, 0x7F), (0x80, 0x7FF), (0x800, 0xD7FF), (0xE000, 0xFFFF), (0x10000, 0x10FFFF)]
    for _ in range(300):
        chars = []
        for _ in range(rng.randrange(0, 60)):
            lo, hi = rng.choice(ranges)
            chars.append(chr(rng.randint(lo, hi)))
            if rng.random() < 0.2:
                chars.append(rng.choice([" ", "  ", "\n", "\r\n", "\t", EOS_TOKEN, PAD_TOKEN, "def ", "self."]))
        text = "".join(chars)
        assert tok.decode(tok.encode(text)) == text


def test_special_token_text_in_input_stays_plain_text(tok: Tokenizer) -> None:
    assert (tok.eos_id, tok.pad_id) == (0, 1)
    ids = tok.encode(f"x{EOS_TOKEN}y{PAD_TOKEN}z")
    assert tok.eos_id not in ids and tok.pad_id not in ids
    assert tok.encode_batch([EOS_TOKEN])[0] == tok.encode(EOS_TOKEN)
    # The ids themselves still decode to their literal text.
    assert tok.decode([tok.eos_id, tok.pad_id]) == EOS_TOKEN + PAD_TOKEN
    assert tok.decode_bytes([tok.eos_id, tok.pad_id]) == (EOS_TOKEN + PAD_TOKEN).encode()


def test_random_bytes_round_trip(tok: Tokenizer) -> None:
    rng = random.Random(7)
    crafted = [
        b"",
        b"\xff",
        b"\xc3",  # truncated two-byte sequence
        "😀".encode()[:3],  # truncated four-byte sequence
        b"\xed\xa0\x80",  # an encoded surrogate: invalid UTF-8
        b"\xc0\xaf",  # overlong encoding of "/"
        b"ok \xfe\xff ok\r\n\x00" + "é😀".encode() + b"\x80",
        EOS_TOKEN.encode() + b"\xff" + PAD_TOKEN.encode(),
    ]
    randoms = [rng.randbytes(rng.randrange(0, 400)) for _ in range(300)]
    mixed = [rng.choice(TEXTS).encode() + rng.randbytes(3) + rng.choice(TEXTS).encode() for _ in range(100)]
    for data in crafted + randoms + mixed:
        ids = tok.encode_bytes(data)
        assert tok.decode_bytes(ids) == data
        assert all(0 <= i < tok.vocab_size for i in ids)


def test_every_byte_is_one_token(tok: Tokenizer) -> None:
    for b in range(256):
        data = bytes([b])
        ids = tok.encode_bytes(data)
        assert len(ids) == 1 and tok.decode_bytes(ids) == data
    assert tok.encode_bytes(b"a\xffb")[1] == tok.encode_bytes(b"\xff")[0]


def test_valid_utf8_bytes_encode_like_text(tok: Tokenizer) -> None:
    for text in TEXTS:
        assert tok.encode_bytes(text.encode()) == tok.encode(text)


def test_streaming_decode_of_characters_split_across_tokens(tok: Tokenizer) -> None:
    text = "数据 😀👍🏽 données"
    ids = tok.encode(text)
    # What a streaming printer does: decode each token's bytes incrementally.
    decoder = codecs.getincrementaldecoder("utf-8")()
    assert "".join(decoder.decode(tok.decode_bytes([i])) for i in ids) + decoder.decode(b"", final=True) == text


def test_detokenizer_streams_characters_split_across_tokens(tok: Tokenizer) -> None:
    text = "数据 😀👍🏽 données"
    stream = tok.detokenizer()
    pieces = [stream.push([i]) for i in tok.encode(text)]
    assert "".join(pieces) + stream.flush() == text
    assert "\ufffd" not in "".join(pieces)
    assert tok.eos_ids == (tok.eos_id,) == (0,)


def test_encode_batch_matches_encode(tok: Tokenizer) -> None:
    assert tok.encode_batch(TEXTS) == [tok.encode(t) for t in TEXTS]


def test_save_and_load_give_identical_tokenizer(tok: Tokenizer, tmp_path: Path) -> None:
    tok.save_pretrained(tmp_path / "pretrained")
    tok.save(tmp_path / "single.json")
    for loaded in (Tokenizer.from_pretrained(tmp_path / "pretrained"), Tokenizer.from_file(tmp_path / "single.json")):
        assert loaded.sha256 == tok.sha256
        assert (loaded.vocab_size, loaded.eos_id, loaded.pad_id) == (tok.vocab_size, tok.eos_id, tok.pad_id)
        # Special-token parsing is off by a runtime flag that tokenizer.json does not store: check it survives.
        assert [loaded.encode(t) for t in TEXTS] == [tok.encode(t) for t in TEXTS]
        assert loaded.encode_bytes(b"\xff" + EOS_TOKEN.encode()) == tok.encode_bytes(b"\xff" + EOS_TOKEN.encode())


def test_training_is_deterministic_and_sha256_tells_tokenizers_apart(tok: Tokenizer) -> None:
    assert Tokenizer.train(SAMPLE, vocab_size=1024).sha256 == tok.sha256
    assert Tokenizer.train(SAMPLE, vocab_size=1000).sha256 != tok.sha256


def test_vocab_size_is_honoured(tok: Tokenizer) -> None:
    assert tok.vocab_size == 1024
    small = Tokenizer.train(texts=[p.read_text(encoding="utf-8") for p in SAMPLE], vocab_size=300)
    assert small.vocab_size == 300
    assert max(small.encode(SAMPLE[0].read_text(encoding="utf-8"))) < 300
    with pytest.raises(ValueError):
        Tokenizer.train(texts=["abc"], vocab_size=257)


def test_wrapping_a_foreign_tokenizer() -> None:
    backend = tokenizers.Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator([p.read_text(encoding="utf-8") for p in SAMPLE[:2]], trainer=trainer)
    backend.enable_truncation(4)  # some tokenizer.json files ship like this; it must not cut our text

    plain = Tokenizer.from_tokenizers(backend)
    assert plain.eos_id is None and plain.pad_id is None
    wrapped = Tokenizer.from_tokenizers(backend, eos_id=backend.token_to_id("</s>"))
    assert wrapped.eos_id == 1
    text = "a long line that is much longer than four tokens </s>"
    assert wrapped.decode(wrapped.encode(text)) == text
    assert wrapped.decode_bytes(wrapped.encode_bytes(b"\xff</s>")) == b"\xff</s>"
    assert backend.encode_special_tokens is False  # the caller's object is left alone
    with pytest.raises(ValueError):
        Tokenizer.from_tokenizers(backend, eos_id=10_000)


def test_lone_surrogate_is_a_clear_error(tok: Tokenizer) -> None:
    with pytest.raises(ValueError, match="surrogate"):
        tok.encode("a\ud800b")
