"""Training corpus: the standard library's sources, optionally the installed packages', plus files the user names.

Contract (docs/ARCHITECTURE.md, section 9):
- Documents are the stdlib's `*.py` files (site-packages, dist-packages and __pycache__ excluded) in sorted
  order of their POSIX path relative to the stdlib folder; then, with `packages=True`, the `*.py` files of the
  permissively licensed distributions installed in `site_paths` (server/train/package_sources.py decides which, and
  why not the others: distributions by name, files by path), named `site-packages/PACKAGE/PATH`; and then the
  extra files in the order given, named by the path as given. Files that are empty or not valid UTF-8 are left
  out and listed as skipped, as are the package files package_sources skips (vendored, generated, too large,
  outside the site-packages folder), with its reason.
- Each document goes wholly to "train" or "val", decided by the sha256 of its *unit* alone, so the split does
  not depend on file order, on which other units are present, or on the machine. The unit of a package file
  is its package's name: a package lies wholly in train or wholly in val, and adding a package never moves
  another. The unit of a stdlib or extra file is its own name: the stdlib is hundreds of independent modules,
  and one unit of 9M tokens would leave val without stdlib code or train without it; so stdlib files keep
  exactly the split they have without packages. If that leaves a split empty (likely for a handful of units
  at 2%), the unit whose hash lies nearest the boundary moves over: the lowest hash into val, the highest into
  train (only then can adding a unit move another); the manifest records the final split of every file.
- Without a given tokenizer, a byte-level BPE is trained on the train documents only, so val stays unseen.
  `model_tokenizer(MODEL_DIR)` gives a Hugging Face model's own (its tokenizer.json), so that a drafter can be
  trained for that model on token ids it reads: documents end with the model's end-of-text token, which is the
  tokenizer's `<|endoftext|>` (Qwen2), else config.json's eos_token_id (Llama 3's `<|end_of_text|>`; the first
  of a list), else generation_config.json's, else tokenizer_config.json's eos_token. A directory without
  tokenizer.json, or a tokenizer without any of those, is refused (ValueError / FileNotFoundError, one line).
- out_dir gets tokenizer.json, train.bin and val.bin (flat native-endian uint16 arrays, uint32 above 65536
  ids: every document followed by the eos id) and manifest.json (interpreter version, split fraction,
  tokenizer sha256, token counts, every file with its sha256, size and split). manifest.json is written last,
  so its presence means the rest is complete. The same inputs give byte-identical outputs. With packages the
  manifest is format 2: every file also names its package, version and SPDX licence (the stdlib's:
  "python-stdlib", the interpreter's version, PSF-2.0), and it lists the packages in the corpus (licence, where
  it was read, split, files, bytes) and those left out with the reason. Without packages it is format 1, byte
  for byte what it was before packages existed; this build reads both.
- The CPU machines (Python 3.11) and the GPU image (3.12) have different stdlibs: build on one machine and
  carry out_dir over, rather than rebuilding, so tokenizer, training and evaluation see the same files.

    tether-server build-corpus --out data/corpus --vocab-size 4096     # or, from Python:
    tether-server build-corpus --packages --out data/corpus-pkgs --vocab-size 8192 --licences-report licences.json
    manifest = build_corpus("data/corpus")
    manifest = build_corpus("data/corpus-pkgs", packages=True, site_paths=["/usr/lib/python3/dist-packages"])
    manifest = build_corpus("data/corpus-qwen", tokenizer=model_tokenizer("models/Qwen2-0.5B"))
    train = load_tokens("data/corpus", "train")                         # read-only np.memmap

Tested by tests/server/train/test_corpus.py and, with packages, tests/server/train/test_package_sources.py
(`python -m pytest tests/server/train/test_corpus.py tests/server/train/test_package_sources.py -q`).
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
from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TaskProgressColumn, TextColumn, TimeElapsedColumn

from tether.server.train.package_sources import DEFAULT_MAX_FILE_BYTES, Exclusion, PackageSelection, select_packages
from tether.shared.tokenizer import Tokenizer

SPLITS = ("train", "val")
MANIFEST_NAME = "manifest.json"
TOKENIZER_NAME = "tokenizer.json"
FORMAT = 1  # bump when the layout of the outputs changes; a corpus without packages is still written as 1
PACKAGES_FORMAT = 2  # format 1 plus package fields per file and the package lists
READABLE_FORMATS = (FORMAT, PACKAGES_FORMAT)
STDLIB_PACKAGE = "python-stdlib"
STDLIB_LICENCE = "PSF-2.0"
_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
_BATCH = 32  # documents per encode_batch call: parallel inside the library, yet the progress bar still moves


@dataclass(frozen=True)
class CorpusFile:
    name: str  # stdlib: path in the stdlib folder; packages: site-packages/PACKAGE/RECORD path; extra: as given
    sha256: str  # of the raw bytes
    bytes: int
    split: str  # "train" or "val"
    package: str | None = None  # with packages: the normalised distribution name, "python-stdlib"; None: extra file
    version: str | None = None  # the distribution's version (the interpreter's for the stdlib)
    licence: str | None = None  # SPDX-normalised (server/train/package_sources.py)


@dataclass(frozen=True)
class SkippedFile:
    name: str
    reason: str  # "empty", "not UTF-8", or a package file's FileSkip value (server/train/package_sources.py)


@dataclass(frozen=True)
class CorpusPackage:
    name: str  # normalised distribution name; "python-stdlib" for the standard library
    version: str
    licence: str  # SPDX-normalised
    licence_source: str  # the metadata field it was read from (server/train/package_sources.py)
    split: str  # "train" or "val"; "file" for the stdlib, whose files are split one by one
    files: int  # files in the corpus
    bytes: int


@dataclass(frozen=True)
class ExcludedPackage:
    name: str
    version: str
    licence: str | None  # as read, when there was a statement
    reason: str  # an Exclusion's name (server/train/package_sources.py), or "NO_SOURCES" when no file was usable
    detail: str  # one line more, e.g. "License-Expression: GPL-3.0-or-later is copyleft"


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
    packages: tuple[CorpusPackage, ...] = ()  # empty unless built with packages
    excluded_packages: tuple[ExcludedPackage, ...] = ()
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
            # Without packages a file has no package fields, so such a manifest stays what format 1 wrote.
            "files": [{k: v for k, v in asdict(f).items() if v is not None} for f in self.files],
            "skipped": [asdict(s) for s in self.skipped],
        }
        if self.format >= 2:
            doc["packages"] = [asdict(p) for p in self.packages]
            doc["excluded_packages"] = [asdict(p) for p in self.excluded_packages]
        return json.dumps(doc, indent=1, ensure_ascii=False) + "\n"

    @classmethod
    def from_json(cls, text: str) -> CorpusManifest:
        doc = json.loads(text)
        if doc.get("format") not in READABLE_FORMATS:
            raise ValueError(f"corpus manifest format {doc.get('format')!r}; this build reads {READABLE_FORMATS}")
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
            packages=tuple(CorpusPackage(**p) for p in doc.get("packages", ())),
            excluded_packages=tuple(ExcludedPackage(**p) for p in doc.get("excluded_packages", ())),
            format=doc["format"],
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


def model_tokenizer(model_dir: str | Path) -> Tokenizer:
    """A Hugging Face model directory's tokenizer.json, its eos the model's end-of-text (see the module docstring)."""
    directory = Path(model_dir)
    path = directory / TOKENIZER_NAME
    if not path.is_file():
        what = "has no tokenizer.json" if directory.is_dir() else "is not a directory"
        raise FileNotFoundError(f"{directory} {what} (--tokenizer takes a Hugging Face model's directory)")
    try:
        tokenizer = Tokenizer.from_pretrained(directory)
    except Exception as e:  # the tokenizers library raises a bare Exception for a file it cannot read
        raise ValueError(f"{path} is not a tokenizer the tokenizers library reads: {e}") from None
    if tokenizer.eos_id is not None:
        return tokenizer
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


@dataclass(frozen=True)
class _Source:
    name: str  # the document's name in the manifest
    path: Path
    unit: str  # what the held-out split hashes: the file's name, or its package's name
    package: str | None = None
    version: str | None = None
    licence: str | None = None


def _package_sources(selection: PackageSelection) -> tuple[list[_Source], list[SkippedFile]]:
    sources, skipped = [], []
    for package in selection.included:
        prefix = f"site-packages/{package.name}/"  # stdlib names never start so: its site-packages is not walked
        for f in package.files:
            licence = package.licence.expression
            sources.append(_Source(prefix + f.name, f.path, package.name, package.name, package.version, licence))
        skipped += [SkippedFile(prefix + s.name, s.reason.value) for s in package.skipped]
    return sources, skipped


def build_corpus(
    out_dir: str | Path,
    *,
    extra_files: Iterable[str | Path] = (),
    holdout_fraction: float = 0.02,
    max_files: int | None = None,
    vocab_size: int = 4096,
    tokenizer: Tokenizer | None = None,
    progress: bool = True,
    packages: bool = False,
    site_paths: Sequence[str | Path] | None = None,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
) -> CorpusManifest:
    """Build the corpus into `out_dir` (see the module docstring) and return its manifest.

    `max_files` keeps only the first N stdlib files (tests use it to stay fast); extra files are always
    included. `vocab_size` is used only when a tokenizer has to be trained; a given `tokenizer` must have an
    eos id. `packages` adds the permissively licensed installed distributions of `site_paths` (default: the
    running interpreter's site-packages), each file at most `max_file_bytes` (server/train/package_sources.py).
    """
    if not 0.0 < holdout_fraction < 1.0:
        raise ValueError(f"holdout_fraction must lie strictly between 0 and 1, got {holdout_fraction}")
    if max_files is not None and max_files < 0:
        raise ValueError(f"max_files must be >= 0, got {max_files}")
    if tokenizer is not None and tokenizer.eos_id is None:
        raise ValueError("the corpus separates documents with eos, and this tokenizer has no eos_id")
    if site_paths is not None and not packages:
        raise ValueError("site-packages folders are read only when packages are added (--packages)")

    root = stdlib_root()
    stdlib = (STDLIB_PACKAGE, platform.python_version(), STDLIB_LICENCE) if packages else (None, None, None)
    sources = []
    for path in stdlib_files()[:max_files]:
        name = path.relative_to(root).as_posix()
        sources.append(_Source(name, path, name, *stdlib))
    skipped: list[SkippedFile] = []
    selection = None
    if packages:
        selection = select_packages(site_paths, max_file_bytes=max_file_bytes)
        package_sources, skipped = _package_sources(selection)
        sources += package_sources
    sources += [_Source(Path(p).as_posix(), Path(p), Path(p).as_posix()) for p in extra_files]
    names = [s.name for s in sources]
    if len(set(names)) != len(names):
        duplicates = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"corpus file names must be unique; repeated: {duplicates}")

    kept: list[tuple[_Source, str, bytes]] = []  # (source, text, raw bytes)
    for source in sources:
        raw = source.path.read_bytes()
        try:
            text = raw.decode("utf-8")  # not read_text: that would turn "\r\n" into "\n"
        except UnicodeDecodeError:
            skipped.append(SkippedFile(source.name, "not UTF-8"))
            continue
        if not raw:
            skipped.append(SkippedFile(source.name, "empty"))  # it would add nothing but a lone eos
            continue
        kept.append((source, text, raw))
    if len(kept) < 2:
        raise ValueError(f"need at least 2 usable files for a train and a val split, found {len(kept)}")
    units = list(dict.fromkeys(source.unit for source, _, _ in kept))
    split_of_unit = dict(zip(units, _assign_splits(units, holdout_fraction), strict=True))
    splits = [split_of_unit[source.unit] for source, _, _ in kept]

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
            CorpusFile(s.name, hashlib.sha256(raw).hexdigest(), len(raw), split, s.package, s.version, s.licence)
            for (s, _, raw), split in zip(kept, splits, strict=True)
        ),
        skipped=tuple(skipped),
        **(_package_lists(selection, kept, split_of_unit) if selection is not None else {}),
    )
    _write_atomically(out / MANIFEST_NAME, manifest.to_json().encode("utf-8"))
    return manifest


def _package_lists(
    selection: PackageSelection, kept: Sequence[tuple[_Source, str, bytes]], split_of_unit: dict[str, str]
) -> dict:
    """The manifest's package fields: every package with files in the corpus, and every one left out and why."""
    files: dict[str, int] = {}
    sizes: dict[str, int] = {}
    for source, _, raw in kept:
        if source.package is not None:
            files[source.package] = files.get(source.package, 0) + 1
            sizes[source.package] = sizes.get(source.package, 0) + len(raw)
    included = []
    if STDLIB_PACKAGE in files:
        stdlib = (STDLIB_PACKAGE, platform.python_version(), STDLIB_LICENCE, "interpreter", "file")
        included.append(CorpusPackage(*stdlib, files[STDLIB_PACKAGE], sizes[STDLIB_PACKAGE]))
    excluded = [
        ExcludedPackage(p.name, p.version, p.licence.expression, p.exclusion.name, p.detail)
        for p in selection.excluded
        if p.exclusion is not None
    ]
    for p in selection.included:
        licence = (p.licence.expression or "", p.licence.source)
        if p.name in files:
            split = split_of_unit[p.name]
            included.append(CorpusPackage(p.name, p.version, *licence, split, files[p.name], sizes[p.name]))
        else:
            detail = "every .py file is empty or not UTF-8"
            excluded.append(ExcludedPackage(p.name, p.version, licence[0], Exclusion.NO_SOURCES.name, detail))
    excluded.sort(key=lambda p: (p.name, p.version))
    return {"packages": tuple(included), "excluded_packages": tuple(excluded), "format": PACKAGES_FORMAT}


def _write_atomically(path: Path, data: bytes) -> None:
    # Readers (a training run memory-mapping the corpus) never see a half-written file.
    partial = path.with_name(path.name + ".partial")
    partial.write_bytes(data)
    os.replace(partial, path)
