"""The package's house rules (issue #46's targets and common habits), read from the source: each one a check that
fails when the code breaks it, beside a sample showing that the check can fail.

- No package file over MAX_LINES lines (one concept per file, split along a seam; `wc -l`'s count).
- At most MAX_FMT_PRAGMAS `# fmt: skip` / `# fmt: off` in the package: ruff format's rule wins; a pragma is for a
  real table.
- Every module opens with a docstring (purpose, contract, how to run), and no TODO / FIXME / XXX without an issue
  number.
- Configuration is frozen: every class named `...Config` is a `@dataclass(frozen=True)`.
- TETHER_* environment variables are read in tether.shared.env alone (netsim's command line keeps its own copy to
  stay standalone).
- README.md stays a map: at most README_WORDS words, with the headline table; BENCHMARKS.md holds current figures
  only, at most BENCHMARKS_LINES lines.

The package is what pyproject.toml's package-dir lists (tests/test_import_graph.py reads it the same way), less the
generated code ruff leaves alone (`extend-exclude`). Import circles and the imports' direction are
tests/test_import_graph.py's; repetition is the `duplicates` tool's (common.md: run it over a change).

    python -m pytest tests/test_house.py -q
"""

from __future__ import annotations

import ast
import fnmatch
import io
import re
import tokenize
import tomllib
from pathlib import Path

from test_import_graph import ROOT, package_modules

MAX_LINES = 600
MAX_FMT_PRAGMAS = 20
README_WORDS = 1500
BENCHMARKS_LINES = 600
# The headline table's rows (issue #46): tokens/s by RTT against streaming, users per GPU, tokens written offline,
# bytes per token.
HEADLINE_ROWS = ("tokens/s", "users per GPU", "tokens written", "bytes")

# Files over MAX_LINES whose split is work in progress elsewhere, each removed from here by the change that splits it
# (test_the_pending_long_files_are_still_long fails once one is short, so the list cannot go stale).
LONG_PENDING: set[str] = set()

# The modules that may read TETHER_* variables.
READS_TETHER_ENV = {"tether.shared.env", "tether.netsim.cli"}


def package_files() -> dict[str, Path]:
    """{module: path} of the package's hand-written modules (generated code, as ruff's extend-exclude names it,
    left out)."""
    generated = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["ruff"]["extend-exclude"]
    return {
        module: path
        for module, path in package_modules().items()
        if not any(fnmatch.fnmatch(path.relative_to(ROOT).as_posix(), pattern) for pattern in generated)
    }


def relative(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def line_count(text: str) -> int:
    """Lines as `wc -l` counts them: newline characters."""
    return text.count("\n")


def fmt_pragmas(source: str) -> list[int]:
    """Lines holding a `# fmt: skip` or `# fmt: off` comment (comments only: the words in a string do not count)."""
    return [
        tok.start[0]
        for tok in tokenize.generate_tokens(io.StringIO(source).readline)
        if tok.type == tokenize.COMMENT and re.match(r"#\s*fmt:\s*(skip|off)\b", tok.string)
    ]


def loose_todos(source: str) -> list[int]:
    """Lines with a TODO / FIXME / XXX that names no issue (#N)."""
    return [
        n
        for n, line in enumerate(source.splitlines(), 1)
        if re.search(r"\b(TODO|FIXME|XXX)\b", line) and not re.search(r"#\d+", line)
    ]


def thawed_configs(tree: ast.Module) -> list[str]:
    """Classes named ...Config that are not @dataclass(frozen=True)."""

    def frozen(decorator: ast.expr) -> bool:
        if not isinstance(decorator, ast.Call):
            return False
        name = decorator.func.attr if isinstance(decorator.func, ast.Attribute) else getattr(decorator.func, "id", "")
        return name == "dataclass" and any(
            k.arg == "frozen" and isinstance(k.value, ast.Constant) and k.value.value is True
            for k in decorator.keywords
        )

    return [
        node.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef) and node.name.endswith("Config") and not any(map(frozen, node.decorator_list))
    ]


def tether_env_reads(tree: ast.Module) -> list[int]:
    """Lines that read a TETHER_* variable: os.environ[...], os.environ.get(...) or os.getenv(...) of a literal name."""

    def environ(node: ast.expr) -> bool:
        return isinstance(node, ast.Attribute) and node.attr == "environ"

    found = []
    for node in ast.walk(tree):
        names: list[ast.expr] = []
        if isinstance(node, ast.Subscript) and environ(node.value):
            names = [node.slice]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if (node.func.attr == "get" and environ(node.func.value)) or node.func.attr == "getenv":
                names = node.args[:1]
        if any(isinstance(n, ast.Constant) and str(n.value).startswith("TETHER_") for n in names):
            found.append(node.lineno)
    return found


SAMPLE = """
import os
from dataclasses import dataclass

X = "# fmt: skip is only words here"
TABLE = [1,  2]  # fmt: skip
# fmt: off
# TODO: later
# TODO(#46): split this


@dataclass
class LooseConfig:
    a: int = 0


@dataclass(frozen=True)
class TightConfig:
    a: int = 0


PORT = os.environ.get("TETHER_PORT") or os.getenv("TETHER_HOST") or os.environ["TETHER_KEY"]
HOME = os.environ.get("HOME")
"""


def test_the_checks_can_fail():
    """Each check finds what it must in a sample, and nothing more."""
    assert line_count("a\nb\n") == 2 and line_count("a\nb") == 1
    assert fmt_pragmas(SAMPLE) == [6, 7]
    assert loose_todos(SAMPLE) == [8]
    tree = ast.parse(SAMPLE)
    assert thawed_configs(tree) == ["LooseConfig"]
    assert tether_env_reads(tree) == [22, 22, 22]
    assert not ast.get_docstring(tree)


def test_the_package_is_read_whole():
    files = package_files()
    assert {m.split(".")[1] for m in files} == {"shared", "server", "client", "kernels", "netsim", "v1"}
    assert "tether.server.kv_pool" in files and "tether.server.train.target" in files
    assert not any(path.name.startswith("tether_pb2") for path in files.values())  # generated


def test_no_package_file_over_the_limit():
    long = {
        relative(path): n
        for path in package_files().values()
        if (n := line_count(path.read_text())) > MAX_LINES and relative(path) not in LONG_PENDING
    }
    assert not long, f"files over {MAX_LINES} lines (split each along a seam, one concept per file): {long}"


def test_the_pending_long_files_are_still_long():
    """A file listed in LONG_PENDING that is no longer over the limit comes off the list (this fails until it does)."""
    short = sorted(name for name in LONG_PENDING if line_count((ROOT / name).read_text()) <= MAX_LINES)
    assert not short, f"no longer over {MAX_LINES} lines, take them off LONG_PENDING: {short}"


def test_formatter_pragmas_are_few():
    found = {relative(path): lines for path in package_files().values() if (lines := fmt_pragmas(path.read_text()))}
    total = sum(map(len, found.values()))
    assert total <= MAX_FMT_PRAGMAS, f"{total} `# fmt: skip` / `# fmt: off` in the package (at most {MAX_FMT_PRAGMAS})"


def test_every_module_opens_with_a_docstring():
    bare = [relative(path) for path in package_files().values() if not ast.get_docstring(ast.parse(path.read_text()))]
    assert not bare, f"modules without a docstring: {bare}"


def test_no_todo_without_an_issue():
    loose = {relative(path): lines for path in package_files().values() if (lines := loose_todos(path.read_text()))}
    assert not loose, f"TODO / FIXME / XXX naming no issue: {loose}"


def test_configuration_is_frozen():
    thawed = {
        relative(path): names
        for path in package_files().values()
        if (names := thawed_configs(ast.parse(path.read_text())))
    }
    assert not thawed, f"...Config classes that are not @dataclass(frozen=True): {thawed}"


def test_tether_variables_are_read_in_one_place():
    reads = {
        module: lines
        for module, path in package_files().items()
        if module not in READS_TETHER_ENV and (lines := tether_env_reads(ast.parse(path.read_text())))
    }
    assert not reads, f"TETHER_* read outside {sorted(READS_TETHER_ENV)}: {reads}"


def test_readme_is_a_map_with_the_headline_table():
    text = (ROOT / "README.md").read_text()
    words = len(text.split())
    assert words <= README_WORDS, f"README.md has {words} words (at most {README_WORDS})"
    rows = [line for line in text.splitlines() if line.startswith("|")]
    missing = [name for name in HEADLINE_ROWS if not any(line.startswith(f"| {name}") for line in rows)]
    assert not missing, f"README.md's headline table has no row for {missing}"


def test_benchmarks_hold_current_figures_only():
    lines = line_count((ROOT / "BENCHMARKS.md").read_text())
    assert lines <= BENCHMARKS_LINES, f"BENCHMARKS.md has {lines} lines (at most {BENCHMARKS_LINES})"
