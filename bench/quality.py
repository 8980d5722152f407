"""A target's quality on prompts nobody trained on: held-out loss, how much it repeats itself, and tau per drafter.

For `--target` on the prompt set (`--prompts`, written by bench/heldout_prompts.py: headers and docstrings from a
corpus's held-out packages), each prompt encoded with the target's tokenizer:
- greedy continuation of `--new-tokens` tokens (plain decoding, no stop at end-of-text), and its distinct-4-gram
  ratio: distinct 4-grams / 4-grams among the generated tokens (1.0: no 4-gram repeats; a looping model falls
  towards 0). Reported: the mean over prompts (`distinct4`) and the lowest;
- with `--corpus` (a corpus tokenized with the target's tokenizer, checked), held-out loss in nats/token on the
  fixed windows train-target evaluates (`--seq-len`, `--eval-windows`: the default model's recipe used 512, 256);
- per `--drafter`: tau (tokens per verification round) and tokens per target forward with a greedy chain of
  `--k` drafts and with the client's default EAGLE-2 tree (12 levels, 3 wide, 32 draft nodes: `DEFAULT_TREE`,
  bench/spec.py's shape with the root counted), measured by bench/spec.py's `run_chain`; every speculative output
  is checked against the plain continuation (fp32: the run fails if one differs). Ratios to the first EAGLE
  drafter given are keyed by drafter name.
With `--repetition-penalty`, `--frequency-penalty` or `--presence-penalty` (the sampling controls a user reaches for
when a model loops), the greedy continuations are written a second time under them and their distinct-4-gram ratio
is reported beside the plain one (`distinct4_penalised`, with the `controls`); tau is measured on plain greedy only.
Prints a table, then one JSON line; `--show N` writes the first N continuations' text to stderr. On a shared CPU,
run it with OMP_NUM_THREADS=1: batch-1 decoding gains nothing from a second thread, and an OpenMP thread waiting for
a busy core made plain decoding ~15x slower on the 2-core VM (BENCHMARKS.md, "Quality on held-out prompts").

    OMP_NUM_THREADS=1 python bench/quality.py --target deploy/models/target --drafter deploy/models/drafter \
        deploy/models/drafter-eagle --corpus data/corpus-stdlib --device cpu
    python bench/quality.py --target runs/compact/target --prompts deploy/models/prompts/heldout.jsonl --show 3

Tested by tests/server/test_bench_quality.py.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from tether.client.session_types import ClientConfig
from tether.server.engine import SpeculativeEngine
from tether.server.model_loading import default_model_dir
from tether.server.train.drafter import check_corpus_tokenizer
from tether.server.train.target import Batches, TrainConfig, heldout_loss
from tether.shared.checkpoint import fingerprint
from tether.shared.drafter_loading import load_drafter
from tether.shared.logits_processing import SamplingControls
from tether.shared.model import Transformer
from tether.shared.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_PROMPTS = ROOT / "deploy/models/prompts/heldout.jsonl"
_CLIENT = ClientConfig()
DEFAULT_TREE = (_CLIENT.tree_depth, _CLIENT.tree_top_k, _CLIENT.tree_nodes + 1)  # total_tokens counts the root


def load_spec():
    """bench/spec.py as a module (bench/ is no package): its measuring code is the one run here."""
    if "tether_bench_spec" not in sys.modules:
        spec = importlib.util.spec_from_file_location("tether_bench_spec", Path(__file__).resolve().parent / "spec.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["tether_bench_spec"] = module
        spec.loader.exec_module(module)
    return sys.modules["tether_bench_spec"]


def distinct_ngram_ratio(tokens: list[int], n: int = 4) -> float | None:
    """Distinct n-grams / n-grams of `tokens`; None when there is no n-gram."""
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    return len(set(grams)) / len(grams) if grams else None


def read_prompt_texts(path: Path) -> list[tuple[str, str]]:
    """(id, text) of each prompt of a bench/heldout_prompts.py JSONL file, in file order."""
    records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [(r["id"], r["text"]) for r in records]


def corpus_loss(target: Transformer, corpus: Path, target_dir: Path, seq_len: int, windows: int, device: str) -> float:
    """Held-out loss on train-target's evaluation windows of `corpus`'s val.bin (leaves the target in eval mode)."""
    check_corpus_tokenizer(target_dir, corpus)
    batches = Batches(corpus, seq_len, seed=0, eval_windows=windows)  # the windows do not depend on the seed
    loss = heldout_loss(target, batches, TrainConfig(batch_size=16, device=device))
    target.eval()
    return loss


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, default=default_model_dir())
    ap.add_argument("--drafter", type=Path, nargs="*", default=[], help="drafter folders paired with the target")
    ap.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS, help="JSONL from bench/heldout_prompts.py")
    ap.add_argument("--corpus", type=Path, help="corpus folder for held-out loss on its val.bin")
    ap.add_argument("--seq-len", type=int, default=512, help="held-out loss window (train-target's --seq-len)")
    ap.add_argument("--eval-windows", type=int, default=256, help="held-out loss windows (train-target's)")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=5, help="draft tokens per chain round")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--show", type=int, default=0, help="write this many continuations' text to stderr")
    ap.add_argument("--repetition-penalty", type=float, default=1.0, help="a second greedy pass under it (1: none)")
    ap.add_argument("--frequency-penalty", type=float, default=0.0, help="a second greedy pass under it (0: none)")
    ap.add_argument("--presence-penalty", type=float, default=0.0, help="a second greedy pass under it (0: none)")
    args = ap.parse_args(argv)
    if args.new_tokens < 4:
        ap.error("--new-tokens must be at least 4 (a continuation needs a 4-gram)")
    controls = SamplingControls(repetition_penalty=args.repetition_penalty, frequency_penalty=args.frequency_penalty,
                                presence_penalty=args.presence_penalty)  # fmt: skip
    penalised = controls != SamplingControls()

    spec = load_spec()
    target = Transformer.from_pretrained(args.target, device=args.device, dtype=torch.float32)
    tokenizer = Tokenizer.from_pretrained(args.target)
    named = read_prompt_texts(args.prompts)
    if not named:
        raise SystemExit(f"{args.prompts} holds no prompt")
    prompts = [tokenizer.encode(text) for _, text in named]
    longest = max(map(len, prompts)) + args.new_tokens + max(DEFAULT_TREE[2], args.k + 1)
    if longest > target.cfg.max_seq_len:
        raise SystemExit(f"a prompt with its continuation needs {longest} positions; the target has "
                         f"{target.cfg.max_seq_len}")  # fmt: skip

    loss = corpus_loss(target, args.corpus, args.target, args.seq_len, args.eval_windows, args.device) \
        if args.corpus else None  # fmt: skip
    plain = SpeculativeEngine(target, None)
    t0 = time.perf_counter()
    with torch.inference_mode():
        continuations = [[t for c in plain.generate(p, args.new_tokens) for t in c] for p in prompts]
    plain_tps = len(prompts) * args.new_tokens / (time.perf_counter() - t0)
    ratios = [distinct_ngram_ratio(c) for c in continuations]
    for (pid, text), cont, ratio in list(zip(named, continuations, ratios, strict=True))[: args.show]:
        print(f"--- {pid} (distinct 4-grams {ratio:.3f})\n{text}{tokenizer.decode(cont)}\n", file=sys.stderr)
    penalised_ratios = []
    if penalised:
        with torch.inference_mode():
            for (pid, text), p in list(zip(named, prompts, strict=True)):
                cont = [t for c in plain.generate(p, args.new_tokens, controls=controls) for t in c]
                penalised_ratios.append(distinct_ngram_ratio(cont))
                if len(penalised_ratios) <= args.show:
                    print(f"--- {pid} penalised (distinct 4-grams {penalised_ratios[-1]:.3f})\n{text}"
                          f"{tokenizer.decode(cont)}\n", file=sys.stderr)  # fmt: skip

    fp = fingerprint(args.target)
    rows = []
    for path in args.drafter:
        drafter = load_drafter(path, target, target_fingerprint=fp)
        chain = spec.run_chain(target, drafter, prompts, args.new_tokens, args.k, continuations)
        spec.measured(path.name, {"k": args.k, **chain})
        tree = spec.run_chain(target, drafter, prompts, args.new_tokens, args.k, continuations, tree=DEFAULT_TREE)
        spec.measured(path.name, {"shape": list(DEFAULT_TREE), **tree})
        rows.append({"drafter": path.name, "kind": drafter.dcfg.kind, "tli": drafter.dcfg.tli,
                     "params": drafter.num_trainable(), "chain": chain, "tree": tree})  # fmt: skip

    result = {
        "bench": "quality",
        "target": str(args.target),
        "params": target.cfg.num_params(),
        "prompts": len(prompts),
        "prompt_set": args.prompts.name,
        "new_tokens": args.new_tokens,
        "heldout_loss": loss,
        "distinct4": float(np.mean(ratios)),
        "distinct4_min": float(np.min(ratios)),
        "plain_tokens_per_s": plain_tps,
        "controls": {
            "repetition_penalty": args.repetition_penalty,
            "frequency_penalty": args.frequency_penalty,
            "presence_penalty": args.presence_penalty,
        }
        if penalised
        else None,
        "distinct4_penalised": float(np.mean(penalised_ratios)) if penalised else None,
        "k": args.k,
        "tree": list(DEFAULT_TREE),
        "drafters": rows,
        "device": args.device,
        "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__,
    }
    eagles = [r for r in rows if r["kind"] == "eagle"]
    if eagles:
        eagle = eagles[0]
        result["eagle"] = eagle["drafter"]
        result["tau_ratio_vs_eagle"] = {
            r["drafter"]: {mode: r[mode]["tau"] / eagle[mode]["tau"] for mode in ("chain", "tree")}
            for r in rows
            if r["kind"] != "eagle"
        }

    console = Console(width=150)
    table = Table(title=f"{args.target}: {len(prompts)} held-out prompts, greedy, {args.new_tokens} new tokens")
    for col in ("params", "held-out loss", "distinct 4-grams (mean)", "lowest", "penalised", "plain tok/s"):
        table.add_column(col, justify="right")
    table.add_row(f"{result['params'] / 1e6:.2f}M", "-" if loss is None else f"{loss:.4f}",
                  f"{result['distinct4']:.3f}", f"{result['distinct4_min']:.3f}",
                  "-" if not penalised else f"{result['distinct4_penalised']:.3f}", f"{plain_tps:.1f}")  # fmt: skip
    console.print(table)
    if rows:
        d, w, n = DEFAULT_TREE
        table = Table(title=f"tau: chain k={args.k}; the client's default tree ({d} deep, {w} wide, {n - 1} nodes)")
        for col in ("drafter", "kind", "TLI", "params", "chain tau", "tok/forward", "tree tau", "tok/forward"):
            table.add_column(col, justify="right")
        for r in rows:
            table.add_row(r["drafter"], r["kind"], str(r["tli"]), f"{r['params'] / 1e6:.2f}M",
                          f"{r['chain']['tau']:.3f}", f"{r['chain']['tokens_per_forward']:.3f}",
                          f"{r['tree']['tau']:.3f}", f"{r['tree']['tokens_per_forward']:.3f}")  # fmt: skip
        console.print(table)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
