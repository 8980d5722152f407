"""bench/heldout_prompts.py on a fake site-packages folder and manifest (held-out packages only, files checked by
sha256, stubs and duplicates left out, the choice balanced and deterministic), and bench/quality.py on a tiny
target with a MoA and an EAGLE drafter (its record, the distinct-4-gram ratio, held-out loss on train-target's
windows, tau through bench/spec.py's measuring code)."""

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from bench_modules import load_bench
from tiny_models import save_tiny_pairs

from tether.server.engine import SpeculativeEngine
from tether.server.train.corpus import CorpusFile, CorpusManifest, CorpusPackage, load_tokens
from tether.shared.logits_processing import SamplingControls
from tether.shared.model import Transformer
from tether.shared.tokenizer import Tokenizer

ALPHA = '''import os


def fetch(url, timeout=10):
    """Fetch one URL and return its body as bytes, retrying once."""
    for attempt in range(2):
        try:
            return os.fetch(url, timeout)
        except OSError:
            continue
    return b""


def stub(x):
    """An abstract step that subclasses must fill in."""
    raise NotImplementedError


def fetch_again(url):
    """Fetch one URL and return its body as bytes, retrying once."""
    data = fetch(url)
    data = data.strip()
    return data


class Cache:
    """A small in-memory cache of fetched pages keyed by URL."""

    def __init__(self):
        self.pages = {}
        self.hits = 0
        self.misses = 0

    def get(self, url):
        """Return the cached page for url, fetching it on a miss."""
        if url not in self.pages:
            self.misses += 1
            self.pages[url] = fetch(url)
        return self.pages[url]


def oneline(x): """Docstring on the header's own line is left out."""; return x + 1
'''
BETA = '''def parse(text):
    """Split the text into words and count how often each appears."""
    counts = {}
    for word in text.split():
        counts[word] = counts.get(word, 0) + 1
    return counts
'''
TRAINED = '''def seen(a):
    """This package was trained on and never gives a prompt."""
    a += 1
    a += 2
    return a
'''


def _file(name: str, data: str, package: str, split: str) -> CorpusFile:
    raw = data.encode()
    return CorpusFile(name, hashlib.sha256(raw).hexdigest(), len(raw), split, package, "1.0", "MIT")


@pytest.fixture
def site(tmp_path: Path) -> tuple[Path, CorpusManifest]:
    """Installed files of a held-out package `held` (alpha.py, beta.py, and changed.py, changed since the corpus
    was built), of `other` (held out) and `trained` (train split); the manifest that names them."""
    root = tmp_path / "site"
    files = {"held/alpha.py": ALPHA, "held/beta.py": BETA, "held/changed.py": BETA.replace("words", "lines"),
             "other/gamma.py": BETA.replace("parse", "tally"), "trained/t.py": TRAINED}  # fmt: skip
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    manifest = CorpusManifest(
        python_version="3.11.7", python_build="", holdout_fraction=0.2, vocab_size=300, tokenizer_sha256="",
        eos_id=0, dtype="uint16", train_tokens=0, val_tokens=0,
        files=(_file("site-packages/held/held/alpha.py", ALPHA, "held", "val"),
               _file("site-packages/held/held/beta.py", BETA, "held", "val"),
               _file("site-packages/held/held/changed.py", BETA, "held", "val"),  # the bytes it had then
               _file("site-packages/other/other/gamma.py", BETA.replace("parse", "tally"), "other", "val"),
               _file("site-packages/trained/trained/t.py", TRAINED, "trained", "train"),
               _file("alpha.py", ALPHA, "python-stdlib", "val")),
        packages=(CorpusPackage("held", "1.0", "MIT", "License-Expression", "val", 3, 0),
                  CorpusPackage("other", "1.0", "MIT", "License-Expression", "val", 1, 0),
                  CorpusPackage("trained", "1.0", "MIT", "License-Expression", "train", 1, 0),
                  CorpusPackage("python-stdlib", "3.11.7", "PSF-2.0", "interpreter", "file", 1, 0)),
        format=2,
    )  # fmt: skip
    return root, manifest


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.train(texts=[ALPHA, BETA, TRAINED] * 3, vocab_size=300)


def test_prompts_come_from_held_out_files_as_headers_and_docstrings(site, tokenizer) -> None:
    build = load_bench("heldout_prompts")
    root, manifest = site
    prompts, figures = build.build_prompts(manifest, tokenizer, count=10, site_paths=[root])
    assert [(p.file, p.name, p.line, p.end_line) for p in prompts] == [
        ("site-packages/held/held/alpha.py", "Cache", 26, 27),
        ("site-packages/held/held/alpha.py", "Cache.get", 34, 35),
        ("site-packages/held/held/beta.py", "parse", 1, 2),
    ]  # not: the stub, fetch_again (fetch's docstring again), fetch (a third from alpha.py, last by hash), oneline,
    # the changed file, gamma.py (beta's code under another name: its docstring repeats), the trained package
    assert prompts[0].text == 'class Cache:\n    """A small in-memory cache of fetched pages keyed by URL."""'
    assert prompts[1].text == 'def get(self, url):\n    """Return the cached page for url, fetching it on a miss."""'
    assert all(p.package == "held" and p.version == "1.0" and p.licence == "MIT" for p in prompts)
    assert all(p.tokens == len(tokenizer.encode(p.text)) for p in prompts)
    assert figures["held"] == {"files": 3, "changed_or_missing": 1, "candidates": 4, "chosen": 3}
    assert figures["other"] == {"files": 1, "changed_or_missing": 0, "candidates": 0, "chosen": 0}
    assert "trained" not in figures and "python-stdlib" not in figures
    assert [c.name for c in build.candidates(ALPHA)] == ["fetch", "fetch_again", "Cache", "Cache.get"]
    again, _ = build.build_prompts(manifest, tokenizer, count=10, site_paths=[root])
    assert again == prompts
    short, _ = build.build_prompts(manifest, tokenizer, count=10, max_tokens=prompts[0].tokens, site_paths=[root])
    assert all(p.tokens <= prompts[0].tokens for p in short) and prompts[0] in short and len(short) < 3


def test_choice_is_round_robin_over_packages_and_capped_per_file() -> None:
    build = load_bench("heldout_prompts")
    c = {name: build.Candidate(name, name, name, 1, 2) for name in "abcdefg"}
    pools = {"p": [("p/1", c["a"]), ("p/1", c["b"]), ("p/1", c["c"]), ("p/2", c["d"])],
             "q": [("q/1", c["e"]), ("q/1", c["f"])]}  # fmt: skip
    chosen = build.choose(pools, 10, lambda _: True)
    assert [x.text for _, x in chosen] == ["a", "e", "b", "f", "d"]  # c: a third from p/1
    assert [x.text for _, x in build.choose(pools, 3, lambda x: x.text != "a")] == ["b", "e", "c"]


def test_written_prompts_read_back(site, tokenizer, tmp_path) -> None:
    build = load_bench("heldout_prompts")
    root, manifest = site
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "manifest.json").write_text(manifest.to_json())
    tokenizer.save_pretrained(tmp_path / "corpus")
    out = tmp_path / "p" / "heldout.jsonl"
    prompts = build.main(["--manifest", str(tmp_path / "corpus" / "manifest.json"), "--out", str(out),
                          "--count", "2", "--site-packages", str(root)])  # fmt: skip
    assert len(prompts) == 2 and build.read_prompts(out) == prompts
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == [p.id for p in prompts]


def test_distinct_ngram_ratio() -> None:
    quality = load_bench("quality")
    assert quality.distinct_ngram_ratio([1, 2, 3, 4, 1, 2, 3, 4]) == 4 / 5
    assert quality.distinct_ngram_ratio([7] * 10) == 1 / 7
    assert quality.distinct_ngram_ratio(list(range(9))) == 1.0
    assert quality.distinct_ngram_ratio([1, 2, 3]) is None


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("quality")
    save_tiny_pairs(root, vocab_size=300, max_files=12)
    texts = ('def add(a, b):\n    """Add two numbers."""', 'class Stack:\n    """A stack."""')
    lines = [{"id": str(i), "text": text} for i, text in enumerate(texts)]
    (root / "prompts.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return root


def test_quality_record(models, capsys) -> None:
    quality = load_bench("quality")
    record = quality.main(["--target", str(models / "target"), "--drafter", str(models / "moa"), str(models / "eagle"),
                           "--prompts", str(models / "prompts.jsonl"), "--corpus", str(models / "corpus"),
                           "--seq-len", "16", "--eval-windows", "5", "--new-tokens", "12", "--device", "cpu",
                           "--show", "1"])  # fmt: skip
    out, err = capsys.readouterr()
    assert json.loads(out.strip().splitlines()[-1]) == record  # the one JSON line, last
    assert "--- 0 (distinct 4-grams" in err and "--- 1" not in err
    assert 'def add(a, b):\n    """Add two numbers."""' in err
    assert record["prompts"] == 2 and record["new_tokens"] == 12 and 0 < record["distinct4_min"] <= record["distinct4"]
    assert record["tree"] == [12, 3, 33]  # the client's default tree, root counted

    target = Transformer.from_pretrained(models / "target", device="cpu")
    val = load_tokens(models / "corpus", "val")
    starts = np.linspace(0, len(val) - 17, num=5).astype(np.int64)
    windows = torch.from_numpy(np.stack([val[s : s + 17] for s in starts]).astype(np.int64))
    with torch.no_grad():
        logits = target(windows[:, :-1])
    expected = F.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten()).item()
    assert record["heldout_loss"] == pytest.approx(expected, rel=1e-5)

    moa, eagle = record["drafters"]
    assert (moa["kind"], eagle["kind"], record["eagle"]) == ("moa", "eagle", "eagle")
    for r in (moa, eagle):
        assert all(r[m]["tau"] >= 1 and r[m]["mismatched_prompts"] == 0 for m in ("chain", "tree"))
    assert record["tau_ratio_vs_eagle"] == {"moa": {m: moa[m]["tau"] / eagle[m]["tau"] for m in ("chain", "tree")}}
    landed = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    assert [(m["drafter"], m.get("shape")) for m in landed] == [("moa", None), ("moa", [12, 3, 33]),
                                                               ("eagle", None), ("eagle", [12, 3, 33])]  # fmt: skip


def test_quality_penalised_pass(models, capsys) -> None:
    """A penalty adds a second greedy pass whose distinct-4 ratio is the one plain decoding under the same controls
    gives; the plain figure and the rest of the record do not change."""
    quality = load_bench("quality")
    common = ["--target", str(models / "target"), "--prompts", str(models / "prompts.jsonl"), "--new-tokens", "24",
              "--device", "cpu"]  # fmt: skip
    plain = quality.main(common)
    record = quality.main([*common, "--repetition-penalty", "1.5", "--frequency-penalty", "0.5"])
    capsys.readouterr()
    assert plain["distinct4_penalised"] is None and plain["controls"] is None
    assert record["distinct4"] == plain["distinct4"]
    assert record["controls"] == {"repetition_penalty": 1.5, "frequency_penalty": 0.5, "presence_penalty": 0.0}

    target = Transformer.from_pretrained(models / "target", device="cpu", dtype=torch.float32)
    tok = Tokenizer.from_pretrained(models / "target")
    controls = SamplingControls(repetition_penalty=1.5, frequency_penalty=0.5)
    engine = SpeculativeEngine(target, None)
    ratios = []
    for _, text in quality.read_prompt_texts(models / "prompts.jsonl"):
        with torch.inference_mode():
            cont = [t for c in engine.generate(tok.encode(text), 24, controls=controls) for t in c]
        ratios.append(quality.distinct_ngram_ratio(cont))
    assert record["distinct4_penalised"] == pytest.approx(float(np.mean(ratios)))
