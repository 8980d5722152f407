"""`make demo` (bench/demo.py) and its screen (tether.client.split_view).

The screen: whatever the texts hold, it fits 80x24 (or a smaller console) with its status area in place, and its
outage counts follow the link as the caller changes it. The program, end to end, on a pipe and on a forced 80x24
terminal: both streams finish, the hybrid writes tokens alone during the outages while the server-only stream gets
none and sees the cut, every frame of the live screen fits 80x24, and under rewind the hybrid's text equals the
target's own greedy output. The demo strikes its drops on the streams' progress (tokens written, resync attempts),
not on the clock, so both land mid-generation whatever the machine's speed."""

import io
import re
import subprocess
import sys

import pytest
from bench_modules import BENCH_DIR
from rich.cells import cell_len
from rich.console import Console

from tether.client.session_types import Event, Result, State, Stats
from tether.client.split_view import STATUS_ROWS, SplitView
from tether.server.model_loading import default_model_dir
from tether.shared.tokenizer import Tokenizer

pytestmark = pytest.mark.heavy  # a long file, started first (tests/conftest.py)

CSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")  # what a terminal takes as a command, not as text
FRAME_START = re.compile(r"\r\x1b\[2K(?:\x1b\[1A\x1b\[2K)*")  # rich.live moving up to redraw its screen


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_pretrained(default_model_dir())


def quiet_console(width: int, height: int) -> Console:
    return Console(width=width, height=height, record=True, file=io.StringIO(), color_system=None)


def screen_lines(view: SplitView) -> list[str]:
    view.console.print(view.render())
    return view.console.export_text().splitlines()


def filled_view(tok: Tokenizer, console: Console) -> SplitView:
    """A view whose texts are long and hostile: lines past any width, wide characters, tabs, terminal commands."""
    view = SplitView(tok, "def f(x):\n" * 40, console=console)
    chunk = ("x" * 300 + "\n" + "漢字かな" * 60 + "\t\ttab\n" + "\x1b[2J\x1b[31mred\r\x07\x9b" + "    return 1\n") * 8
    ids = tok.encode(chunk)
    view.link_change("cut", lambda: None)
    for i in range(0, len(ids), 7):
        view.hybrid.on_event(Event("tokens", tokens=ids[i : i + 7], tag="offline" if i % 2 else "verified"))
        view.server.on_event(Event("tokens", tokens=ids[i : i + 7], tag="verified"))
    view.hybrid.on_event(Event("retract", count=5))
    view.hybrid.on_event(Event("state", state=State.OFFLINE, detail="no answer within 1.0 s " * 10))
    view.server.on_event(Event("state", state=State.OFFLINE, detail="UNAVAILABLE " * 20))
    for pane in (view.hybrid, view.server):
        pane.on_event(Event("tokens", tokens=tok.encode("\nENDMARK"), tag="verified"))
        pane.stats = Stats(bytes_up=12_345_678_901, bytes_down=98_765_432_109, rounds=123_456, accepted=999_999)
    return view


def test_the_screen_fits_80x24_with_its_status_in_place_whatever_the_text(tok):
    for width, height in ((80, 24), (200, 60), (60, 18)):
        view = filled_view(tok, quiet_console(width, height))
        lines = screen_lines(view)
        assert len(lines) <= min(height, 24), (width, height, len(lines))
        assert max(cell_len(line) for line in lines) <= min(width, 80), (width, height)
        text = "\n".join(lines)
        assert "\x1b" not in text and "\r" not in text and "\x07" not in text  # the model's commands are shown, inert
        status = lines[-STATUS_ROWS:]
        assert status[0].startswith("link CUT") and "hybrid" in status[1] and "server-only" in status[1]
        assert any(line.startswith("in outages") for line in status)
        # Each pane shows the end of its text: the last token, in both halves of a line.
        marked = [line for line in lines if "ENDMARK" in line]
        assert len(marked) == 1 and marked[0].count("ENDMARK") == 2, lines


def test_the_summary_fits_80_columns(tok):
    view = filled_view(tok, quiet_console(120, 40))
    stats = Stats(bytes_up=12_345_678_901, bytes_down=98_765_432_109, rounds=123_456, accepted=999_999, ttft_s=12.5)
    result = Result([1], list(range(5000)), ["offline"] * 5000, stats)
    view.summary(result, result, wire=(12_345_678_901_234, 98_765_432_109_876), server_calls=123_456)
    lines = view.console.export_text().splitlines()
    assert max(cell_len(line) for line in lines) <= 80
    assert any("payload up / down" in line for line in lines) and any("on the wire" in line for line in lines)


def test_outage_counts_follow_the_link_as_the_caller_changes_it(tok):
    view = SplitView(tok, "p", console=quiet_console(80, 24))
    seen = []
    view.link_change("cut", lambda: seen.append(view.link))  # going down: the cut first, then the state
    assert seen == ["up"] and view.link == "cut" and view.outage() == 1
    view.hybrid.on_event(Event("tokens", tokens=[5, 6], tag="offline"))
    view.hybrid.on_event(Event("tokens", tokens=[7], tag="verified"))  # came before the cut, paced out after
    view.server.arrived(3, asked_in=0)  # asked while the link was up
    view.server.arrived(2, asked_in=1)  # asked and answered through the down link: a leak, counted
    assert (view.hybrid.in_outages, view.server.in_outages) == (2, 2)
    view.link_change("up", lambda: seen.append(view.link))  # coming back: the state first, then the restore
    assert seen == ["up", "up"] and view.outage() == 0
    view.hybrid.on_event(Event("tokens", tokens=[8], tag="offline"))  # before its resync, with the link back
    view.server.arrived(4, asked_in=1)  # asked in the outage, arrived after it
    view.link_change("stalled", lambda: None)
    view.server.arrived(1, asked_in=1)  # asked in the first outage, arrived in the second
    assert (view.hybrid.in_outages, view.server.in_outages) == (2, 2) and view.outage() == 2
    with pytest.raises(ValueError, match="link state must be one of up, cut, stalled"):
        view.link_change("down", lambda: None)


# `make demo` installs tether[demo] only: no Triton (GPU kernels, about 1 GB), no matplotlib, no test tools. The demo's
# process refuses to import them, so a dependency creeping into its path fails here rather than on a user's machine.
ONLY_THE_DEMO_EXTRA = """
import runpy, sys
class NotInTheDemoExtra:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("triton", "matplotlib", "transformers", "openai", "httpx"):
            raise ImportError(f"{name} is not in tether[demo]")
sys.meta_path.insert(0, NotInTheDemoExtra())
runpy.run_path(sys.argv.pop(1), run_name="__main__")
"""


def run_demo(policy: str, env: dict[str, str]) -> str:
    args = ["--policy", policy, "--max-new-tokens", "120", "--pace", "40"]
    cmd = [sys.executable, "-c", ONLY_THE_DEMO_EXTRA, str(BENCH_DIR / "demo.py"), *args]
    proc = subprocess.run(cmd, capture_output=True, timeout=300, env={"PATH": "", "PYTHONSAFEPATH": "1", **env})
    out = proc.stdout.decode()  # as written: text mode would turn the terminal's carriage returns into newlines
    assert proc.returncode == 0, out + proc.stderr.decode()
    return out


def check_streams(out: str) -> None:
    """Both streams finished; during the outages the hybrid wrote tokens alone, the server-only stream got none
    (and its text was stopped by the cut); the hybrid resynced after the cut and after the stall."""
    state = [line for line in out.splitlines() if line.startswith("state ")]
    assert state and state[-1].count("DONE") == 2, out
    during = re.search(r"during outages\s+(\d+) written alone\s+(\d+) over the link", out)
    assert during and int(during.group(1)) > 0 and int(during.group(2)) == 0, out
    seen = re.search(r"outages / resyncs\s+\d+ / (\d+)\s+(\d+) / -", out)
    assert seen and int(seen.group(1)) >= 2 and int(seen.group(2)) >= 1, out


def test_demo_on_a_pipe_under_rewind_reproduces_the_target():
    out = run_demo("rewind", {"COLUMNS": "80", "LINES": "24"})
    check_streams(out)
    assert "equals what the target alone writes" in " ".join(out.split())
    table = out[out.index("hybrid and server-only: one prompt") :]
    assert max(cell_len(line) for line in table.splitlines()) <= 80


def test_demo_on_an_80x24_terminal_never_draws_past_it():
    raw = run_demo("keep", {"COLUMNS": "80", "LINES": "24", "TTY_COMPATIBLE": "1", "TTY_INTERACTIVE": "1"})
    frames = FRAME_START.split(raw)[1:-1]  # each a full redraw of the live screen
    assert frames, raw[-2000:]
    for frame in frames:
        lines = CSI.sub("", frame).split("\n")
        assert len(lines) <= 24 and max(cell_len(line) for line in lines) <= 80, frame
        assert lines[-STATUS_ROWS].startswith("link ") and any(ln.startswith("in outages") for ln in lines)
    # Moving up more than 23 lines would mean a screen taller than the terminal, scrolling the status away.
    assert max(m.group(0).count("\x1b[1A") for m in FRAME_START.finditer(raw)) <= 23
    check_streams(CSI.sub("", raw))
