"""`make demo`'s program, shortened: it runs end to end, both drops happen, and under rewind the text equals the
target's own greedy output. The demo strikes its drops on the client's progress (tokens written, resync attempts),
not on the clock, so both land mid-generation and each ends in a resync whatever the machine's speed."""

import re
import subprocess
import sys


def test_demo_runs_through_two_drops_and_rewind_reproduces_the_target():
    cmd = [sys.executable, "-m", "tether.netsim.demo", "--policy", "rewind", "--max-new-tokens", "200", "--pace", "40"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={"COLUMNS": "100", "PATH": ""})
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert "summary" in out and "equals what the target alone writes" in out
    resyncs = re.search(r"resyncs\s*\W\s*(\d+)", out)
    assert resyncs and int(resyncs.group(1)) >= 2, out  # a cut and a stall, each followed by a resync
