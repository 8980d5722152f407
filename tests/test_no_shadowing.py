"""Nothing of this repository shadows a third-party module, however the project's commands start Python.

The top-level folders (kernels/, server/, shared/, ...) keep the names the project's layout requires, and Hugging
Face publishes a package named `kernels` that transformers imports. Python puts the current directory first on
sys.path for `python -m` and `python -c`, and a script's own folder for `python bench/x.py`; from the repository root
our kernels/ would then win over the installed one. So `make` exports PYTHONSAFEPATH, tests/conftest.py takes the root
off sys.path, and no bench program is named like an importable module. A throwaway package named `kernels`, really
installed (a wheel, by pip), and a library importing it prove each of those.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROBE = "import probelib; print(probelib.WHO)"  # probelib does `import kernels` and reports whose it got


def _wheel(out: Path) -> Path:
    """A minimal wheel holding the packages `kernels` (ours to recognise) and `probelib` (a library importing it)."""
    files = {
        "kernels/__init__.py": "WHO = 'third-party kernels'\n",
        "probelib/__init__.py": "import kernels\n\nWHO = kernels.WHO\n",
        "probelib/__main__.py": PROBE + "\n",
        "throwaway_kernels-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: throwaway-kernels\nVersion: 1.0\n",
        "throwaway_kernels-1.0.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\n"
        "Tag: py3-none-any\n",
    }
    record = []
    for name, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(text.encode())}")
    record.append("throwaway_kernels-1.0.dist-info/RECORD,,")
    path = out / "throwaway_kernels-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as whl:
        for name, text in files.items():
            whl.writestr(name, text)
        whl.writestr("throwaway_kernels-1.0.dist-info/RECORD", "\n".join(record) + "\n")
    return path


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """A site directory into which pip installed the throwaway `kernels` (ahead of the venv's own on PYTHONPATH)."""
    tmp = tmp_path_factory.mktemp("site")
    target = tmp / "site-packages"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(target),
                    str(_wheel(tmp))], check=True)  # fmt: skip
    return target


def _run(args: list[str], site: Path, *, safe_path: bool) -> str:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"} | {"PYTHONPATH": str(site)}
    if safe_path:
        env["PYTHONSAFEPATH"] = "1"
    done = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    return done.stdout.strip() or done.stderr.strip().splitlines()[-1]


def test_the_root_would_shadow_without_the_guard(site):
    """The hazard is real (this is what a fresh clone hit): from the root, `python -c` finds our kernels/ first."""
    out = _run([sys.executable, "-c", PROBE], site, safe_path=False)
    assert out != "third-party kernels"


@pytest.mark.parametrize("how", ["-c", "-m"])
def test_pythons_started_like_make_get_the_installed_package(site, how):
    """`make test` / `make demo` and every child they start run with PYTHONSAFEPATH (the Makefile exports it)."""
    assert "export PYTHONSAFEPATH := 1" in (ROOT / "Makefile").read_text()
    args = [sys.executable, "-c", PROBE] if how == "-c" else [sys.executable, "-m", "probelib"]
    assert _run(args, site, safe_path=True) == "third-party kernels"


def test_this_test_process_does_not_see_the_root():
    """tests/conftest.py took the root off sys.path, whoever started pytest, and passes PYTHONSAFEPATH on."""
    assert not [p for p in sys.path if p in ("", ".") or Path(p).resolve() == ROOT]
    assert os.environ.get("PYTHONSAFEPATH") == "1"
    spec = importlib.util.find_spec("kernels")
    assert spec is None or Path(spec.origin or "").resolve() != ROOT / "kernels" / "__init__.py"


def test_bench_programs_are_named_like_no_importable_module():
    """`python bench/x.py` puts bench/ first: a bench named like a stdlib or installed module would shadow it."""
    names = sorted(path.stem for path in (ROOT / "bench").glob("*.py"))
    assert "moda_kernels" in names  # the one that did shadow, renamed
    # Asked in a Python of its own: this one has tests/ on sys.path, whose folders look like namespace packages.
    check = (
        "import importlib.util, sys; "
        f"print([n for n in {names!r} if n in sys.stdlib_module_names or importlib.util.find_spec(n)])"
    )
    out = subprocess.run([sys.executable, "-c", check], cwd=ROOT / "deploy", capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", f"rename these bench programs: {out.stdout.strip()}"
