"""Speculative decoding quality on the held-out split: acceptance length, tokens per target forward, and the
offline curve (how long a drafter stays right with no new target states).
Each chain and tree measurement is also written to stderr as a JSON line when it finishes.

For each drafter, on `--prompts` held-out windows of `--prompt-len` tokens:
- greedy chain drafting with k=`--k`, `--new-tokens` tokens: mean tau (tokens gained per verification round),
  tokens per target forward (the prefill counts as one), and wall-clock tokens/s on this device;
- the same with EAGLE-2 dynamic tree drafting for each shape in `--tree depth,top_k,total_tokens ...`, each tree
  verified in one forward; total_tokens is what a verification costs the server, so each drafter's best tau at
  each total_tokens (over the shapes given) is reported, and its ratio to EAGLE's best at the same budget: a deep
  tree suits a drafter that stays right long, a wide one a drafter that goes wrong early;
- offline: from the verified prompt, the drafter alone drafts `--offline` tokens after the target's first
  token; agreement at position i is the fraction of prompts whose i-th offline token equals the target's
  greedy continuation. Reported per position (JSON) and as the mean over the first 32.
Greedy outputs are checked against plain decoding on every prompt: in fp32 (`--dtype`, the default everywhere)
the run fails loudly if one differs; in bf16 or fp16, where verifying k + 1 rows at once may round a near-tie
otherwise than decoding one row, the prompts that differ are counted (`mismatched_prompts`) and the run goes on.
The corpus must be tokenized with the target's tokenizer (checked). Ratios to EAGLE are keyed by drafter name,
against the first EAGLE drafter given. Prints a table, then one JSON line.

    python bench/spec.py --data data/corpus --prompts 32
    python bench/spec.py --tree 10,8,80 16,8,80 24,8,80 16,4,80 --k 12     # each drafter's best 80-node tree
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from tether.server.engine import SpeculativeEngine, target_states
from tether.server.model_loading import default_model_dir
from tether.server.train.corpus import build_corpus, load_tokens
from tether.server.train.drafter import check_corpus_tokenizer
from tether.shared.checkpoint import fingerprint
from tether.shared.drafter_loading import load_drafter
from tether.shared.model import Transformer
from tether.shared.tokenizer import Tokenizer

DEFAULT_DRAFTERS = [default_model_dir("drafter"), default_model_dir("drafter-eagle")]


def heldout_prompts(data: Path, target_dir: Path, n: int, length: int) -> list[list[int]]:
    if not (data / "val.bin").exists():
        build_corpus(data, tokenizer=Tokenizer.from_pretrained(target_dir))
    check_corpus_tokenizer(target_dir, data)
    val = load_tokens(data, "val")
    starts = np.linspace(0, len(val) - length - 1, n).astype(np.int64)
    return [val[s : s + length].astype(np.int64).tolist() for s in starts]


@torch.inference_mode()
def run_chain(target, drafter, prompts, new_tokens: int, k: int, references: list[list[int]], tree=None,
              exact: bool = True) -> dict:  # fmt: skip
    """exact: a prompt whose output differs from plain greedy decoding fails the run (fp32); else it is counted."""
    engine = SpeculativeEngine(target, drafter, k=k, tree=tree)
    taus, produced, forwards, wall, mismatched = [], 0, 0, 0.0, 0
    for prompt, ref in zip(prompts, references, strict=True):
        t0 = time.perf_counter()
        out = [t for chunk in engine.generate(prompt, new_tokens) for t in chunk]
        wall += time.perf_counter() - t0
        if out != ref:
            if exact:
                raise AssertionError("speculative greedy output differs from plain greedy decoding")
            mismatched += 1
        taus += engine.stats.taus
        produced += len(out)
        forwards += engine.stats.rounds + 1
    return {
        "tau": float(np.mean(taus)) if taus else 1.0,
        "tokens_per_forward": produced / forwards,
        "tokens_per_s": produced / wall,
        "mismatched_prompts": mismatched,
    }


@torch.inference_mode()
def offline_curve(target, drafter, prompts, references: list[list[int]], length: int) -> list[float]:
    """Agreement of the free-running drafter with the target's greedy continuation, per offline position."""
    hits = np.zeros(length)
    for prompt, ref in zip(prompts, references, strict=True):
        out = target.run(torch.tensor([prompt], device=target.device), hidden_layers=(target.cfg.n_layers,),
                         return_kv=True)  # fmt: skip
        drafter.begin(drafter.server_delta(target_states(out), 0, prompt), len(prompt) + length + 2)
        drafts, _, _ = drafter.draft(ref[0], length)
        hits += np.array(drafts) == np.array(ref[1 : length + 1])
    return (hits / len(prompts)).tolist()


def measured(drafter: str, figures: dict) -> None:
    """One finished measurement as a JSON line on stderr, as it lands: a long run (deep trees, many shapes) that is
    stopped still leaves what it measured; stdout keeps the table and the one JSON record."""
    print(json.dumps({"drafter": drafter, **figures}), file=sys.stderr, flush=True)


def parse_tree_shapes(values: list[str]) -> list[tuple[int, int, int]]:
    """`--tree` values ("depth,top_k,total_tokens"; '' skips) as int triples, in the order given, each once."""
    shapes = []
    for value in values:
        if not value:
            continue
        shape = tuple(int(x) for x in value.split(","))
        if len(shape) != 3 or min(shape) < 1:
            raise SystemExit(f"--tree {value!r}: expected depth,top_k,total_tokens, three positive integers")
        if shape not in shapes:
            shapes.append(shape)
    return shapes


def best_trees(trees: list[dict]) -> dict[str, dict]:
    """A drafter's best tree at each verification budget: {str(total_tokens): {"shape", "tau"}}, the budgets
    ascending; of shapes with equal tau, the first given."""
    best: dict[int, dict] = {}
    for t in trees:
        n = t["shape"][2]
        if n not in best or t["tau"] > best[n]["tau"]:
            best[n] = {"shape": t["shape"], "tau": t["tau"]}
    return {str(n): best[n] for n in sorted(best)}


def tree_table(rows: list[dict], shapes: list[tuple[int, int, int]]) -> Table:
    """Tree tau, one column per shape, then each drafter's best shape at each budget."""
    budgets = sorted({s[2] for s in shapes})
    table = Table(title="tree tau by shape (depth, top_k, total_tokens); best at each total_tokens")
    table.add_column("drafter", justify="right")
    for d, k, n in shapes:
        table.add_column(f"{d},{k},{n}", justify="right")
    for n in budgets:
        table.add_column(f"best @{n}", justify="right")
    for r in rows:
        best = r["best_tree"]
        table.add_row(r["drafter"], *[f"{t['tau']:.3f}" for t in r["trees"]],
                      *[f"{best[str(n)]['tau']:.3f} ({best[str(n)]['shape'][0]},{best[str(n)]['shape'][1]})"
                        for n in budgets])  # fmt: skip
    return table


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, default=default_model_dir())
    ap.add_argument("--drafters", type=Path, nargs="*", default=DEFAULT_DRAFTERS)
    ap.add_argument("--data", type=Path, default=Path("data/corpus"), help="corpus directory with val.bin")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--offline", type=int, default=64)
    ap.add_argument("--tree", nargs="*", default=["6,8,48"],
                    help="tree shapes, each depth,top_k,total_tokens (none, or '', to skip trees)")  # fmt: skip
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                    help="the target's weights and compute (fp32: outputs must match plain decoding)")  # fmt: skip
    args = ap.parse_args(argv)
    if args.offline < 1:
        ap.error("--offline must be at least 1 (the offline curve is part of every record)")

    dtype = getattr(torch, args.dtype)
    exact = dtype == torch.float32
    target = Transformer.from_pretrained(args.target, device=args.device, dtype=dtype)
    prompts = heldout_prompts(args.data, args.target, args.prompts, args.prompt_len)
    needed = max(args.new_tokens, args.offline + 1)
    plain = SpeculativeEngine(target, None)
    t0 = time.perf_counter()
    references = [[t for c in plain.generate(p, needed) for t in c] for p in prompts]
    plain_tps = len(prompts) * needed / (time.perf_counter() - t0)
    fp = fingerprint(args.target)
    shapes = parse_tree_shapes(args.tree)
    rows = []
    for path in args.drafters:
        drafter = load_drafter(path, target, target_fingerprint=fp)
        refs = [r[: args.new_tokens] for r in references]
        chain = run_chain(target, drafter, prompts, args.new_tokens, args.k, refs, exact=exact)
        measured(path.name, {"k": args.k, **chain})
        trees = []
        for shape in shapes:
            trees.append({"shape": list(shape), **run_chain(target, drafter, prompts, args.new_tokens, args.k, refs,
                                                            tree=shape, exact=exact)})  # fmt: skip
            measured(path.name, trees[-1])
        curve = offline_curve(target, drafter, prompts, references, args.offline)
        rows.append({"drafter": path.name, "kind": drafter.dcfg.kind, "tli": drafter.dcfg.tli,
                     "params": drafter.num_trainable(), **chain, "trees": trees, "best_tree": best_trees(trees),
                     "offline_first32": float(np.mean(curve[:32])),
                     "offline_curve": [round(x, 4) for x in curve]})  # fmt: skip

    table = Table(title=f"speculative decoding, held-out, greedy, chain k={args.k}, {len(prompts)} prompts")
    columns = ("drafter", "kind", "TLI", "params", "tau", "tok/forward", "tok/s", "offline agree@1..32",
               "offline @1", "@8", "@32")  # fmt: skip
    for col in columns:
        table.add_column(col, justify="right")
    table.add_row("(plain)", "-", "-", "-", "1.000", "1.000", f"{plain_tps:.1f}", *["-"] * 4)
    for r in rows:
        c = r["offline_curve"]
        table.add_row(r["drafter"], r["kind"], str(r["tli"]), f"{r['params'] / 1e6:.2f}M", f"{r['tau']:.3f}",
                      f"{r['tokens_per_forward']:.3f}", f"{r['tokens_per_s']:.1f}", f"{r['offline_first32']:.3f}",
                      *[f"{c[i]:.3f}" if len(c) > i else "-" for i in (0, 7, 31)])  # fmt: skip
    console = Console(width=170)
    console.print(table)
    if shapes:
        console.print(tree_table(rows, shapes))
    result = {
        "bench": "spec",
        "device": args.device,
        "dtype": args.dtype,
        "torch": torch.__version__,
        "prompts": len(prompts),
        "k": args.k,
        "trees": [list(shape) for shape in shapes],
        "plain_tokens_per_s": plain_tps,
        "drafters": rows,
    }
    eagles = [r for r in rows if r["kind"] == "eagle"]
    if eagles:
        eagle, moas = eagles[0], [r for r in rows if r["kind"] == "moa"]
        result["eagle"] = eagle["drafter"]
        for key in ("tau", "offline_first32"):
            if eagle[key]:
                result[f"{key}_ratio_vs_eagle"] = {r["drafter"]: r[key] / eagle[key] for r in moas}
        if shapes:
            result["best_tree_tau_ratio_vs_eagle"] = {
                r["drafter"]: {n: best["tau"] / eagle["best_tree"][n]["tau"] for n, best in r["best_tree"].items()}
                for r in moas
            }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
