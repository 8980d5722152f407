"""The training commands of `tether-server` (tether.server.cli lists them beside serving's): build-corpus,
train-target, train-drafter.

Contract: `COMMANDS` is (name, help, add_arguments, function) per command, as tether.server.cli's table. Importing
this module is light (no torch): each command's flags import what they are built from when it is parsed, and its
function the training code when it runs, so `tether-server --help` stays quick.

    tether-server build-corpus --out data/corpus
    tether-server train-target --preset small --out runs/target --steps 4000 --device cuda
    tether-server train-drafter --target MODEL_DIR --data data/corpus-hf --out runs/drafter --device cuda
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import TYPE_CHECKING

from tether.shared.cli_support import add_dataclass_args, build_config, parse_overrides

if TYPE_CHECKING:
    from tether.server.train.corpus import CorpusManifest

SAVE_DTYPES = ("float32", "bfloat16", "float16")  # what train-target and train-drafter may write their weights in


def cmd_build_corpus(args: argparse.Namespace) -> int:
    from tether.server.train.corpus import build_corpus, model_tokenizer

    if args.site_packages and not args.packages:
        raise ValueError("--site-packages names where --packages looks: give --packages too")
    if args.licences_report and not args.packages:
        raise ValueError("--licences-report reports on --packages: give --packages too")
    manifest = build_corpus(
        args.out,
        extra_files=args.extra_files,
        holdout_fraction=args.holdout_fraction,
        vocab_size=args.vocab_size,
        max_files=args.max_files or None,
        tokenizer=model_tokenizer(args.tokenizer) if args.tokenizer else None,
        packages=args.packages,
        site_paths=args.site_packages or None,
        max_file_bytes=args.max_file_bytes,
    )
    if not args.packages:
        print(json.dumps(dataclasses.asdict(manifest) | {"files": len(manifest.files)}, default=str))
        return 0
    if args.licences_report:
        report = {
            "packages": [dataclasses.asdict(p) for p in manifest.packages],
            "excluded_packages": [dataclasses.asdict(p) for p in manifest.excluded_packages],
            "skipped_files": [dataclasses.asdict(s) for s in manifest.skipped],
        }
        with open(args.licences_report, "w", encoding="utf-8") as f:
            f.write(json.dumps(report, indent=1, ensure_ascii=False) + "\n")
    _print_package_corpus(manifest, args.out)
    return 0


def _print_package_corpus(manifest: CorpusManifest, out: str) -> None:
    """The short summary of a corpus built with --packages: what went in per split, what was left out and why."""
    from collections import Counter

    from rich.console import Console
    from rich.table import Table

    from tether.server.train.package_sources import Exclusion

    sizes = Table(title=f"corpus {out}")
    for column in ("split", "packages", "files", "MB", "tokens"):
        sizes.add_column(column, justify="left" if column == "split" else "right")
    for split in ("train", "val"):
        files = manifest.files_in(split)
        names = {f.package for f in files}
        mb = sum(f.bytes for f in files) / 1e6
        sizes.add_row(split, str(len(names)), f"{len(files):,}", f"{mb:,.1f}", f"{manifest.tokens(split):,}")
    held_out = [p for p in manifest.packages if p.split == "val"]
    val = ", ".join(p.name for p in held_out) or "none"
    mb = sum(p.bytes for p in held_out) / 1e6
    sizes.caption = f"packages held out whole: {val} ({mb:,.2f} MB); the stdlib (in both) is split by file"
    left_out = Table(title=f"{len(manifest.excluded_packages)} packages left out")
    for column in ("package", "version", "licence", "why"):
        left_out.add_column(column)
    for p in manifest.excluded_packages:
        left_out.add_row(p.name, p.version, p.licence or "-", p.detail or Exclusion[p.reason].value)
    skips = Counter(s.reason for s in manifest.skipped)
    console = Console()
    console.print(sizes)
    console.print(left_out)
    console.print("files skipped: " + (", ".join(f"{n} {why}" for why, n in sorted(skips.items())) or "none"))


def cmd_train_target(args: argparse.Namespace) -> int:
    from tether.server.train.target import TrainConfig, train_target

    cfg = build_config(TrainConfig, args, overrides=parse_overrides(args.set))
    summary = train_target(cfg)
    print(json.dumps(summary))
    return 0


def cmd_train_drafter(args: argparse.Namespace) -> int:
    from tether.server.train.drafter import DrafterTrainConfig, train_drafter

    summary = train_drafter(build_config(DrafterTrainConfig, args, overrides=parse_overrides(args.set)))
    print(json.dumps(summary))
    return 0


def _build_corpus_args(p: argparse.ArgumentParser) -> None:
    from tether.server.train.package_sources import DEFAULT_MAX_FILE_BYTES

    p.add_argument("--out", default="data/corpus", help="output directory")
    p.add_argument("--extra-files", nargs="*", default=[], metavar="FILE", help="more text files to add to the corpus")
    p.add_argument(
        "--holdout-fraction",
        type=float,
        default=0.02,
        help="fraction held out: of stdlib and extra files by file, of packages by package",
    )
    p.add_argument("--vocab-size", type=int, default=4096, help="vocabulary of the BPE trained here (no --tokenizer)")
    p.add_argument("--max-files", type=int, default=0, help="use only the first N stdlib files (0 = all)")
    p.add_argument(
        "--tokenizer",
        default="",
        metavar="MODEL_DIR",
        help="tokenize with this Hugging Face model's tokenizer.json instead of training a BPE, so a "
        "drafter can be trained for that model; empty = train one",
    )
    p.add_argument(
        "--packages",
        action="store_true",
        help="add the Python files of the installed packages under a permissive licence (MIT, BSD, "
        "Apache, ISC, PSF, ...), each package wholly in train or in val",
    )
    p.add_argument(
        "--site-packages",
        nargs="+",
        default=[],
        metavar="DIR",
        help="site-packages folders for --packages, first wins; none = this interpreter's",
    )
    p.add_argument(
        "--max-file-bytes",
        type=int,
        default=DEFAULT_MAX_FILE_BYTES,
        help="leave out package files larger than this (generated tables)",
    )
    p.add_argument(
        "--licences-report",
        default="",
        metavar="FILE",
        help="with --packages: each package's licence, split or reason left out, as JSON",
    )


def _set_flag(p: argparse.ArgumentParser, example: str) -> None:
    p.add_argument("--set", action="append", default=[], metavar="FIELD=JSON", help=f"override a field, e.g. {example}")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def _train_target_args(p: argparse.ArgumentParser) -> None:
    from tether.server.train.target import TrainConfig
    from tether.shared.attention import available_backends
    from tether.shared.config import PRESETS

    choices = {"preset": tuple(PRESETS), "save_dtype": SAVE_DTYPES, "attention": ("auto", *available_backends())}
    add_dataclass_args(p, TrainConfig, skip=("overrides", "quiet"), choices=choices)
    _set_flag(p, "--set moda=false --set n_layers=12 (a ModelConfig field of the preset)")


def _train_drafter_args(p: argparse.ArgumentParser) -> None:
    from tether.server.train.drafter import DrafterTrainConfig

    choices = {"kind": ("moa", "eagle"), "save_dtype": SAVE_DTYPES}
    add_dataclass_args(p, DrafterTrainConfig, skip=("overrides", "quiet"), choices=choices)
    _set_flag(p, "--set ffn_dim=768 (a DrafterConfig field)")


COMMANDS = (  # name, help, flags, function
    (
        "build-corpus",
        "build the training corpus: stdlib (+ --packages) sources -> tokenizer + token files",
        _build_corpus_args,
        cmd_build_corpus,
    ),
    ("train-target", "train a target model from a preset", _train_target_args, cmd_train_target),
    ("train-drafter", "train a MoA or EAGLE drafter against a frozen target", _train_drafter_args, cmd_train_drafter),
)
