"""Installed packages as corpus sources: licence verdicts, exclusions with reasons, paths that stay inside the
site-packages folder, deterministic order, and the corpus split by package.

Everything runs on fake site-packages folders built in tmp_path (dist-info folders with METADATA and RECORD), with
a few stdlib files and a 300-token vocabulary: a few seconds.
Run: `python -m pytest tests/server/train/test_package_sources.py -q`.
"""

from __future__ import annotations

import json
import os
from email.message import Message
from pathlib import Path

import numpy as np
import pytest

from tether.server.cli import main
from tether.server.train.corpus import CorpusManifest, build_corpus, load_tokens, split_of
from tether.server.train.package_sources import Exclusion, FileSkip, licence_of, select_packages
from tether.shared import env
from tether.shared.tokenizer import Tokenizer

SECRET = b"SECRET = 'outside the site-packages folder'\n"


def metadata(*headers: tuple[str, str]) -> Message:
    message = Message()
    for key, value in headers:
        message[key] = value
    return message


def install(site: Path, name: str, version: str, headers: list[tuple[str, str]], files: dict[str, bytes],
            record_only: tuple[str, ...] = (), record: bool = True) -> None:  # fmt: skip
    """A distribution as pip leaves it: its files under `site`, a dist-info with METADATA and (unless not
    `record`) a RECORD listing the files and `record_only`, entries that name nothing written here."""
    info = site / f"{name}-{version}.dist-info"
    info.mkdir(parents=True)
    lines = [f"Metadata-Version: 2.4\nName: {name}\nVersion: {version}\n"]
    lines += [f"{key}: {value}\n" for key, value in headers]
    (info / "METADATA").write_text("".join(lines))
    for relative, data in files.items():
        (site / relative).parent.mkdir(parents=True, exist_ok=True)
        (site / relative).write_bytes(data)
    if record:
        entries = [*files, *record_only, f"{info.name}/METADATA", f"{info.name}/RECORD"]
        (info / "RECORD").write_text("".join(f"{e},,\n" for e in entries))


@pytest.fixture
def site(tmp_path: Path) -> Path:
    """alpha (MIT, with every kind of file to skip), beta (GPL), gamma (BSD classifier), Delta_Pkg (no licence),
    epsilon (no RECORD), zeta (Apache 2.0 in License), and a secret file outside the folder."""
    root = tmp_path / "site-packages"
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.py").write_bytes(SECRET)
    (tmp_path / "escape.py").write_bytes(SECRET)  # what RECORD's "../escape.py" names
    alpha = {
        "alpha/__init__.py": b"from alpha.core import run\n",
        "alpha/core.py": b"def run():\n    return 'alpha'\n",
        "alpha/tests/test_core.py": b"def test_run():\n    assert True\n",
        "alpha/_vendor/six.py": b"# a copy of six\n",
        "alpha/api_pb2.py": b"DESCRIPTOR = b'...'\n",
        "alpha/tables.py": b"T = [" + b"0, " * 1000 + b"]\n",
        "alpha/notes.txt": b"not python\n",
    }
    install(root, "alpha", "1.0", [("License-Expression", "MIT")], alpha,
            record_only=("../escape.py", "alpha/missing.py", "alpha/link.py", "/etc/abs.py"))  # fmt: skip
    (root / "alpha" / "link.py").symlink_to(outside / "secret.py")
    install(root, "beta", "2.0", [("License-Expression", "GPL-3.0-or-later")], {"beta.py": b"x = 'beta'\n"})
    bsd = ("Classifier", "License :: OSI Approved :: BSD License")
    install(root, "gamma", "0.3", [bsd], {"gamma/__init__.py": b"y = 'gamma'\n"})
    install(root, "Delta_Pkg", "4", [], {"delta/__init__.py": b"z = 'delta'\n"})
    install(root, "epsilon", "5", [("License", "MIT")], {"epsilon.py": b"e = 1\n"}, record=False)
    install(root, "zeta", "6.0", [("License", "Apache 2.0")], {"zeta/a.py": b"a = 'zeta'\n", "zeta/b.py": b"b = 2\n"})
    return root


@pytest.mark.parametrize(
    ("headers", "permissive", "expression", "source", "detail"),
    [
        ([("License-Expression", "mit")], True, "MIT", "License-Expression", ""),
        ([("License-Expression", "MIT OR GPL-3.0-only")], True, "MIT OR GPL-3.0-only", "License-Expression", ""),
        ([("License-Expression", "Apache-2.0 WITH LLVM-exception AND (BSD-2-Clause OR GPL-2.0)")], True,
         "Apache-2.0 WITH LLVM-exception AND (BSD-2-Clause OR GPL-2.0)", "License-Expression", ""),
        ([("License-Expression", "MIT AND LGPL-2.1-or-later")], False, "MIT AND LGPL-2.1-or-later",
         "License-Expression", "License-Expression: LGPL-2.1-or-later is copyleft"),
        ([("License-Expression", "LicenseRef-Proprietary")], False, "LicenseRef-Proprietary", "License-Expression",
         "License-Expression: LicenseRef-Proprietary is not on the allow-list"),
        ([("License-Expression", "(MIT")], False, "(MIT", "License-Expression", "License-Expression: (MIT is not"),
        ([("License", "Apache Software License 2.0")], True, "Apache-2.0", "License", ""),
        ([("License", "MIT OR Apache-2.0")], True, "MIT OR Apache-2.0", "License", ""),
        ([("License", "MPL-2.0 AND MIT")], False, "MPL-2.0 AND MIT", "License", "License: MPL-2.0 is copyleft"),
        # A licence's body names nothing we can check; the classifier decides.
        ([("License", "Copyright (c) 2015, someone\n        All rights reserved."),
          ("Classifier", "License :: OSI Approved :: BSD License")], True, "LicenseRef-BSD", "classifiers", ""),
        ([("Classifier", "License :: OSI Approved :: MIT License"),
          ("Classifier", "License :: OSI Approved :: GNU General Public License v3 (GPLv3)")], False,
         "MIT AND GNU General Public License v3 (GPLv3)", "classifiers", "GPLv3) is copyleft"),
        # Every statement must be permissive: a License field cannot outvote a GPL classifier.
        ([("License", "MIT"), ("Classifier", "License :: OSI Approved :: GNU General Public License v2 (GPLv2)")],
         False, "MIT", "License", "classifiers: GNU General Public License v2 (GPLv2) is copyleft"),
        ([("License", "GNU GPL v3")], False, "GNU GPL v3", "License", "is copyleft"),
        ([("License", "Free for non-commercial use")], False, None, "", ""),
        ([("Classifier", "License :: OSI Approved")], False, None, "", ""),
        ([], False, None, "", ""),
    ],
)  # fmt: skip
def test_licence_verdicts(headers, permissive, expression, source, detail) -> None:
    verdict = licence_of(metadata(*headers))
    assert (verdict.permissive, verdict.expression, verdict.source) == (permissive, expression, source)
    assert detail in verdict.detail and bool(verdict.detail) == bool(detail)


def test_selection_includes_permissive_packages_and_says_why_not_the_others(site: Path) -> None:
    selection = select_packages([site], max_file_bytes=2000)
    assert [(p.name, p.version, p.licence.expression) for p in selection.included] == [
        ("alpha", "1.0", "MIT"),
        ("gamma", "0.3", "LicenseRef-BSD"),
        ("zeta", "6.0", "Apache-2.0"),
    ]
    assert {p.name: (p.exclusion, p.detail) for p in selection.excluded} == {
        "beta": (Exclusion.NOT_PERMISSIVE, "License-Expression: GPL-3.0-or-later is copyleft"),
        "delta-pkg": (Exclusion.NO_LICENCE, ""),
        "epsilon": (Exclusion.NO_RECORD, ""),
    }
    alpha = selection.included[0]
    assert [f.name for f in alpha.files] == ["alpha/__init__.py", "alpha/core.py", "alpha/tests/test_core.py"]
    assert {s.name: s.reason for s in alpha.skipped} == {
        "../escape.py": FileSkip.OUTSIDE_ROOT,
        "/etc/abs.py": FileSkip.OUTSIDE_ROOT,
        "alpha/link.py": FileSkip.OUTSIDE_ROOT,  # a symlink out of the folder
        "alpha/_vendor/six.py": FileSkip.VENDORED,
        "alpha/api_pb2.py": FileSkip.GENERATED,
        "alpha/tables.py": FileSkip.TOO_LARGE,
        "alpha/missing.py": FileSkip.MISSING,
    }
    real = site.resolve()
    assert all(f.path.is_relative_to(real) and f.bytes == f.path.stat().st_size for f in alpha.files)


def test_order_and_shadowing_are_deterministic(site: Path, tmp_path: Path) -> None:
    first = select_packages([site])
    assert select_packages([site]) == first
    # Installed in the opposite order elsewhere: the same names in the same order.
    other = tmp_path / "other"
    for name in ("zeta", "omega", "alpha"):
        install(other, name, "9", [("License-Expression", "ISC")], {f"{name}/m.py": f"n = '{name}'\n".encode()})
    assert [p.name for p in select_packages([other]).included] == ["alpha", "omega", "zeta"]
    # An earlier folder wins, as on sys.path; the later one's alpha is reported as shadowed.
    both = select_packages([site, other])
    assert [(p.name, p.version) for p in both.included] == [("alpha", "1.0"), ("gamma", "0.3"), ("omega", "9"),
                                                            ("zeta", "6.0")]  # fmt: skip
    shadowed = [(p.name, p.version, p.exclusion) for p in both.excluded if p.exclusion is Exclusion.SHADOWED]
    assert shadowed == [("alpha", "9", Exclusion.SHADOWED), ("zeta", "9", Exclusion.SHADOWED)]
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        select_packages([tmp_path / "nowhere"])


def _corpus_text(out: Path) -> bytes:
    tokenizer = Tokenizer.from_file(out / "tokenizer.json")
    return b"".join(tokenizer.decode_bytes(np.asarray(load_tokens(out, s)).tolist()) for s in ("train", "val"))


def test_corpus_records_package_version_licence_and_splits_by_package(site: Path, tmp_path: Path) -> None:
    kwargs = {"max_files": 4, "vocab_size": 300, "holdout_fraction": 0.5, "progress": False, "max_file_bytes": 2000}
    manifest = build_corpus(tmp_path / "c", packages=True, site_paths=[site], **kwargs)
    assert CorpusManifest.load(tmp_path / "c") == manifest and manifest.format == 2
    package_files = [f for f in manifest.files if f.package != "python-stdlib"]
    assert [(f.name, f.package, f.version, f.licence) for f in package_files] == [
        ("site-packages/alpha/alpha/__init__.py", "alpha", "1.0", "MIT"),
        ("site-packages/alpha/alpha/core.py", "alpha", "1.0", "MIT"),
        ("site-packages/alpha/alpha/tests/test_core.py", "alpha", "1.0", "MIT"),
        ("site-packages/gamma/gamma/__init__.py", "gamma", "0.3", "LicenseRef-BSD"),
        ("site-packages/zeta/zeta/a.py", "zeta", "6.0", "Apache-2.0"),
        ("site-packages/zeta/zeta/b.py", "zeta", "6.0", "Apache-2.0"),
    ]
    stdlib = [f for f in manifest.files if f.package == "python-stdlib"]
    assert len(stdlib) == 4 and {f.licence for f in stdlib} == {"PSF-2.0"}
    # A package's files share the split its name's hash gives; the stdlib keeps its split by file name.
    assert all(f.split == split_of(f.package, 0.5) for f in package_files)
    assert {f.split for f in package_files} == {"train", "val"}
    assert all(f.split == split_of(f.name, 0.5) for f in stdlib)
    assert {(p.name, p.split, p.files) for p in manifest.packages} == {
        ("python-stdlib", "file", 4), ("alpha", "train", 3), ("gamma", "train", 1), ("zeta", "val", 2)}  # fmt: skip
    assert [(p.name, p.reason) for p in manifest.excluded_packages] == [
        ("beta", "NOT_PERMISSIVE"), ("delta-pkg", "NO_LICENCE"), ("epsilon", "NO_RECORD")]  # fmt: skip
    assert ("site-packages/alpha/../escape.py", FileSkip.OUTSIDE_ROOT.value) in {
        (s.name, s.reason) for s in manifest.skipped
    }
    text = _corpus_text(tmp_path / "c")
    assert b"def run():\n    return 'alpha'\n" in text and b"x = 'beta'" not in text and SECRET not in text

    # Adding a package moves no other file between the splits, and the same inputs give the same bytes.
    install(site, "kappa", "1", [("License-Expression", "0BSD")], {"kappa.py": b"k = 'kappa'\n"})
    grown = build_corpus(tmp_path / "grown", packages=True, site_paths=[site], **kwargs)
    splits = {f.name: f.split for f in grown.files}
    assert all(splits[f.name] == f.split for f in manifest.files)
    assert splits["site-packages/kappa/kappa.py"] == split_of("kappa", 0.5) == "val"
    again = build_corpus(tmp_path / "again", packages=True, site_paths=[site], **kwargs)
    for name in ("tokenizer.json", "train.bin", "val.bin", "manifest.json"):
        assert (tmp_path / "again" / name).read_bytes() == (tmp_path / "grown" / name).read_bytes(), name
    assert again == grown


def test_without_packages_the_manifest_keeps_format_1(tmp_path: Path) -> None:
    manifest = build_corpus(tmp_path / "c", max_files=3, vocab_size=300, progress=False)
    doc = json.loads((tmp_path / "c" / "manifest.json").read_text())
    assert doc["format"] == manifest.format == 1 and "packages" not in doc
    assert all(set(f) == {"name", "sha256", "bytes", "split"} for f in doc["files"])
    with pytest.raises(ValueError, match="--packages"):
        build_corpus(tmp_path / "d", max_files=3, site_paths=[tmp_path], progress=False)


def test_cli_prints_the_summary_and_writes_the_licences_report(site: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    for name in [n for n in os.environ if n.startswith(env.PREFIX)]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("COLUMNS", "200")  # rich wraps cells to the terminal's width
    report = tmp_path / "licences.json"
    argv = ["build-corpus", "--packages", "--site-packages", str(site), "--max-files", "4", "--vocab-size", "300",
            "--holdout-fraction", "0.5", "--max-file-bytes", "2000", "--out", str(tmp_path / "c"),
            "--licences-report", str(report)]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "3 packages left out" in out and "GPL-3.0-or-later is copyleft" in out
    assert "held out whole: zeta" in out and "no licence statement" in out
    doc = json.loads(report.read_text())
    assert [p["name"] for p in doc["packages"]] == ["python-stdlib", "alpha", "gamma", "zeta"]
    assert {p["name"]: p["reason"] for p in doc["excluded_packages"]}["beta"] == "NOT_PERMISSIVE"

    assert main(["build-corpus", "--site-packages", str(site), "--out", str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "give --packages too" in err
    assert (
        main(["build-corpus", "--packages", "--site-packages", str(tmp_path / "no"), "--out", str(tmp_path / "e")]) == 2
    )
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not a directory" in err and not (tmp_path / "e").exists()
