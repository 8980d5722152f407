"""The held-out prompt set: function and class headers with their docstrings, from a corpus's held-out packages.

A prompt is what a user would hand a code model: a `def` or `class` line (and its continuation lines) with its
docstring, dedented, ending at the docstring's closing quotes; the model writes the body. Not with the newline
after them: byte-level BPEs read a newline and the next line's indentation as one token, so a prompt ending in a
bare newline token tells the model that the next line starts at column 0 (a new definition, not the body). They
come from the package files of a corpus (server/train/corpus.py) whose package was held out (`split: val` in
manifest.json): no model trained on that corpus saw them. The stdlib's held-out files are not used: its modules
are split file by file, so their neighbours (and code copied between them) were trained on.

Contract:
- Files: every `site-packages/PACKAGE/PATH` file of a held-out package is read from the first `--site-packages`
  folder (default: this interpreter's) whose PATH has the manifest's sha256; a file missing or changed (another
  version installed) is skipped and counted, never read in its new form.
- Candidates: each function or class (at any nesting) whose body starts with a docstring of at least
  `MIN_DOC_WORDS` words and goes on for at least `MIN_BODY_LINES` more lines (stubs and abstract methods have
  nothing to continue), whose header and docstring hold nothing else on their lines, and whose prompt is at most
  `--max-tokens` tokens under the corpus's tokenizer. Duplicates (same text, or the same docstring, as overloads
  and copied helpers have) keep the first in (package, file, line) order.
- Choice, deterministic: each package's candidates ordered by the sha256 of their text, then taken round-robin
  over the packages in name order, at most `PER_FILE` from one file, until `--count`: a few large packages
  (matplotlib, pygments) would otherwise fill the set.
- Output: one JSON object a line, in (package, file, line) order: id (the text's sha256, 16 hex), text, tokens,
  package, version, licence, file (the manifest's name), file_sha256, name (qualified), line, end_line (the
  docstring's last line, 1-based). A summary table goes to stderr.

    python bench/heldout_prompts.py --manifest /work/data/corpus-compact/manifest.json \
        --out deploy/models/prompts/heldout.jsonl
    python bench/heldout_prompts.py --manifest deploy/models/medium/corpus/manifest.json.xz \
        --tokenizer deploy/models/target --out /tmp/heldout.jsonl

Tested by tests/server/test_bench_quality.py.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import lzma
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path, PurePosixPath

from rich.console import Console
from rich.table import Table

from tether.server.train.corpus import STDLIB_PACKAGE, CorpusManifest
from tether.server.train.package_sources import default_site_paths
from tether.shared.tokenizer import Tokenizer

MIN_DOC_WORDS = 4
MIN_BODY_LINES = 3
PER_FILE = 2
_SITE_PREFIX = "site-packages/"


@dataclass(frozen=True)
class Prompt:
    id: str
    text: str
    tokens: int
    package: str
    version: str
    licence: str
    file: str
    file_sha256: str
    name: str
    line: int
    end_line: int


@dataclass(frozen=True)
class Candidate:
    """A prompt before tokenizing: `text` and where it came from; `docstring` for de-duplication."""

    text: str
    docstring: str
    name: str
    line: int
    end_line: int


def load_manifest(path: Path) -> CorpusManifest:
    """A corpus's manifest.json, or an xz-compressed copy of one (as deploy/models/*/corpus keep them)."""
    raw = path.read_bytes()
    return CorpusManifest.from_json((lzma.decompress(raw) if path.suffix == ".xz" else raw).decode("utf-8"))


def heldout_packages(manifest: CorpusManifest) -> set[str]:
    """The packages held out whole (the stdlib is split file by file, so it never is)."""
    return {p.name for p in manifest.packages if p.split == "val" and p.name != STDLIB_PACKAGE}


def locate(name: str, sha256: str, site_paths: Sequence[Path]) -> Path | None:
    """The installed file a manifest name stands for, if one of `site_paths` has it with these exact bytes."""
    relative = PurePosixPath(name.removeprefix(_SITE_PREFIX)).parts[1:]  # drop the package's name
    if not name.startswith(_SITE_PREFIX) or not relative or ".." in relative:
        return None
    for root in site_paths:
        path = Path(root, *relative).resolve()  # through any symlink: read nothing outside the folder
        if path.is_relative_to(Path(root).resolve()) and path.is_file():
            if hashlib.sha256(path.read_bytes()).hexdigest() == sha256:
                return path
    return None


def _definitions(tree: ast.AST, prefix: str = "") -> Iterator[tuple[str, ast.AST]]:
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            yield prefix + node.name, node
            yield from _definitions(node, f"{prefix}{node.name}.")
        else:
            yield from _definitions(node, prefix)


def candidates(source: str) -> list[Candidate]:
    """The header + docstring prompts of one file's source (the rules are in the module docstring)."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    lines = source.splitlines()
    found = []
    for name, node in _definitions(tree):
        body = node.body
        doc = body[0].value if isinstance(body[0], ast.Expr) else None
        if not (isinstance(doc, ast.Constant) and isinstance(doc.value, str)):
            continue
        if len(doc.value.split()) < MIN_DOC_WORDS or node.end_lineno - body[0].end_lineno < MIN_BODY_LINES:
            continue
        indent = node.col_offset
        segment = lines[node.lineno - 1 : body[0].end_lineno]
        if segment[0][:indent].strip() or segment[-1][body[0].end_col_offset :].strip():
            continue  # something else shares the header's or the docstring's line
        if any(line.strip() and line[:indent].strip() for line in segment):
            continue  # a docstring line left of the header: dedenting would change the text
        # No newline after the docstring: byte-level BPEs merge a newline with the next line's indentation
        # ("\n   "), so a prompt ending in a bare "\n" token says the next line starts at column 0.
        text = "\n".join(line[indent:].rstrip() for line in segment)
        found.append(Candidate(text, " ".join(doc.value.split()), name, node.lineno, body[0].end_lineno))
    return found


def choose(pools: dict[str, list[tuple[str, Candidate]]], count: int, fits) -> list[tuple[str, Candidate]]:
    """Round-robin over packages in name order, each package's (file, candidate) pairs in the order given, at most
    PER_FILE a file; `fits(candidate)` rejects one (too many tokens)."""
    chosen: list[tuple[str, Candidate]] = []
    per_file: dict[str, int] = {}
    queues = {package: iter(pools[package]) for package in sorted(pools)}
    while queues and len(chosen) < count:
        for package in list(queues):
            for file, candidate in queues[package]:
                if per_file.get(file, 0) < PER_FILE and fits(candidate):
                    per_file[file] = per_file.get(file, 0) + 1
                    chosen.append((file, candidate))
                    break
            else:
                del queues[package]
            if len(chosen) == count:
                break
    return chosen


def build_prompts(manifest: CorpusManifest, tokenizer: Tokenizer, *, count: int = 64, max_tokens: int = 200,
                  site_paths: Sequence[Path] | None = None) -> tuple[list[Prompt], dict]:  # fmt: skip
    """The prompt set and its per-package figures (files read, skipped as changed or missing, candidates, chosen)."""
    roots = [Path(p) for p in (default_site_paths() if site_paths is None else site_paths)]
    held_out = heldout_packages(manifest)
    files = {f.name: f for f in manifest.files if f.package in held_out and f.split == "val"}
    figures = {p: {"files": 0, "changed_or_missing": 0, "candidates": 0, "chosen": 0} for p in sorted(held_out)}
    pools: dict[str, list[tuple[str, Candidate]]] = {p: [] for p in held_out}
    seen_texts, seen_docs = set(), set()
    for f in sorted(files.values(), key=lambda f: (f.package, f.name)):
        figures[f.package]["files"] += 1
        path = locate(f.name, f.sha256, roots)
        if path is None:
            figures[f.package]["changed_or_missing"] += 1
            continue
        for c in candidates(path.read_bytes().decode("utf-8")):
            if c.text in seen_texts or c.docstring in seen_docs:
                continue
            seen_texts.add(c.text)
            seen_docs.add(c.docstring)
            pools[f.package].append((f.name, c))
            figures[f.package]["candidates"] += 1
    for pool in pools.values():
        pool.sort(key=lambda fc: _digest(fc[1].text))
    chosen = choose(pools, count, lambda c: len(tokenizer.encode(c.text)) <= max_tokens)
    prompts = []
    for name, c in chosen:
        f = files[name]
        figures[f.package]["chosen"] += 1
        prompts.append(Prompt(_digest(c.text)[:16], c.text, len(tokenizer.encode(c.text)), f.package, f.version,
                              f.licence, f.name, f.sha256, c.name, c.line, c.end_line))  # fmt: skip
    prompts.sort(key=lambda p: (p.package, p.file, p.line))
    return prompts, figures


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def write_prompts(prompts: Sequence[Prompt], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(asdict(p), ensure_ascii=False) + "\n" for p in prompts), encoding="utf-8")


def read_prompts(path: Path) -> list[Prompt]:
    """A prompt set written by write_prompts."""
    lines = path.read_text(encoding="utf-8").splitlines()
    return [Prompt(**json.loads(line)) for line in lines if line.strip()]


def main(argv: list[str] | None = None) -> list[Prompt]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--manifest", type=Path, required=True, help="a corpus's manifest.json (or manifest.json.xz)")
    ap.add_argument("--tokenizer", type=Path, help="folder with tokenizer.json (default: the manifest's folder)")
    ap.add_argument("--out", type=Path, required=True, help="the JSONL file to write")
    ap.add_argument("--count", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=200, help="longest prompt, in the tokenizer's tokens")
    ap.add_argument("--site-packages", type=Path, nargs="*", help="folders to read the packages from")
    args = ap.parse_args(argv)
    tokenizer = Tokenizer.from_pretrained(args.tokenizer or args.manifest.parent)
    prompts, figures = build_prompts(load_manifest(args.manifest), tokenizer, count=args.count,
                                     max_tokens=args.max_tokens, site_paths=args.site_packages)  # fmt: skip
    if not prompts:
        raise SystemExit(f"{args.manifest}: no prompt found in its held-out packages' installed files")
    write_prompts(prompts, args.out)
    table = Table(title=f"{len(prompts)} held-out prompts -> {args.out}")
    for col in ("package", "files", "changed or missing", "candidates", "chosen"):
        table.add_column(col, justify="right")
    for package, f in figures.items():
        table.add_row(package, *(str(f[k]) for k in ("files", "changed_or_missing", "candidates", "chosen")))
    Console(stderr=True, width=120).print(table)
    return prompts


if __name__ == "__main__":
    main()
