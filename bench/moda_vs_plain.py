"""Held-out loss of a MoDA target against its plain twin at equal steps, from two train-target run directories.

Reads each run's history.json (held-out loss against tokens seen) and summary.json (tokens per step, whether the
model is MoDA, its size), and compares the two at every step where both were evaluated: the twins of one recipe
(`--preset medium` and `--preset medium-plain`, same flags) evaluate on the same steps over the same held-out
windows. Runs whose steps hold different token counts (another batch size or sequence length) are refused: equal
steps would then not be equal data. A run still in progress compares up to where both have got.
Prints a table, then one JSON line; `--plot` also draws both curves and their difference.

    python bench/moda_vs_plain.py --moda runs/medium --plain runs/medium-plain
    python bench/moda_vs_plain.py --moda runs/medium --plain runs/medium-plain --plot moda_vs_plain.png
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table


def load_run(directory: Path) -> dict:
    """A run's held-out curve {tokens: loss} and its summary (empty where the run has none yet)."""
    history_path = directory / "history.json"
    if not history_path.exists():
        raise FileNotFoundError(f"{history_path} not found: is {directory} a train-target run directory?")
    history = json.loads(history_path.read_text())
    summary_path = directory / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    return {"dir": str(directory), "val": {int(t): float(loss) for t, loss in history["val"]}, "summary": summary}


def compare(moda: dict, plain: dict) -> dict:
    """The record: both runs' identities and the held-out losses at every step both evaluated."""
    for run, want in ((moda, True), (plain, False)):
        if run["summary"].get("moda", want) is not want:
            kind = "a MoDA" if run["summary"]["moda"] else "a plain"
            raise ValueError(f"{run['dir']} holds {kind} model; pass the MoDA run as --moda, its twin as --plain")
    per_step = {run["summary"].get("tokens_per_step") for run in (moda, plain)} - {None}
    if len(per_step) > 1:
        raise ValueError(f"the runs differ in tokens per step ({sorted(per_step)}): equal steps are not equal data")
    tokens_per_step = per_step.pop() if per_step else None
    points = []
    for tokens in sorted(moda["val"].keys() & plain["val"].keys()):
        m, p = moda["val"][tokens], plain["val"][tokens]
        step = tokens // tokens_per_step if tokens_per_step else None
        points.append({"step": step, "tokens": tokens, "moda": m, "plain": p, "delta": m - p})
    if not points:
        raise ValueError("the runs share no evaluation point (different --eval-every?)")

    def who(run: dict) -> dict:
        s = run["summary"]
        keys = ("preset", "params", "steps", "steps_target", "finished", "tokens_per_s", "mfu")
        return {"dir": run["dir"], **{k: s.get(k) for k in keys}}

    return {
        "bench": "moda_vs_plain",
        "moda": who(moda),
        "plain": who(plain),
        "tokens_per_step": tokens_per_step,
        "points": points,
        "last": points[-1],  # delta < 0: MoDA ahead
    }


def show(record: dict, console: Console) -> None:
    m, p = record["moda"], record["plain"]
    title = f"held-out loss at equal steps: MoDA {m['preset'] or m['dir']} vs plain {p['preset'] or p['dir']}"
    table = Table(title=title)
    for column in ("step", "tokens", "MoDA", "plain", "MoDA - plain"):
        table.add_column(column, justify="right")
    for pt in record["points"]:
        step = "-" if pt["step"] is None else f"{pt['step']:,}"
        table.add_row(step, f"{pt['tokens']:,}", f"{pt['moda']:.4f}", f"{pt['plain']:.4f}", f"{pt['delta']:+.4f}")
    console.print(table)


def plot(record: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = record["points"]
    by_step = all(pt["step"] is not None for pt in pts)
    x = [pt["step"] if by_step else pt["tokens"] / 1e6 for pt in pts]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True, height_ratios=(2, 1))
    top.plot(x, [pt["moda"] for pt in pts], marker="o", markersize=3, label=f"MoDA ({record['moda']['preset']})")
    top.plot(x, [pt["plain"] for pt in pts], marker="o", markersize=3, label=f"plain ({record['plain']['preset']})")
    top.set_ylabel("held-out cross-entropy (nats/token)")
    top.grid(alpha=0.3)
    top.legend()
    bottom.axhline(0.0, color="grey", linewidth=0.8)
    bottom.plot(x, [pt["delta"] for pt in pts], marker="o", markersize=3, color="C2")
    bottom.set_ylabel("MoDA - plain (nats)")
    bottom.set_xlabel("step" if by_step else "tokens seen (M)")
    bottom.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--moda", required=True, type=Path, help="the MoDA run's --out directory")
    ap.add_argument("--plain", required=True, type=Path, help="its plain twin's --out directory")
    ap.add_argument("--plot", type=Path, default=None, help="also draw the curves into this PNG")
    args = ap.parse_args(argv)
    try:
        record = compare(load_run(args.moda), load_run(args.plain))
    except (FileNotFoundError, ValueError) as e:
        print(f"moda_vs_plain: error: {e}", file=sys.stderr)
        return 2
    show(record, Console(width=120))
    if args.plot:
        plot(record, args.plot)
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
