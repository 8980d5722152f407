"""Greedy text alone and under load: does a session's output depend on what else shares its steps? (issue #44)

For `--sessions` sessions (the held-out prompt set's prompts, in turn), greedy generation of `--new-tokens` tokens
as the server verifies rounds (tether.server.rounds.verify_batch over the paged pool, fixed-shape steps, CUDA graphs
on a GPU), twice:
- alone: each distinct prompt by itself, one row per step;
- together: every session in lockstep, all live sessions in one step each round; sessions leave as they finish, so
  the steps' composition (rows, tokens per row, table widths) keeps changing around each session.
Drafts are prompt lookup (the `--k` tokens that followed the latest earlier occurrence of the session's last two
tokens; a chain of the root alone when there is none): a function of the session's own text, so a session's rounds
are the same in both runs as long as its text is, and acceptance is what a looping model makes of it. A session
whose text differs from its prompt's alone run is counted with the token where they part. Prints a table, then one
JSON line.

    python bench/invariance.py --device cuda --sessions 128 --new-tokens 200               # the default models
    python bench/invariance.py --device cuda --attention reference                          # cuBLAS + PyTorch attention
    python bench/invariance.py --device cuda --preset llama3-8b --drafter none --new-tokens 64   # 8B shapes

`--preset NAME` verifies a target of that preset's shapes with random weights (seeded; `--layers` keeps fewer of its
layers) instead of `--model`; the prompts are still the held-out texts in `--model`'s tokenizer (their ids are any
ids of the larger vocabulary). Random weights make logits close together, so the argmax is quick to flip: a strict
check of batch invariance at a user's shapes, not a quality figure.
    TRITON_INTERPRET=1 python bench/invariance.py --device cpu --attention triton --sessions 3 --new-tokens 8

Tested by tests/server/test_bench_invariance.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from tether.server import rounds
from tether.server.kv_pool import KVPool
from tether.server.model_loading import DTYPES, attention_backend, default_model_dir, load
from tether.server.verifier import SequenceVerifier
from tether.shared.checkpoint import fingerprint
from tether.shared.config import preset
from tether.shared.drafter_loading import load_drafter
from tether.shared.model import Transformer
from tether.shared.speculative import DraftTree
from tether.shared.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parent.parent


def prompt_lookup(text: list[int], k: int) -> list[int]:
    """The k tokens after the latest earlier occurrence of text's last two tokens (fewer at the end; none if the
    pair never occurred before)."""
    if k == 0 or len(text) < 3:
        return []
    pair = text[-2:]
    for i in range(len(text) - 3, -1, -1):
        if text[i : i + 2] == pair:
            return text[i + 2 : i + 2 + k]
    return []


def generate(target, drafter, pool: KVPool, prompts: list[list[int]], new_tokens: int, k: int,
             together: bool) -> tuple[list[list[int]], int]:  # fmt: skip
    """Each prompt's greedy continuation of new_tokens tokens; returns them and the number of steps run."""
    sessions = [SequenceVerifier(target, drafter, capacity=len(p) + new_tokens + k + 2, pool=pool) for p in prompts]
    try:
        texts = [list(p) for p in prompts]
        outs = [[s.open(p)[0]] for s, p in zip(sessions, prompts, strict=True)]
        steps = 0
        while live := [i for i, o in enumerate(outs) if len(o) < new_tokens]:
            trees = {i: DraftTree.chain(outs[i][-1], prompt_lookup(texts[i] + outs[i], k)) for i in live}
            groups = [live] if together else [[i] for i in live]
            for group in groups:
                results = rounds.verify_batch(target, [(sessions[i], trees[i]) for i in group])
                steps += 1
                for i, result in zip(group, results, strict=True):
                    if isinstance(result, Exception):
                        raise result
                    verdict, _ = result
                    outs[i] += [int(trees[i].tokens[j]) for j in verdict.path[1:]] + [verdict.bonus]
        return [o[:new_tokens] for o in outs], steps
    finally:
        for s in sessions:
            s.release()


def random_target(args: argparse.Namespace) -> tuple[Transformer, Tokenizer]:
    """A `--preset` target with seeded random weights, on the backend `load` would pick (fused on "triton"), and the
    tokenizer of `--model` for the prompts."""
    cfg = preset(args.preset)
    cfg = dataclasses.replace(cfg, n_layers=args.layers or cfg.n_layers,
                              max_seq_len=max(cfg.max_seq_len, 4096))  # fmt: skip
    dtype = DTYPES[args.dtype] if args.dtype else torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    torch.manual_seed(0)
    with torch.device(args.device):
        model = Transformer(cfg).to(dtype).eval()
    model.backend = attention_backend(args.device, args.attention)
    if model.backend == "triton":
        from tether.server.fuse import fuse  # imports the kernels: only where they run

        fuse(model)
    tok = Tokenizer.from_pretrained(args.model)
    if tok.vocab_size > cfg.vocab_size:
        raise SystemExit(f"--preset {args.preset}'s vocabulary ({cfg.vocab_size}) is smaller than the prompts' "
                         f"tokenizer's ({tok.vocab_size})")  # fmt: skip
    return model, tok


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(default_model_dir()))
    ap.add_argument("--drafter", default=str(default_model_dir("drafter")), help='"none": no deltas computed')
    ap.add_argument("--prompts", type=Path, default=ROOT / "deploy/models/prompts/heldout.jsonl")
    ap.add_argument("--sessions", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=200)
    ap.add_argument("--k", type=int, default=5, help="prompt-lookup draft tokens per round (0: plain decoding)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="", help="bfloat16 on CUDA, float32 elsewhere")
    ap.add_argument("--attention", default="auto", help="auto: as serve (Triton, fused, on CUDA); reference")
    ap.add_argument("--kv-pool-mb", type=int, default=2048)
    ap.add_argument("--preset", default="", help="random weights of these shapes (takes --drafter none)")
    ap.add_argument("--layers", type=int, default=0, help="with --preset: keep this many layers (0: all)")
    args = ap.parse_args(argv)
    if args.preset and args.drafter != "none":
        ap.error("--preset takes --drafter none: a drafter is trained for one target")

    target, tok = random_target(args) if args.preset else load(args.model, args.device, args.dtype, args.attention)
    drafter = None if args.drafter == "none" else load_drafter(args.drafter, target,
                                                                target_fingerprint=fingerprint(args.model))  # fmt: skip
    texts = [json.loads(line)["text"] for line in args.prompts.read_text().splitlines() if line.strip()]
    distinct = [tok.encode(t) for t in texts[: args.sessions]]
    prompts = [distinct[i % len(distinct)] for i in range(args.sessions)]
    dtype = target.embed_tokens.weight.dtype
    pool = KVPool.for_budget(target.cfg, args.kv_pool_mb << 20, device=args.device, dtype=dtype)
    with torch.inference_mode():
        t0 = time.perf_counter()
        alone, alone_steps = generate(target, drafter, pool, distinct, args.new_tokens, args.k, together=False)
        t1 = time.perf_counter()
        together, steps = generate(target, drafter, pool, prompts, args.new_tokens, args.k, together=True)
        t2 = time.perf_counter()
    parted = []
    for i, out in enumerate(together):
        ref = alone[i % len(distinct)]
        first = next((j for j, (a, b) in enumerate(zip(out, ref, strict=True)) if a != b), None)
        if first is not None:
            parted.append(first)
    result = {
        "bench": "invariance",
        "model": f"{args.preset} (random weights, {target.cfg.n_layers} layers)" if args.preset else args.model,
        "attention": target.backend,
        "dtype": str(dtype).removeprefix("torch."),
        "sessions": args.sessions,
        "distinct_prompts": len(distinct),
        "new_tokens": args.new_tokens,
        "k": args.k,
        "differ": len(parted),
        "first_difference": min(parted) if parted else None,
        "steps_alone": alone_steps,
        "steps_together": steps,
        "tokens_per_step_together": args.sessions * args.new_tokens / steps,
        "alone_s": t1 - t0,
        "together_s": t2 - t1,
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.machine(),
        "torch": torch.__version__,
    }
    table = Table(title=f"greedy alone vs together: {args.sessions} sessions x {args.new_tokens} tokens, "
                        f"{target.backend} attention, {result['dtype']}")  # fmt: skip
    for col in ("sessions differing", "first difference at token", "steps alone", "steps together", "together s"):
        table.add_column(col, justify="right")
    table.add_row(f"{len(parted)} of {args.sessions}", "-" if not parted else str(min(parted)), str(alone_steps),
                  str(steps), f"{t2 - t1:.1f}")  # fmt: skip
    Console(width=120).print(table)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
