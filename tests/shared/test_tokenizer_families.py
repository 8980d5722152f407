"""Tokenizer families: our encode, decode and streaming equal `tokenizers` and transformers on awkward text.

Builds tiny tokenizers of the four families in-process with `tokenizers` (byte-level BPE as GPT-2 / Llama-3, with
and without add_prefix_space, and in Qwen2's layout, SentencePiece-style BPE with Metaspace and byte fallback as
Llama-2 / Mistral, Unigram with a normalizer as T5, WordPiece as BERT), writes each as a model folder (tokenizer.json,
tokenizer_config.json naming transformers' class for the family, config.json and generation_config.json with an
end-of-text list) and compares, on a corpus of awkward strings and on random id sequences:
- `Tokenizer.from_file(tokenizer.json)` against `tokenizers` itself (special-token text in input kept as text);
- `Tokenizer.from_pretrained(folder)` against transformers' PreTrainedTokenizerFast.from_pretrained(folder) and
  AutoTokenizer.from_pretrained(folder) (the family's class: GPT2Tokenizer, Qwen2Tokenizer, LlamaTokenizer,
  BertTokenizer), as `encode(text, add_special_tokens=False, split_special_tokens=True)` and `decode(ids)`;
- `detokenizer()` pieces, pushed one id at a time and in random chunks, against the full decode.
Run: `python -m pytest tests/shared/test_tokenizer_families.py -q` (a few seconds, most of it importing transformers).
"""

from __future__ import annotations

import json
import random
import unicodedata
from pathlib import Path

import pytest
import tokenizers
import transformers
from tiny_models import byte_fallback_tokenizer, unigram_tokenizer
from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from tether.shared.detokenizer import Detokenizer, clean_up_tokenization_spaces
from tether.shared.tokenizer import Tokenizer

TRAINING = [
    "The quick brown fox jumps over the lazy dog. It's what they've said, isn't it? Don't stop!\n" * 3,
    "def tokenize(text):\n    return [word for word in text.split() if word]\n\nclass Model:\n    pass\n" * 3,
    "for i in range(10):\n\tprint(i ** 2)  # squares\r\n" * 2,
    "Données, café, naïve façade; straße; Ελληνικά; русский язык; 中文字符; 日本語のテキスト; 한국어.\n",
    "emoji 😀 👍🏽 👨‍👩‍👧 and 🇯🇵 flags. Numbers 3.14159 and 2,718.\n",
]

CORPUS = [
    "",
    " ",
    "   ",
    "hello",
    " hello",
    "hello ",
    "  leading and trailing spaces  ",
    "whitespace  runs   of    four\tand\t\ttabs",
    "Windows\r\nline\r\nends\r\n",
    "\n\n\n",
    "    \n\n\t\t  \t\n   ",
    "def f(x):\n\treturn {'a': [x, x ** 2]}  # done\n",
    "if (a && b || !c) { return a->b[0] >> 2; }",
    "emoji 😀👍🏽 family 👨‍👩‍👧‍👦, coder 👩‍💻, flags 🇯🇵🇫🇷, rainbow 🏳️‍🌈",
    "中文字符，日本語のテキスト，한국어 텍스트",
    "Ελληνικά русский עברית العربية हिन्दी ไทย",
    "combining e\u0301 vs \u00e9; ﬁ ligature; ＡＢＣ full width; 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "zero width\u200bjoiner, BOM \ufeff, NUL \x00, DEL \x7f, C1 \x85, LS \u2028, VT \x0b",
    "special text <|endoftext|> <|eot_id|> <s> </s> <unk> [CLS] [SEP] [MASK] <pad> inside",
    "<s>",
    "byte token text <0x0A> and <0xE4><0xB8> typed by a user",
    "metaspace ▁ char and ▁▁ twice, ## and ##ing",
    "don't . , ! ? it 's they 're we 've I 'm isn't ' quoted '",
    "Hello world . Is it ? Yes !",
    "\U0010ffff highest code point, replacement \ufffd char",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
    "The quick brown fox jumps over the lazy dog.",
]


def _byte_level(add_prefix_space: bool = False) -> tokenizers.Tokenizer:
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|eot_id|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TRAINING, trainer=trainer)
    tok.add_tokens(["<tool>"])  # an added token that is not special: matched in input, by us too
    return tok


# Qwen2's pre-tokenizer split (transformers' Qwen2Tokenizer and Qwen2's tokenizer.json).
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _qwen2() -> tokenizers.Tokenizer:
    """Byte-level BPE in Qwen2's layout: NFC, its split regex, then ByteLevel without a regex of its own."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TRAINING, trainer=trainer)
    return tok


def _byte_fallback() -> tokenizers.Tokenizer:
    """The Llama-2 / Mistral layout: `<unk> <s> </s>`, then the 256 byte tokens, then the merges' vocabulary."""
    return byte_fallback_tokenizer(TRAINING)


def _unigram() -> tokenizers.Tokenizer:
    """T5 / ALBERT style: Unigram, a normalizer (NFKC, space runs folded), Metaspace before every word."""
    return unigram_tokenizer(TRAINING)


def _wordpiece() -> tokenizers.Tokenizer:
    tok = tokenizers.Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##")
    trainer = trainers.WordPieceTrainer(
        vocab_size=300, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"], show_progress=False
    )
    tok.train_from_iterator(TRAINING, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )  # what BERT ships: our encode (and transformers' without special tokens) must not add them
    return tok


# family: (builder, transformers' class for it, config.json's eos token, generation_config.json's list,
# tokenizer_config.json extras). T5Tokenizer is not used for Unigram: it builds its own normalizer, not this one.
FAMILIES = {
    "byte_level": (_byte_level, "GPT2Tokenizer", "<|endoftext|>", ["<|endoftext|>", "<|eot_id|>"], {}),
    "byte_level_prefix_space": (
        lambda: _byte_level(add_prefix_space=True),
        "GPT2Tokenizer",
        "<|endoftext|>",
        ["<|endoftext|>"],
        {"add_prefix_space": True},
    ),
    "byte_level_qwen2": (_qwen2, "Qwen2Tokenizer", "<|endoftext|>", ["<|im_end|>", "<|endoftext|>"], {}),
    "byte_fallback": (_byte_fallback, "LlamaTokenizer", "</s>", ["</s>"], {}),
    "unigram": (_unigram, "PreTrainedTokenizerFast", "</s>", ["</s>", "<pad>"], {}),
    "wordpiece": (_wordpiece, "BertTokenizer", "[SEP]", ["[SEP]", "[PAD]"], {"clean_up_tokenization_spaces": True}),
}


class Family:
    """One family's tokenizer as a model folder, loaded by the library, by us and by transformers."""

    def __init__(self, name: str, root: Path) -> None:
        build, hf_class, eos, eos_list, extra = FAMILIES[name]
        self.name, self.folder = name, root / name
        self.folder.mkdir()
        backend = build()
        backend.save(str(self.folder / "tokenizer.json"))
        eos_ids = [backend.token_to_id(t) for t in eos_list]
        config = {"tokenizer_class": hf_class, "eos_token": eos, **extra}
        (self.folder / "tokenizer_config.json").write_text(json.dumps(config))
        (self.folder / "config.json").write_text(json.dumps({"eos_token_id": backend.token_to_id(eos)}))
        (self.folder / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_ids}))
        self.expected_eos_ids = tuple(dict.fromkeys([backend.token_to_id(eos), *eos_ids]))
        self.library = tokenizers.Tokenizer.from_file(str(self.folder / "tokenizer.json"))
        self.library.encode_special_tokens = True  # our contract: special-token text in input is text
        self.plain = Tokenizer.from_file(self.folder / "tokenizer.json")
        self.ours = Tokenizer.from_pretrained(self.folder)
        # transformers as the tokenizer.json says, and as the family's own class (which rebuilds the pipeline)
        self.hf = PreTrainedTokenizerFast.from_pretrained(str(self.folder))
        self.hf_class = AutoTokenizer.from_pretrained(str(self.folder))
        assert isinstance(self.hf_class, getattr(transformers, hf_class))

    def hf_encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False, split_special_tokens=True)

    def hf_class_encode(self, text: str) -> list[int]:
        return self.hf_class.encode(text, add_special_tokens=False, split_special_tokens=True)

    def random_ids(self, seed: int, count: int = 150) -> list[list[int]]:
        rng = random.Random(seed)
        return [[rng.randrange(self.ours.vocab_size) for _ in range(rng.randrange(0, 24))] for _ in range(count)]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory) -> Family:
    return Family(request.param, tmp_path_factory.mktemp("families"))


def test_encode_equals_the_library_and_transformers(family: Family) -> None:
    for text in CORPUS:
        ids = family.ours.encode(text)
        assert ids == family.library.encode(text, add_special_tokens=False).ids, text
        assert ids == family.plain.encode(text), text
        assert ids == family.hf_encode(text) == family.hf_class_encode(text), text
    assert family.ours.encode_batch(CORPUS) == [family.ours.encode(t) for t in CORPUS]


def test_decode_equals_the_library_and_transformers(family: Family) -> None:
    sequences = [family.ours.encode(t) for t in CORPUS] + family.random_ids(seed=1)
    for ids in sequences:
        assert family.plain.decode(ids) == family.library.decode(ids, skip_special_tokens=False), ids
        assert family.ours.decode(ids) == family.hf.decode(ids) == family.hf_class.decode(ids), ids


def test_round_trip_where_the_family_allows_it(family: Family) -> None:
    for text in CORPUS:
        again = family.ours.decode(family.ours.encode(text))
        if family.name == "byte_level":  # no normalizer, every byte expressible
            assert again == text
        elif family.name == "byte_level_qwen2":  # NFC composes "e\u0301" to "\u00e9"
            assert again == unicodedata.normalize("NFC", text)
        elif family.name == "byte_fallback":  # Metaspace spells spaces "▁" and prepends one unless there is one
            spaced = text.replace("▁", " ")
            assert again == (spaced[1:] if spaced.startswith(" ") else spaced)
        else:  # lower-casing, NFKC, [UNK]: the family's nature, and the library's own result
            assert again == family.hf.decode(family.hf_encode(text))


def _chunks(ids: list[int], rng: random.Random) -> list[list[int]]:
    out, i = [], 0
    while i < len(ids):
        n = rng.randrange(1, 5)
        out.append(ids[i : i + n])
        i += n
    return out


def test_streaming_gives_exactly_the_full_decode(family: Family) -> None:
    rng = random.Random(3)
    sequences = [family.ours.encode(t) for t in CORPUS] + family.random_ids(seed=2)
    for ids in sequences:
        for chunks in ([[i] for i in ids], _chunks(ids, rng)):
            stream = family.ours.detokenizer()
            pieces = [stream.push(chunk) for chunk in chunks]
            assert "".join(pieces) + stream.flush() == family.hf.decode(ids), ids


def test_streaming_never_shows_a_replacement_for_a_split_character(family: Family) -> None:
    for text in CORPUS:
        if "\ufffd" in text:
            continue
        stream = family.ours.detokenizer()
        pieces = [stream.push([i]) for i in family.ours.encode(text)] + [stream.flush()]
        assert not any("\ufffd" in p for p in pieces), text


def test_metaspace_leading_space_comes_out_as_transformers_decodes_it(family: Family) -> None:
    ids = family.ours.encode(" hello world")
    stream = family.ours.detokenizer()
    first = stream.push(ids[:1])
    assert first + "".join(stream.push([i]) for i in ids[1:]) + stream.flush() == family.hf.decode(ids)
    assert family.hf.decode(ids).startswith(first)


def test_a_continuation_reads_as_it_does_after_its_prompt(family: Family) -> None:
    """decode(ids, after=prompt) and detokenizer(context=prompt): the text a continuation adds to its prompt, as
    the decode of both together reads it (transformers' text-generation pipeline: decode all, drop the prompt's
    text), streamed one id at a time; a Metaspace continuation keeps its first space."""
    for text in CORPUS:
        ids = family.ours.encode(text)
        for k in range(1, len(ids)):
            whole, head = family.hf.decode(ids), family.hf.decode(ids[:k])
            if not whole.startswith(head) or "\ufffd" in head:  # a prompt cut inside a character or a clean-up
                continue
            continuation = family.ours.decode(ids[k:], after=ids[:k])
            assert continuation == whole[len(head) :], (text, k)
            stream = family.ours.detokenizer(context=ids[:k])
            assert "".join(stream.push([i]) for i in ids[k:]) + stream.flush() == continuation, (text, k)
    if family.name in ("byte_fallback", "unigram"):
        prompt, continuation = family.ours.encode("The quick"), family.ours.encode(" brown fox")
        assert family.ours.decode(continuation) == "brown fox"  # alone: Metaspace's first space is dropped
        assert family.ours.decode(continuation, after=prompt) == " brown fox"


def test_a_chat_prompt_encodes_its_special_tokens_as_transformers(family: Family) -> None:
    """encode_with_specials (how a rendered chat prompt is encoded): special-token text is the token, the text
    beside it encoded as the library does there (Metaspace "first" prepends no "▁" after `<s>`)."""
    specials = [t.content for t in family.library.get_added_tokens_decoder().values()]
    for text in CORPUS + [f"{a}[INST] Hi {b} x{a}" for a in specials for b in specials]:
        assert family.ours.encode_with_specials(text) == family.hf.encode(text, add_special_tokens=False), text


def test_eos_ids_come_from_every_config(family: Family) -> None:
    assert family.ours.eos_ids == family.expected_eos_ids
    assert family.ours.eos_id == family.expected_eos_ids[0]


def test_an_edges_tokenizer_from_json_decodes_as_the_servers(family: Family) -> None:
    """tokenizer.json travels alone to an edge; with the end-of-text ids and the clean-up flag the server names
    (ModelInfo.eos_ids, clean_up_tokenization_spaces) it decodes and streams what the model folder's does."""
    ours = family.ours
    edge = Tokenizer.from_json(ours.to_json(), eos_ids=ours.eos_ids, clean_up_spaces=ours.clean_up_spaces)
    assert ours.clean_up_spaces == (family.name == "wordpiece")  # the one family here whose folder asks for it
    assert (edge.eos_ids, edge.sha256) == (ours.eos_ids, ours.sha256)
    for ids in [ours.encode(t) for t in CORPUS] + family.random_ids(seed=4, count=40):
        stream = edge.detokenizer()
        assert edge.decode(ids) == ours.decode(ids) == "".join(stream.push([i]) for i in ids) + stream.flush()


def test_byte_paths_need_a_byte_level_tokenizer(family: Family) -> None:
    if family.name == "byte_level_prefix_space":  # the prefix space is the tokenizer's, and spelled in bytes too
        text = "é😀 x"
        assert family.ours.decode_bytes(family.ours.encode_bytes(text.encode())) == (" " + text).encode()
        return
    if family.name.startswith("byte_level"):
        data = b"\xff\xfe" + "é😀".encode()
        assert family.ours.decode_bytes(family.ours.encode_bytes(data)) == data
        return
    with pytest.raises(ValueError, match="detokenizer"):
        family.ours.encode_bytes(b"x")


def test_llama3_instruct_eos_list(tmp_path: Path) -> None:
    """generation_config.json lists `<|end_of_text|>` and `<|eot_id|>`; config.json names the first."""
    backend = tokenizers.Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_tokens(list("abc"))
    backend.add_special_tokens(["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"])
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 4}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [4, 5]}))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|eot_id|>"}))
    tok = Tokenizer.from_pretrained(tmp_path)
    assert (tok.eos_id, tok.eos_ids) == (4, (4, 5))
    assert Tokenizer.from_pretrained(tmp_path, eos_id=3).eos_ids == (3, 4, 5)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [4, 99, True]}))
    assert Tokenizer.from_pretrained(tmp_path).eos_ids == (4, 5)  # outside the vocabulary, or not an id: left out


def test_clean_up_streams_exactly() -> None:
    """The clean-up stage alone: text of random pattern characters, released in random pieces."""
    rng = random.Random(5)
    alphabet = [" ", ".", "?", "'", "n", "t", "s", "m", "v", "e", "r", "x", "\n", ",", "!"]
    for _ in range(300):
        chars = [rng.choice(alphabet) for _ in range(rng.randrange(0, 40))]
        stream = Detokenizer(lambda ids, chars=chars: "".join(chars[i] for i in ids), clean_up_spaces=True)
        pieces = [stream.push(chunk) for chunk in _chunks(list(range(len(chars))), rng)]
        assert "".join(pieces) + stream.flush() == clean_up_tokenization_spaces("".join(chars))
