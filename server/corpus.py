"""Training corpus: the running interpreter's standard-library sources (plus files the user names), tokenized.

Contract (docs/ARCHITECTURE.md, section 9):
- Documents are the stdlib's `*.py` files (site-packages, dist-packages and __pycache__ excluded) in sorted
  order of their POSIX path relative to the stdlib folder, and then the extra files in the order given,
  named by the path as given. Files that are empty or not valid UTF-8 are left out and listed as skipped.
- Each document goes wholly to "train" or "val", decided by the sha256 of its name alone, so the split does
  not depend on file order, on which other files are present, or on the machine. If that leaves a split empty
  (likely for a handful of files at 2%), the file whose hash lies nearest the boundary moves over: the lowest
  hash into val, the highest into train; the manifest records the final split of every file.
- Without a given tokenizer, a byte-level BPE is trained on the train documents only, so val stays unseen.
  `model_tokenizer(MODEL_DIR)` gives a Hugging Face model's own (its tokenizer.json), so that a drafter can be
  trained for that model on token ids it reads: documents end with the model's end-of-text token, which is the
  tokenizer's `<|endoftext|>` (Qwen2), else config.json's eos_token_id (Llama 3's `<|end_of_text|>`; the first
  of a list), else generation_config.json's, else tokenizer_config.json's eos_token. A directory without
  tokenizer.json, or a tokenizer without any of those, is refused (ValueError / FileNotFoundError, one line).
- out_dir gets tokenizer.json, train.bin and val.bin (flat native-endian uint16 arrays, uint32 above 65536
  ids: every document followed by the eos id) and manifest.json (interpreter version, split fraction,
  tokenizer sha256, token counts, every file with its sha256, size and split). manifest.json is written last,
  so its presence means the rest is complete. The same inputs give byte-identical outputs.
- The CPU machines (Python 3.11) and the GPU image (3.12) have different stdlibs: build on one machine and
  carry out_dir over, rather than rebuilding, so tokenizer, training and evaluation see the same files.

    tether-server build-corpus --out data/corpus --vocab-size 4096     # or, from Python:
    manifest = build_corpus("data/corpus")
    manifest = build_corpus("data/corpus-qwen", tokenizer=model_tokenizer("models/Qwen2-0.5B"))
    train = load_tokens("data/corpus", "train")                         # read-only np.memmap

Tested by tests/server/test_corpus.py (`python -m pytest tests/server/test_corpus.py -q`).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
import sysconfig
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import tokenizers
from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TaskProgressColumn, TextColumn, TimeElapsedColumn

from tether.shared.tokenizer import Tokenizer

SPLITS = ("train", "val")
MANIFEST_NAME = "manifest.json"
TOKENIZER_NAME = "tokenizer.json"
FORMAT = 1  # bump when the layout of the outputs changes
_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
_BATCH = 32  # documents per encode_batch call: parallel inside the library, yet the progress bar still moves


@dataclass(frozen=True)
class CorpusFile:
    name: str  # stdlib: POSIX path relative to the stdlib folder; extra files: the path as given
    sha256: str  # of the raw bytes
    bytes: int
    split: str  # "train" or "val"


@dataclass(frozen=True)
class SkippedFile:
    name: str
    reason: str  # "empty" or "not UTF-8"


@dataclass(frozen=True)
class CorpusManifest:
    python_version: str  # platform.python_version(), e.g. "3.11.7"
    python_build: str  # sys.version, which also names the compiler and build date
    holdout_fraction: float
    vocab_size: int
    tokenizer_sha256: str
    eos_id: int
    dtype: str  # numpy dtype name of train.bin / val.bin
    train_tokens: int
    val_tokens: int
    files: tuple[CorpusFile, ...]
    skipped: tuple[SkippedFile, ...] = ()
    format: int = FORMAT

    def tokens(self, split: str) -> int:
        _check_split(split)
        return self.train_tokens if split == "train" else self.val_tokens

    def files_in(self, split: str) -> list[CorpusFile]:
        """The files of `split` in corpus order, which is also their order in that split's .bin file."""
        _check_split(split)
        return [f for f in self.files if f.split == split]

    def to_json(self) -> str:
        doc = {
            "format": self.format,
            "python_version": self.python_version,
            "python_build": self.python_build,
            "holdout_fraction": self.holdout_fraction,
            "vocab_size": self.vocab_size,
            "tokenizer_sha256": self.tokenizer_sha256,
            "eos_id": self.eos_id,
            "dtype": self.dtype,
            "tokens": {"train": self.train_tokens, "val": self.val_tokens},
            "files": [asdict(f) for f in self.files],
            "skipped": [asdict(s) for s in self.skipped],
        }
        return json.dumps(doc, indent=1, ensure_ascii=False) + "\n"

    @classmethod
    def from_json(cls, text: str) -> CorpusManifest:
        doc = json.loads(text)
        if doc.get("format") != FORMAT:
            raise ValueError(f"corpus manifest format {doc.get('format')!r}; this build reads format {FORMAT}")
        return cls(
            python_version=doc["python_version"],
            python_build=doc["python_build"],
            holdout_fraction=doc["holdout_fraction"],
            vocab_size=doc["vocab_size"],
            tokenizer_sha256=doc["tokenizer_sha256"],
            eos_id=doc["eos_id"],
            dtype=doc["dtype"],
            train_tokens=doc["tokens"]["train"],
            val_tokens=doc["tokens"]["val"],
            files=tuple(CorpusFile(**f) for f in doc["files"]),
            skipped=tuple(SkippedFile(**s) for s in doc["skipped"]),
        )

    @classmethod
    def load(cls, directory: str | Path) -> CorpusManifest:
        return cls.from_json((Path(directory) / MANIFEST_NAME).read_text(encoding="utf-8"))


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")


def stdlib_root() -> Path:
    """The running interpreter's standard-library folder (the base install's, also inside a venv)."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files() -> list[Path]:
    """Every stdlib `*.py` file, sorted by POSIX path relative to `stdlib_root()` (the same order on any OS)."""
    root = stdlib_root()
    found = []
    # os.walk does not follow directory symlinks, so a link loop or a link out of the stdlib adds nothing.
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _EXCLUDED_DIRS]
        found.extend(Path(dirpath, f) for f in filenames if f.endswith(".py"))
    return sorted((p for p in found if p.is_file()), key=lambda p: p.relative_to(root).as_posix())


def _hash_unit(name: str) -> float:
    """A uniform number in [0, 1) fixed by `name` alone (unlike hash(), which is salted per process)."""
    return int.from_bytes(hashlib.sha256(name.encode("utf-8")).digest()[:8], "big") / 2**64


def split_of(name: str, holdout_fraction: float) -> str:
    """ "val" for about `holdout_fraction` of all names, "train" for the rest; a pure function of the name."""
    if not 0.0 <= holdout_fraction <= 1.0:
        raise ValueError(f"holdout_fraction must lie in [0, 1], got {holdout_fraction}")
    return "val" if _hash_unit(name) < holdout_fraction else "train"


def _assign_splits(names: Sequence[str], holdout_fraction: float) -> list[str]:
    splits = [split_of(n, holdout_fraction) for n in names]
    for split, pick in (("val", min), ("train", max)):
        if split not in splits:
            # The file nearest the boundary, so the choice is as close to the hash rule as possible.
            moved = pick(range(len(names)), key=lambda i: _hash_unit(names[i]))
            splits[moved] = split
    return splits


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def model_tokenizer(model_dir: str | Path) -> Tokenizer:
    """A Hugging Face model directory's tokenizer.json, its eos the model's end-of-text (see the module docstring)."""
    directory = Path(model_dir)
    path = directory / TOKENIZER_NAME
    if not path.is_file():
        what = "has no tokenizer.json" if directory.is_dir() else "is not a directory"
        raise FileNotFoundError(f"{directory} {what} (--tokenizer takes a Hugging Face model's directory)")
    try:
        tokenizer = Tokenizer.from_file(path)
    except Exception as e:  # the tokenizers library raises a bare Exception for a file it cannot read
        raise ValueError(f"{path} is not a tokenizer the tokenizers library reads: {e}") from None
    if tokenizer.eos_id is not None:
        return tokenizer
    for name in ("config.json", "generation_config.json"):
        eos = _read_json(directory / name).get("eos_token_id")
        eos = eos[0] if isinstance(eos, list) and eos else eos
        if isinstance(eos, int) and not isinstance(eos, bool) and 0 <= eos < tokenizer.vocab_size:
            return Tokenizer.from_file(path, eos_id=eos)
    eos_token = _read_json(directory / "tokenizer_config.json").get("eos_token")
    if isinstance(eos_token, dict):
        eos_token = eos_token.get("content")
    if (
        isinstance(eos_token, str)
        and (eos := tokenizers.Tokenizer.from_file(str(path)).token_to_id(eos_token)) is not None
    ):
        return Tokenizer.from_file(path, eos_id=eos)
    raise ValueError(
        f"{directory}: no end-of-text token (no <|endoftext|> in tokenizer.json, no eos_token_id in config.json or "
        "generation_config.json, no eos_token in tokenizer_config.json); the corpus ends each document with it"
    )


def load_tokens(directory: str | Path, split: str) -> np.ndarray:
    """The token ids of `split` as a read-only memory map (documents each followed by the eos id)."""
    _check_split(split)
    manifest = CorpusManifest.load(directory)
    path = Path(directory) / f"{split}.bin"
    if manifest.tokens(split) == 0:
        return np.empty(0, dtype=manifest.dtype)  # mmap cannot map an empty file
    return np.memmap(path, dtype=manifest.dtype, mode="r", shape=(manifest.tokens(split),))


def build_corpus(
    out_dir: str | Path,
    *,
    extra_files: Iterable[str | Path] = (),
    holdout_fraction: float = 0.02,
    max_files: int | None = None,
    vocab_size: int = 4096,
    tokenizer: Tokenizer | None = None,
    progress: bool = True,
) -> CorpusManifest:
    """Build the corpus into `out_dir` (see the module docstring) and return its manifest.

    `max_files` keeps only the first N stdlib files (tests use it to stay fast); extra files are always
    included. `vocab_size` is used only when a tokenizer has to be trained; a given `tokenizer` must have an
    eos id.
    """
    if not 0.0 < holdout_fraction < 1.0:
        raise ValueError(f"holdout_fraction must lie strictly between 0 and 1, got {holdout_fraction}")
    if max_files is not None and max_files < 0:
        raise ValueError(f"max_files must be >= 0, got {max_files}")
    if tokenizer is not None and tokenizer.eos_id is None:
        raise ValueError("the corpus separates documents with eos, and this tokenizer has no eos_id")

    root = stdlib_root()
    sources = [(p.relative_to(root).as_posix(), p) for p in stdlib_files()[:max_files]]
    sources += [(Path(p).as_posix(), Path(p)) for p in extra_files]
    names = [name for name, _ in sources]
    if len(set(names)) != len(names):
        duplicates = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"corpus file names must be unique; repeated: {duplicates}")

    kept: list[tuple[str, str, bytes]] = []  # (name, text, raw bytes)
    skipped: list[SkippedFile] = []
    for name, path in sources:
        raw = path.read_bytes()
        try:
            text = raw.decode("utf-8")  # not read_text: that would turn "\r\n" into "\n"
        except UnicodeDecodeError:
            skipped.append(SkippedFile(name, "not UTF-8"))
            continue
        if not raw:
            skipped.append(SkippedFile(name, "empty"))  # it would add nothing but a lone eos
            continue
        kept.append((name, text, raw))
    if len(kept) < 2:
        raise ValueError(f"need at least 2 usable files for a train and a val split, found {len(kept)}")
    splits = _assign_splits([name for name, _, _ in kept], holdout_fraction)

    columns = (
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        TaskProgressColumn(),
        TimeElapsedColumn(),
    )
    # stderr, so a command that prints its result on stdout stays machine-readable.
    with Progress(*columns, console=Console(stderr=True), disable=not progress) as bar:
        if tokenizer is None:
            task = bar.add_task("training tokenizer", total=None)
            train_texts = [text for (_, text, _), split in zip(kept, splits, strict=True) if split == "train"]
            tokenizer = Tokenizer.train(texts=train_texts, vocab_size=vocab_size)
            bar.update(task, total=1, completed=1)
        eos_id = tokenizer.eos_id
        assert eos_id is not None  # trained tokenizers always have one; a given one was checked above
        dtype = np.dtype(np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32)

        chunks: dict[str, list[np.ndarray]] = {split: [] for split in SPLITS}
        task = bar.add_task("tokenizing", total=sum(len(raw) for _, _, raw in kept))
        for start in range(0, len(kept), _BATCH):
            batch = kept[start : start + _BATCH]
            encoded = tokenizer.encode_batch([text for _, text, _ in batch])
            for ids, split in zip(encoded, splits[start : start + _BATCH], strict=True):
                chunks[split].append(np.asarray([*ids, eos_id], dtype=dtype))
            bar.advance(task, sum(len(raw) for _, _, raw in batch))

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # A crash part-way must not leave an old manifest vouching for a mix of old and new outputs.
    (out / MANIFEST_NAME).unlink(missing_ok=True)
    tokenizer.save(out / TOKENIZER_NAME)
    counts = {}
    for split in SPLITS:
        tokens = np.concatenate(chunks[split]) if chunks[split] else np.empty(0, dtype=dtype)
        _write_atomically(out / f"{split}.bin", tokens.tobytes())
        counts[split] = int(tokens.size)

    manifest = CorpusManifest(
        python_version=platform.python_version(),
        python_build=sys.version,
        holdout_fraction=holdout_fraction,
        vocab_size=tokenizer.vocab_size,
        tokenizer_sha256=tokenizer.sha256,
        eos_id=eos_id,
        dtype=dtype.name,
        train_tokens=counts["train"],
        val_tokens=counts["val"],
        files=tuple(
            CorpusFile(name, hashlib.sha256(raw).hexdigest(), len(raw), split)
            for (name, _, raw), split in zip(kept, splits, strict=True)
        ),
        skipped=tuple(skipped),
    )
    _write_atomically(out / MANIFEST_NAME, manifest.to_json().encode("utf-8"))
    return manifest


def _write_atomically(path: Path, data: bytes) -> None:
    # Readers (a training run memory-mapping the corpus) never see a half-written file.
    partial = path.with_name(path.name + ".partial")
    partial.write_bytes(data)
    os.replace(partial, path)
