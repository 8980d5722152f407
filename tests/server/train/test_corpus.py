"""Corpus builder: deterministic stdlib file list, per-file hash split, well-formed and reproducible outputs.

Builds from the first 40 stdlib files with a 512-token vocabulary (a few seconds), and corpora in a Hugging Face
model's token ids (`model_tokenizer`): its end-of-text found where transformers keeps it, a model without one refused.
Run: `python -m pytest tests/server/train/test_corpus.py -q`.
"""

from __future__ import annotations

import hashlib
import json
import platform
import random
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from tether.server.train.corpus import (
    CorpusManifest,
    build_corpus,
    load_tokens,
    model_tokenizer,
    split_of,
    stdlib_files,
    stdlib_root,
)
from tether.shared.tokenizer import Tokenizer

OUTPUTS = ("tokenizer.json", "train.bin", "val.bin", "manifest.json")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, CorpusManifest]:
    out = tmp_path_factory.mktemp("corpus")
    return out, build_corpus(out, max_files=40, vocab_size=512, progress=False)


def _documents(tokens: np.ndarray, eos_id: int) -> list[np.ndarray]:
    ends = np.flatnonzero(tokens == eos_id)
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [tokens[s:e] for s, e in zip(starts, ends, strict=True)]


def test_stdlib_files_are_sorted_and_deterministic() -> None:
    files = stdlib_files()
    assert files == stdlib_files()
    names = [p.relative_to(stdlib_root()).as_posix() for p in files]
    assert names == sorted(names) and len(set(names)) == len(names)
    assert {"os.py", "json/__init__.py", "asyncio/base_events.py"} <= set(names)
    assert all(n.endswith(".py") for n in names)
    assert not any(part in {"site-packages", "dist-packages", "__pycache__"} for n in names for part in n.split("/"))


def test_split_is_a_deterministic_function_of_the_name() -> None:
    names = [f"pkg{i % 7}/module_{i}.py" for i in range(5000)]
    splits = {n: split_of(n, 0.1) for n in names}
    shuffled = names[:]
    random.Random(3).shuffle(shuffled)
    assert {n: split_of(n, 0.1) for n in shuffled} == splits
    assert 0.08 < sum(s == "val" for s in splits.values()) / len(names) < 0.12
    # Pinned: a changed hash would silently move files between the splits of existing corpora.
    assert [split_of(n, 0.5) for n in ("os.py", "re/__init__.py", "collections/__init__.py")] == ["train", "val", "val"]
    assert split_of("os.py", 0.0) == "train" and split_of("os.py", 1.0) == "val"


def test_build_writes_both_splits_with_valid_ids(corpus: tuple[Path, CorpusManifest]) -> None:
    out, manifest = corpus
    assert all((out / name).is_file() for name in OUTPUTS)
    assert CorpusManifest.load(out) == manifest
    assert manifest.python_version == platform.python_version()
    assert manifest.vocab_size == 512 and manifest.dtype == "uint16"
    assert Tokenizer.from_file(out / "tokenizer.json").sha256 == manifest.tokenizer_sha256

    names = [f.name for f in manifest.files]
    assert len(names) == len(set(names))  # so no file can sit in both splits
    assert names == sorted(names)  # stdlib files keep the deterministic order
    for split in ("train", "val"):
        tokens = load_tokens(out, split)
        assert isinstance(tokens, np.memmap) and not tokens.flags.writeable
        assert tokens.size == manifest.tokens(split) > 0
        assert int(tokens.max()) < manifest.vocab_size
        # One eos closes every document, so the eos count is the file count of the split.
        assert int((tokens == manifest.eos_id).sum()) == len(manifest.files_in(split)) > 0
        assert tokens[-1] == manifest.eos_id

    for f in manifest.files[:5]:
        raw = (stdlib_root() / f.name).read_bytes()
        assert (f.sha256, f.bytes) == (hashlib.sha256(raw).hexdigest(), len(raw))


def test_small_build_gets_a_val_split_by_hash_ranking(corpus: tuple[Path, CorpusManifest]) -> None:
    _, manifest = corpus
    by_hash = [f.name for f in manifest.files if split_of(f.name, manifest.holdout_fraction) == "val"]
    val = [f.name for f in manifest.files_in("val")]
    # Either the hash rule picked some files, or exactly one file was moved over to keep val non-empty.
    assert val == by_hash if by_hash else len(val) == 1


def test_val_documents_decode_to_the_files(corpus: tuple[Path, CorpusManifest]) -> None:
    out, manifest = corpus
    tok = Tokenizer.from_file(out / "tokenizer.json")
    docs = _documents(np.asarray(load_tokens(out, "val")), manifest.eos_id)
    files = manifest.files_in("val")
    assert len(docs) == len(files)
    raw = (stdlib_root() / files[0].name).read_bytes()
    assert tok.decode(docs[0].tolist()) == raw.decode("utf-8")
    for doc, f in zip(docs, files, strict=True):
        assert tok.decode_bytes(doc.tolist()) == (stdlib_root() / f.name).read_bytes()


def test_building_twice_gives_byte_identical_outputs(corpus: tuple[Path, CorpusManifest], tmp_path: Path) -> None:
    out, _ = corpus
    build_corpus(tmp_path, max_files=40, vocab_size=512, progress=False)
    for name in OUTPUTS:
        assert (tmp_path / name).read_bytes() == (out / name).read_bytes(), name


def test_extra_files_skips_and_a_given_tokenizer(corpus: tuple[Path, CorpusManifest], tmp_path: Path) -> None:
    out, first = corpus
    extra = tmp_path / "extra"
    extra.mkdir()
    (extra / "crlf.py").write_bytes(b"x = 1\r\nprint(x)\r\n")
    (extra / "latin1.py").write_bytes("s = 'caf\u00e9'\n".encode("latin-1"))
    (extra / "empty.py").write_bytes(b"")
    given = Tokenizer.from_file(out / "tokenizer.json")
    paths = [extra / "crlf.py", extra / "latin1.py", extra / "empty.py"]
    manifest = build_corpus(tmp_path / "c", extra_files=paths, max_files=3, tokenizer=given, progress=False)

    assert manifest.tokenizer_sha256 == first.tokenizer_sha256
    assert [f.name for f in manifest.files][-1] == (extra / "crlf.py").as_posix()
    assert {(s.name, s.reason) for s in manifest.skipped} == {
        ((extra / "latin1.py").as_posix(), "not UTF-8"),
        ((extra / "empty.py").as_posix(), "empty"),
    }
    assert {f.split for f in manifest.files} == {"train", "val"}
    crlf = manifest.files[-1]
    docs = _documents(np.asarray(load_tokens(tmp_path / "c", crlf.split)), manifest.eos_id)
    assert given.decode_bytes(docs[-1].tolist()) == b"x = 1\r\nprint(x)\r\n"


def test_bad_arguments_are_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unique"):
        build_corpus(tmp_path, max_files=2, extra_files=["a.py", "./a.py"], progress=False)
    with pytest.raises(ValueError, match="holdout_fraction"):
        build_corpus(tmp_path, max_files=2, holdout_fraction=0.0, progress=False)


# ---- a Hugging Face model's tokenizer (tether-server build-corpus --tokenizer MODEL_DIR) ------------------------

LLAMA3_SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>")  # ids 0 and 1: no <|endoftext|>
QWEN2_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1, 2


def model_dir(root: Path, specials: Sequence[str], **json_files: dict) -> Path:
    """A Hugging Face-style model directory as far as the tokenizer goes: a byte-level BPE tokenizer.json (its
    special tokens first, in order) and the given JSON files (config, generation_config, tokenizer_config)."""
    backend = tokenizers.Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=list(specials), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    backend.train_from_iterator(["def f(x):\n    return x + 1\n"] * 20, trainer=trainer)
    root.mkdir(parents=True)
    backend.save(str(root / "tokenizer.json"))
    for name, doc in json_files.items():
        (root / f"{name}.json").write_text(json.dumps(doc))
    return root


@pytest.mark.parametrize(
    ("specials", "files", "eos"),
    [
        (QWEN2_SPECIALS, {"config": {"eos_token_id": 2}}, 0),  # its <|endoftext|> separates documents
        (LLAMA3_SPECIALS, {"config": {"eos_token_id": [1, 0]}}, 1),  # an instruct model's list: the first
        (LLAMA3_SPECIALS, {"config": {}, "generation_config": {"eos_token_id": 1}}, 1),
        (LLAMA3_SPECIALS, {"tokenizer_config": {"eos_token": {"content": "<|end_of_text|>"}}}, 1),
        (LLAMA3_SPECIALS, {"tokenizer_config": {"eos_token": "<|end_of_text|>"}}, 1),
    ],
    ids=["endoftext", "config-list", "generation-config", "tokenizer-config-dict", "tokenizer-config-str"],
)
def test_a_models_end_of_text_is_found_where_transformers_keeps_it(tmp_path, specials, files, eos) -> None:
    assert model_tokenizer(model_dir(tmp_path / "m", specials, **files)).eos_id == eos


def test_a_corpus_in_a_models_token_ids_ends_each_document_with_its_end_of_text(tmp_path: Path) -> None:
    model = model_dir(tmp_path / "llama3", LLAMA3_SPECIALS, config={"eos_token_id": 1})
    manifest = build_corpus(tmp_path / "c", max_files=6, tokenizer=model_tokenizer(model), progress=False)
    served = Tokenizer.from_pretrained(model)  # what serve and train-drafter read from the model directory
    assert served.eos_id == 1  # so serve stops where the model does (ModelInfo.eos_id tells its clients)
    assert manifest.tokenizer_sha256 == served.sha256
    assert (manifest.eos_id, manifest.vocab_size) == (1, served.vocab_size)
    assert Tokenizer.from_file(tmp_path / "c" / "tokenizer.json").sha256 == served.sha256
    for split in ("train", "val"):
        docs = _documents(np.asarray(load_tokens(tmp_path / "c", split)), 1)
        files = manifest.files_in(split)
        assert len(docs) == len(files) > 0
        for doc, f in zip(docs, files, strict=True):
            assert served.decode_bytes(doc.tolist()) == (stdlib_root() / f.name).read_bytes()


def test_a_directory_without_a_usable_tokenizer_is_refused(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        model_tokenizer(tmp_path / "missing")
    (tmp_path / "weights-only").mkdir()
    with pytest.raises(FileNotFoundError, match="has no tokenizer.json"):
        model_tokenizer(tmp_path / "weights-only")
    (tmp_path / "weights-only" / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="is not a tokenizer"):
        model_tokenizer(tmp_path / "weights-only")
    with pytest.raises(ValueError, match="no end-of-text token"):
        model_tokenizer(model_dir(tmp_path / "no-eos", LLAMA3_SPECIALS, config={"eos_token_id": 999}))
