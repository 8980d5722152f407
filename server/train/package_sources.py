"""Which installed distributions' Python files may go into a training corpus, and why the others may not.

Contract (docs/ARCHITECTURE.md, section 9):
- `select_packages(site_paths)` walks the distributions (dist-info / egg-info) directly inside each site-packages
  folder (default: the running interpreter's), in the order given; a name found again in a later folder, or twice
  in one, is shadowed: the first wins, as for the import system. Distributions are ordered by normalised name
  (PEP 503: lower case, runs of "-_." as one "-"), each one's files by their POSIX path in RECORD.
- Licence (`licence_of`): every licence statement in the metadata is read: License-Expression (PEP 639, SPDX),
  License (free text: accepted when it is a known name such as "MIT License" or "Apache 2.0", or an SPDX
  expression of known identifiers; otherwise it is a licence's body and says nothing we can check), and the
  "License :: OSI Approved :: ..." classifiers (several are read as AND: the conservative reading). A distribution
  is permissive only when there is at least one statement and every one of them is permissive; an SPDX OR is
  permissive when one alternative is, AND when all parts are, `X WITH exception` when X is (an exception only adds
  permissions). The licence recorded is the first statement in that order, SPDX-normalised.
- The allow-list (`PERMISSIVE`) is small and explicit: MIT and its variants, the BSDs, Apache, ISC, PSF/Python,
  Zlib, Boost, HPND, Unlicense, CC0. "LicenseRef-BSD" / "LicenseRef-Apache" stand for the unversioned classifiers
  and names ("BSD License", "Apache Software License"): every version of those is permissive. Left out on purpose:
  the GPL family, and also MPL-2.0 and other weak copyleft (EPL, CDDL, EUPL): their files must stay under their
  licence when redistributed, which a corpus (and what is trained on it) cannot promise. No statement, or only
  free text we cannot read, is excluded too.
- Files: the `*.py` files RECORD lists (`Distribution.files`), minus those skipped with a reason
  (`FileSkip`): a path that is absolute, has a `..` part or resolves (through any symlink) outside the
  site-packages folder is never opened; vendored copies of other projects (a `_vendor` / `vendor` / `_vendored` /
  `vendored` folder: their licence is not the distribution's, and they duplicate other distributions); generated
  code (protobuf's `*_pb2.py` / `*_pb2_grpc.py` serialised descriptors, editable-install finders); files over
  `max_file_bytes` (generated tables, not code people write); files RECORD lists but the disk lacks; files an
  earlier distribution already listed.
- Nothing here reads a file's contents: the corpus does (server/train/corpus.py), which also skips empty and non-UTF-8
  files. The same folders give the same `PackageSelection`, in the same order.

    selection = select_packages()                        # the running interpreter's site-packages
    for package in selection.included: print(package.name, package.version, package.licence, len(package.files))
    for package in selection.excluded: print(package.name, package.exclusion.value, package.detail)

Tested by tests/server/train/test_package_sources.py (`python -m pytest tests/server/train/test_package_sources.py -q`).
"""

from __future__ import annotations

import enum
import importlib.metadata
import re
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from email.message import Message
from pathlib import Path, PurePosixPath

DEFAULT_MAX_FILE_BYTES = 1_000_000  # larger "source" files are generated tables (unicode data, parser tables)

# Canonical SPDX spelling of every identifier we allow; lookups are case-insensitive.
PERMISSIVE = frozenset(
    {
        "MIT",
        "MIT-0",
        "MIT-CMU",
        "BSD-2-Clause",
        "BSD-3-Clause",
        "0BSD",
        "Apache-2.0",
        "ISC",
        "PSF-2.0",
        "Python-2.0",
        "CNRI-Python",
        "Zlib",
        "BSL-1.0",
        "HPND",
        "Unlicense",
        "CC0-1.0",
        "LicenseRef-BSD",
        "LicenseRef-Apache",
    }
)
# Copyleft SPDX identifiers: a License field made of them is read as a statement (a refusal) and named copyleft.
_COPYLEFT = re.compile(r"^(A?GPL|LGPL|MPL|EPL|EUPL|CDDL|OSL|CECILL|CC-BY-SA)-", re.IGNORECASE)
_CANONICAL = {name.lower(): name for name in PERMISSIVE}

# Whole-field spellings seen in License fields (lower case, whitespace collapsed, trailing "." dropped).
_LICENCE_NAMES = {
    **{k: "MIT" for k in ("mit", "mit license", "mit licence", "the mit license", "mit license (mit)", "expat")},
    **{k: "LicenseRef-BSD" for k in ("bsd", "bsd license", "bsd licence", "bsd-like")},
    **{
        k: "BSD-3-Clause"
        for k in (
            "bsd 3-clause",
            "bsd 3-clause license",
            "3-clause bsd",
            "3-clause bsd license",
            "bsd-3",
            "new bsd",
            "new bsd license",
            "modified bsd",
            "modified bsd license",
            "revised bsd license",
        )
    },
    **{
        k: "BSD-2-Clause"
        for k in (
            "bsd 2-clause",
            "bsd 2-clause license",
            "2-clause bsd",
            "2-clause bsd license",
            "simplified bsd",
            "simplified bsd license",
            "freebsd",
        )
    },
    **{k: "LicenseRef-Apache" for k in ("apache", "apache license", "apache software license")},
    **{
        k: "Apache-2.0"
        for k in (
            "apache 2",
            "apache 2.0",
            "apache-2",
            "apache 2.0 license",
            "apache license 2.0",
            "apache license, version 2.0",
            "apache license version 2.0",
            "apache software license 2.0",
            "apache software license, version 2.0",
            "apache v2",
            "asl 2",
            "asl 2.0",
        )
    },
    **{k: "ISC" for k in ("isc", "isc license", "isc license (iscl)", "iscl")},
    **{k: "PSF-2.0" for k in ("psf", "psf license", "psfl", "python software foundation license")},
    **{k: "Zlib" for k in ("zlib", "zlib license", "zlib/libpng", "zlib/libpng license")},
    **{k: "Unlicense" for k in ("unlicense", "the unlicense", "the unlicense (unlicense)")},
}
# The "License :: OSI Approved :: X" classifiers, by X.
_CLASSIFIERS = {
    "MIT License": "MIT",
    "MIT No Attribution License (MIT-0)": "MIT-0",
    "BSD License": "LicenseRef-BSD",
    "Apache Software License": "LicenseRef-Apache",
    "ISC License (ISCL)": "ISC",
    "Python Software Foundation License": "PSF-2.0",
    "zlib/libpng License": "Zlib",
    "The Unlicense (Unlicense)": "Unlicense",
    "Boost Software License 1.0 (BSL-1.0)": "BSL-1.0",
    "Historical Permission Notice and Disclaimer (HPND)": "HPND",
}
# A one-line License field we cannot parse still counts as a (refusing) statement when it names one of these.
_COPYLEFT_TEXT = re.compile(r"\b(A|L)?GPL|General Public License|Mozilla Public License", re.IGNORECASE)
_VENDORED_DIRS = frozenset({"_vendor", "vendor", "_vendored", "vendored"})
_GENERATED = re.compile(r"(_pb2|_pb2_grpc)\.py$|^__editable__")


class Exclusion(enum.Enum):
    """Why a distribution gives the corpus no files."""

    NO_LICENCE = "no licence statement in the metadata"
    NOT_PERMISSIVE = "licence not on the permissive allow-list"
    NO_RECORD = "no RECORD: its files are unknown"
    NO_SOURCES = "no usable .py files"
    SHADOWED = "shadowed by an earlier distribution of that name"
    BAD_METADATA = "no Name or Version in the metadata"


class FileSkip(enum.Enum):
    """Why a `*.py` file RECORD lists is left out."""

    OUTSIDE_ROOT = "outside the site-packages folder"
    VENDORED = "vendored copy of another project"
    GENERATED = "generated code"
    TOO_LARGE = "over the size cap"
    MISSING = "listed in RECORD, not on disk"
    CLAIMED = "already listed by another distribution"


@dataclass(frozen=True)
class LicenceVerdict:
    expression: str | None  # SPDX-normalised licence of the first statement; None when there is none
    source: str  # "License-Expression", "License", "classifiers" or "" (no statement)
    permissive: bool  # every statement is permissive (and there is one)
    detail: str  # for a refusal: which statement refuses, in one line; "" when permissive


@dataclass(frozen=True)
class PackageFile:
    name: str  # POSIX path relative to the site-packages folder, as RECORD lists it
    path: Path  # resolved absolute path, inside that folder
    bytes: int


@dataclass(frozen=True)
class SkippedPackageFile:
    name: str  # as RECORD lists it
    reason: FileSkip


@dataclass(frozen=True)
class Package:
    name: str  # normalised (PEP 503)
    version: str
    root: Path  # the site-packages folder it was found in
    licence: LicenceVerdict
    files: tuple[PackageFile, ...]  # sorted by name; empty when excluded
    skipped: tuple[SkippedPackageFile, ...]
    exclusion: Exclusion | None  # None: included
    detail: str = ""  # one line more about the exclusion

    @property
    def bytes(self) -> int:
        return sum(f.bytes for f in self.files)


@dataclass(frozen=True)
class PackageSelection:
    included: tuple[Package, ...]  # by name
    excluded: tuple[Package, ...]  # by name


def normalise_name(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def default_site_paths() -> list[Path]:
    """The running interpreter's site-packages folders (a venv's own, or the user's and the system's): the
    site-packages / dist-packages entries of sys.path, in its order, which is the order imports search them."""
    paths = [Path(p) for p in dict.fromkeys(sys.path) if Path(p).name in ("site-packages", "dist-packages")]
    return [p for p in paths if p.is_dir()]


# ---- licences ---------------------------------------------------------------------------------------------------

_TOKEN = re.compile(r"\(|\)|[^\s()]+")


class _Unparsable(Exception):
    pass


def _canonical_id(token: str, strict: bool) -> str:
    """An SPDX identifier's canonical spelling; `strict` (License-Expression) takes any well-formed one."""
    base = token[:-1] if token.endswith("+") else token
    known = _CANONICAL.get(base.lower()) or _LICENCE_NAMES.get(base.lower())
    if known is not None:
        return known
    if (strict or _COPYLEFT.match(base)) and re.fullmatch(r"[A-Za-z0-9.+:-]+", base):
        return token
    raise _Unparsable(token)


def _parse_spdx(text: str, strict: bool) -> tuple:
    """An SPDX expression as a tree: ("id", X) | ("with", tree, exception) | ("and"|"or", [trees])."""
    tokens = _TOKEN.findall(text)
    pos = 0

    def peek() -> str | None:
        return tokens[pos] if pos < len(tokens) else None

    def take() -> str:
        nonlocal pos
        if pos >= len(tokens):
            raise _Unparsable("unexpected end")
        pos += 1
        return tokens[pos - 1]

    def operator(word: str) -> bool:
        token = peek()
        return token is not None and token in (word, word.lower())

    def atom() -> tuple:
        token = take()
        if token == "(":
            tree = expression()
            if take() != ")":
                raise _Unparsable("unbalanced parenthesis")
        elif token in (")", "AND", "OR", "WITH", "and", "or", "with"):
            raise _Unparsable(token)
        else:
            tree = ("id", _canonical_id(token, strict))
        if operator("WITH"):
            take()
            tree = ("with", tree, take())
        return tree

    def chain(word: str, part) -> tuple:
        parts = [part()]
        while operator(word):
            take()
            parts.append(part())
        return parts[0] if len(parts) == 1 else (word.lower(), parts)

    def expression() -> tuple:
        return chain("OR", lambda: chain("AND", atom))

    tree = expression()
    if pos != len(tokens):
        raise _Unparsable(tokens[pos])
    return tree


def _render(tree: tuple, parent: str = "") -> str:
    kind = tree[0]
    if kind == "id":
        return tree[1]
    if kind == "with":
        return f"{_render(tree[1], 'with')} WITH {tree[2]}"
    text = f" {kind.upper()} ".join(_render(t, kind) for t in tree[1])
    return f"({text})" if parent in ("and", "with") or (parent == "or" and kind == "or") else text


def _refusal(tree: tuple) -> str | None:
    """None when the expression is permissive, else the identifier that makes it not."""
    kind = tree[0]
    if kind == "id":
        return None if tree[1].removesuffix("+") in PERMISSIVE else tree[1]
    if kind == "with":
        return _refusal(tree[1])  # an exception only grants more
    refusals = [_refusal(t) for t in tree[1]]
    if kind == "or":
        return None if None in refusals else refusals[0]
    return next((r for r in refusals if r is not None), None)


def _statements(metadata: Message) -> list[tuple[str, str, str | None]]:
    """(source, expression, refusing identifier or None) for every licence statement we can read."""
    found = []
    expression = (metadata.get("License-Expression") or "").strip()
    if expression:
        try:
            tree = _parse_spdx(expression, strict=True)
            found.append(("License-Expression", _render(tree), _refusal(tree)))
        except _Unparsable:
            found.append(("License-Expression", expression, expression))  # PEP 639 says it must parse
    raw = (metadata.get("License") or "").strip()
    text = " ".join(raw.split()).rstrip(".")
    if text and "\n" not in raw:  # several lines are a licence's body, which names no licence we could check
        named = _LICENCE_NAMES.get(text.lower())
        try:
            tree = ("id", named) if named else _parse_spdx(text, strict=False)
            found.append(("License", _render(tree), _refusal(tree)))
        except _Unparsable:
            if _COPYLEFT_TEXT.search(text):
                found.append(("License", text, text))
    ids = []
    for classifier in metadata.get_all("Classifier") or ():
        parts = [p.strip() for p in classifier.split("::")]
        if parts[:2] == ["License", "OSI Approved"] and len(parts) > 2:
            ids.append(_CLASSIFIERS.get(parts[2], parts[2]))
        elif parts == ["License", "Other/Proprietary License"]:
            ids.append("Other/Proprietary License")
    if ids:
        refusing = [i for i in ids if i not in PERMISSIVE]
        found.append(("classifiers", " AND ".join(dict.fromkeys(ids)), refusing[0] if refusing else None))
    return found


def licence_of(metadata: Message) -> LicenceVerdict:
    """The verdict on one distribution's metadata (see the module docstring for the rule)."""
    statements = _statements(metadata)
    if not statements:
        return LicenceVerdict(None, "", False, "")
    source, expression, _ = statements[0]
    for where, _, refusing in statements:
        if refusing is not None:
            copyleft = _COPYLEFT.match(refusing) or _COPYLEFT_TEXT.search(refusing)
            why = "is copyleft" if copyleft else "is not on the allow-list"
            return LicenceVerdict(expression, source, False, f"{where}: {refusing} {why}")
    return LicenceVerdict(expression, source, True, "")


# ---- files ------------------------------------------------------------------------------------------------------


def _python_files(
    entries: Iterable[PurePosixPath], root: Path, max_file_bytes: int, claimed: set[Path]
) -> tuple[list[PackageFile], list[SkippedPackageFile]]:
    files, skipped = [], []
    real_root = root.resolve()
    for name in sorted({PurePosixPath(str(e)).as_posix() for e in entries if str(e).endswith(".py")}):
        relative = PurePosixPath(name)
        reason = None
        if relative.is_absolute() or ".." in relative.parts or re.match(r"^[A-Za-z]:", name):
            reason = FileSkip.OUTSIDE_ROOT  # decided on the text alone: never touch such a path
        elif _VENDORED_DIRS.intersection(relative.parts[:-1]):
            reason = FileSkip.VENDORED
        elif _GENERATED.search(relative.name):
            reason = FileSkip.GENERATED
        else:
            try:
                path = (root / relative).resolve()  # follows every symlink on the way
            except (OSError, RuntimeError):  # a symlink loop
                path = None
            if path is None:
                reason = FileSkip.MISSING
            elif not path.is_relative_to(real_root):
                reason = FileSkip.OUTSIDE_ROOT
            elif not path.is_file():
                reason = FileSkip.MISSING
            elif path in claimed:
                reason = FileSkip.CLAIMED
            elif (size := path.stat().st_size) > max_file_bytes:
                reason = FileSkip.TOO_LARGE
            else:
                claimed.add(path)
                files.append(PackageFile(name, path, size))
        if reason is not None:
            skipped.append(SkippedPackageFile(name, reason))
    return files, skipped


def select_packages(
    site_paths: Sequence[str | Path] | None = None, *, max_file_bytes: int = DEFAULT_MAX_FILE_BYTES
) -> PackageSelection:
    """Every distribution in `site_paths` (default: `default_site_paths()`), included or excluded with a reason."""
    if max_file_bytes <= 0:
        raise ValueError(f"max_file_bytes must be > 0, got {max_file_bytes}")
    roots = [Path(p) for p in (default_site_paths() if site_paths is None else site_paths)]
    for root in roots:
        if not root.is_dir():
            raise FileNotFoundError(f"{root} is not a directory (--site-packages takes a site-packages folder)")

    found: list[tuple[str, str, int, Path, importlib.metadata.Distribution]] = []
    excluded: list[Package] = []
    for order, root in enumerate(roots):
        for dist in importlib.metadata.distributions(path=[str(root)]):
            name, version = dist.metadata.get("Name"), dist.metadata.get("Version")
            if not name or not version:
                unnamed = normalise_name(name) if name else "(no name)"
                no_verdict = LicenceVerdict(None, "", False, "")
                excluded.append(Package(unnamed, version or "", root, no_verdict, (), (), Exclusion.BAD_METADATA))
                continue
            found.append((normalise_name(name), version, order, root, dist))
    # Within one folder two dist-infos of one name (a stale leftover) are ordered by version, so the choice is
    # deterministic; across folders the first folder wins, as it does on sys.path.
    found.sort(key=lambda t: (t[0], t[2], t[1]))

    included: list[Package] = []
    claimed: set[Path] = set()
    seen: set[str] = set()
    for name, version, _, root, dist in found:
        verdict = licence_of(dist.metadata)
        if name in seen:
            excluded.append(Package(name, version, root, verdict, (), (), Exclusion.SHADOWED))
            continue
        seen.add(name)
        if not verdict.permissive:
            exclusion = Exclusion.NOT_PERMISSIVE if verdict.expression else Exclusion.NO_LICENCE
            excluded.append(Package(name, version, root, verdict, (), (), exclusion, verdict.detail))
            continue
        entries = dist.files
        if entries is None:
            excluded.append(Package(name, version, root, verdict, (), (), Exclusion.NO_RECORD))
            continue
        files, skipped = _python_files(entries, root, max_file_bytes, claimed)
        package = Package(name, version, root, verdict, tuple(files), tuple(skipped), None)
        if not files:
            excluded.append(Package(name, version, root, verdict, (), tuple(skipped), Exclusion.NO_SOURCES))
        else:
            included.append(package)
    excluded.sort(key=lambda p: (p.name, p.version, str(p.root)))
    return PackageSelection(tuple(included), tuple(excluded))
