"""Smoke test of bench/tp.py on the CPU: both modes at TP 1 and 2 (gloo ranks), checking the JSON record's rows and
that the fused step (the server's path: shards fused after sharding, paged pool, StepRunner) runs on every rank.
Never checks a time."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tether.kernels.utils import interpreting

pytestmark = pytest.mark.heavy  # a long file, started first (tests/conftest.py)

BENCH = Path(__file__).resolve().parents[2] / "bench" / "tp.py"


@pytest.mark.skipif(not interpreting(), reason="the step mode's kernels need TRITON_INTERPRET on the CPU")
@pytest.mark.timeout(300)
def test_tp_record():
    # A subprocess: the ranks it spawns import `measure` from the script by name.
    out = subprocess.run([sys.executable, str(BENCH), "--preset", "tiny", "--device", "cpu", "--tp", "1", "2",
                          "--k", "3", "--ctx", "21", "--batch", "2", "--iters", "1", "--warmup", "0",
                          "--copy-mib", "8"], capture_output=True, text=True, timeout=280, check=True)  # fmt: skip
    record = json.loads(out.stdout.strip().splitlines()[-1])
    rows = {(r["tp"], r["mode"]): r for r in record["rows"]}
    assert set(rows) == {(w, m) for w in (1, 2) for m in ("step", "eager")}
    for r in rows.values():
        assert (r["batch"], r["ctx"], r["k"]) == (2, 21, 3) and r["ms"] > 0 and r["roofline_ms"] > 0
        assert r["speedup_vs_tp1"] is not None
    assert rows[2, "step"]["weights_gb"] < rows[1, "step"]["weights_gb"]  # each rank reads its shard only
