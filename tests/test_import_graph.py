"""The package's import graph, read from the source: no import circles, serving apart from training, and imports
flowing the one way docs/ARCHITECTURE.md section 1 draws.

Every module of every folder pyproject.toml packages is parsed with ast (nothing is imported), and each `import` /
`from ... import` of a tether module is an edge, wherever it is written: at the top, inside a function, or under
`if TYPE_CHECKING:`. A circle is two or more modules each reachable from the other (a strongly connected component
of that graph). An import moved into a function only postpones the circle to run time, and one under TYPE_CHECKING
is still a circle for whoever reads the code or checks its types: neither is a way out of this test. The way out is
to move what both need below both (a record into the module it is a contract of, a factory above the kinds it
builds) or to name a Protocol where a module only needs an object's shape.

    python -m pytest tests/test_import_graph.py -q
"""

from __future__ import annotations

import ast
import tomllib
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Circles whose files belong to work in progress elsewhere, each removed from here by the change that removes it
# (test_the_pending_circles_are_still_there fails once one is gone, so the list cannot go stale).
KNOWN_PENDING: set[frozenset[str]] = set()

# Which top-level packages each may import (section 1): kernels -> shared; server -> kernels, shared, proto;
# client -> shared, proto; netsim stands alone.
MAY_IMPORT = {
    "shared": {"shared"},
    "kernels": {"kernels", "shared"},
    "server": {"server", "kernels", "shared", "v1"},
    "client": {"client", "shared", "v1"},
    "netsim": {"netsim"},
    "v1": {"v1"},
}
TRAINING = "tether.server.train"
# The one serving module that names training: `tether-server`'s command table lists train-target and the rest.
DISPATCHES_TRAINING = {"tether.server.cli"}


def package_modules() -> dict[str, Path]:
    """Every module of the distribution, by its import name, from pyproject.toml's package-dir."""
    package_dir = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    modules = {}
    for package, folder in package_dir.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([package, *parts])] = path
    return modules


def imported(
    node: ast.Import | ast.ImportFrom, module: str, is_package: bool, modules: dict[str, Path]
) -> Iterator[str]:
    """The tether modules one import statement runs: `from a.b import c` is a.b.c where that is a module, else a.b."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            name = alias.name
            while name and name not in modules:  # `import tether.server.cli` names the module, never an attribute
                name = name.rpartition(".")[0]
            if name:
                yield name
        return
    base = node.module or ""
    if node.level:  # relative: from the module's package, one level up per dot past the first
        package = module if is_package else module.rpartition(".")[0]
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        base = f"{package}.{base}" if base else package
    for alias in node.names:
        if f"{base}.{alias.name}" in modules:
            yield f"{base}.{alias.name}"
        elif base in modules:
            yield base


def module_imports(source: str, module: str, is_package: bool, modules: dict[str, Path]) -> dict[str, list[int]]:
    """{module it imports: [line, ...]} of one module's source, every import statement in it counted."""
    found: dict[str, list[int]] = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for target in imported(node, module, is_package, modules):
                if target != module:
                    found.setdefault(target, []).append(node.lineno)
    return found


def import_graph() -> dict[str, dict[str, list[int]]]:
    """{module: {module it imports: [line, ...]}} over the whole distribution."""
    modules = package_modules()
    return {m: module_imports(path.read_text(), m, path.name == "__init__.py", modules) for m, path in modules.items()}


def circles(graph: dict[str, dict[str, list[int]]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(graph[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            step = next(successors, None)
            if step is not None:
                if step not in index:
                    index[step] = low[step] = len(index)
                    stack.append(step)
                    on_stack.add(step)
                    work.append((step, iter(graph[step])))
                elif step in on_stack:
                    low[node] = min(low[node], index[step])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(frozenset(component))
    return found


def described(component: frozenset[str], graph: dict[str, dict[str, list[int]]]) -> str:
    edges = [
        f"  {a} -> {b} (line {', '.join(map(str, sorted(set(graph[a][b]))))})"
        for a in sorted(component)
        for b in sorted(graph[a])
        if b in component
    ]
    return "\n".join(edges)


SAMPLE = """
from typing import TYPE_CHECKING
import tether.x.top
from tether.x import pkg, attribute
from .sibling import name
if TYPE_CHECKING:
    from tether.x.typed import Name
def f():
    from tether.x.late import g
"""


def test_the_graph_reads_every_import():
    """The reader sees what it must: every package's modules, and an import wherever it is written."""
    graph = import_graph()
    assert {m.split(".")[1] for m in graph} == set(MAY_IMPORT)
    assert "tether.server.train.target" in graph and "tether.kernels.moda.naive" in graph
    names = ["x", "x.top", "x.pkg", "x.sibling", "x.typed", "x.late", "x.me"]
    modules = {f"tether.{n}": Path() for n in names}
    found = module_imports(SAMPLE, "tether.x.me", False, modules)
    assert found == {
        "tether.x.top": [3],
        "tether.x.pkg": [4],
        "tether.x": [4],
        "tether.x.sibling": [5],
        "tether.x.typed": [7],
        "tether.x.late": [9],
    }
    assert circles({"a": {"b": []}, "b": {"c": []}, "c": {"a": []}, "d": {"a": []}}) == [frozenset("abc")]


def test_no_import_circles():
    graph = import_graph()
    new = [c for c in circles(graph) if c not in KNOWN_PENDING]
    assert not new, "import circles:\n" + "\n\n".join(described(c, graph) for c in new)


def test_the_pending_circles_are_still_there():
    """A circle listed in KNOWN_PENDING that is gone comes off the list (and this test fails until it does)."""
    gone = KNOWN_PENDING - set(circles(import_graph()))
    assert not gone, f"no longer circles, take them off KNOWN_PENDING: {sorted(map(sorted, gone))}"


def test_imports_flow_one_way():
    graph = import_graph()
    wrong = [
        f"{a} -> {b}"
        for a, targets in graph.items()
        for b in targets
        if b.split(".")[1] not in MAY_IMPORT[a.split(".")[1]]
    ]
    assert not wrong, "\n".join(wrong)


def test_serving_never_imports_training():
    """Nothing that serves reaches tether.server.train, directly or through another module; the training code may
    use serving's pieces (the in-process engine, the default model folders)."""
    graph = import_graph()
    in_training = {m for m in graph if m == TRAINING or m.startswith(TRAINING + ".")}
    assert {"tether.server.train.corpus", "tether.server.train.drafter"} <= in_training
    for module in graph:
        if module in in_training or module in DISPATCHES_TRAINING:
            continue
        seen, todo = set(), [module]
        while todo:
            for target in graph[todo.pop()]:
                if target not in seen and target not in DISPATCHES_TRAINING:
                    seen.add(target)
                    todo.append(target)
        assert not seen & in_training, f"{module} imports training: {sorted(seen & in_training)}"
