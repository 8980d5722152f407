"""TLI with depth: how closely the MoA drafter's TLI blocks reproduce the target's own last N layers at drafted
positions, by where their depth entries of the target's lower layers come from.

With EXACT inputs, so that only the depth entries differ: at every position of `--windows` held-out windows of
`--seq-len` tokens the TLI blocks get the target's own hidden entering layer L - N, the target's exact K/V of the
earlier positions (as a drafted position right after a verified one has), and as lower depth entries
- empty: none (MoA without a depth predictor);
- predicted: the drafter's depth predictor's, from that hidden and the token (tether.shared.tli_depth; needs
  `--drafter` with tli_depth > 0);
- true: the target's own (a sanity check: top-1 agreement 1.0, relative error at rounding level).
Reported per row: top-1 agreement of the TLI output's logits (target's final norm and head) with the target's own,
and the mean relative error of the TLI output against the target's last hidden state (||h - h*|| / ||h*|| per
position). With `--tau-drafters`, bench/spec.py then measures tau (greedy chain, and its other columns) of those
drafters on held-out prompts, e.g. the same drafter trained with and without a predictor.
Prints a table, then one JSON line.

    python bench/tli_depth.py --drafter runs/moa3-depth --tau-drafters runs/moa3 runs/moa3-depth
    python bench/tli_depth.py --tli 3            # empty and true rows only, no drafter needed
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from tether.server.model_loading import default_model_dir
from tether.server.train.corpus import build_corpus, load_tokens
from tether.server.train.drafter import check_corpus_tokenizer
from tether.shared.checkpoint import fingerprint
from tether.shared.drafter import DrafterConfig
from tether.shared.drafter_loading import build_drafter, load_drafter
from tether.shared.model import Transformer
from tether.shared.tli_depth import lower_entries
from tether.shared.tokenizer import Tokenizer


@torch.inference_mode()
def tli_rows(target: Transformer, drafter, tokens: torch.Tensor) -> dict[str, dict]:
    """tokens [B, T] -> {depth source: {"top1", "rel_err", "positions"}} at every position (module docstring)."""
    L, N = target.cfg.n_layers, drafter.dcfg.tli
    out = target.run(tokens, hidden_layers=(L - N, L), return_kv=True, return_depth=True)
    h_in, h_own = out.hidden
    B, T = tokens.shape
    pos = torch.arange(T, device=tokens.device)
    cos, sin = target.rope(pos[None])
    # Row t sees the target's exact K/V of positions < t, then its own new row: a drafted position after a verified one.
    mask = torch.cat([pos[None, :] < pos[:, None], torch.eye(T, dtype=torch.bool, device=tokens.device)], -1)
    sources: dict[str, tuple | None] = {"empty": (h_in.new_empty(B, T, 0, *out.k.shape[-2:]),) * 2}
    if drafter.depth_predictor is not None:
        sources["predicted"] = None  # run_tli asks the drafter's predictor
    if out.depth is not None:
        E = lower_entries(target.cfg, N)
        sources["true"] = (out.depth[0][:, :, :E], out.depth[1][:, :, :E])
    own_top = out.logits.argmax(-1)
    rows = {}
    for name, lower in sources.items():
        h = drafter.run_tli(h_in, cos, sin, prefix=(out.k[L - N :], out.v[L - N :]), mask=mask, lower=lower,
                            tokens=tokens)  # fmt: skip
        top1 = (target.head(target.norm(h)).argmax(-1) == own_top).float().mean()
        rel = ((h - h_own).float().norm(dim=-1) / h_own.float().norm(dim=-1)).mean()
        rows[name] = {"top1": float(top1), "rel_err": float(rel), "positions": B * T}
    return rows


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, default=default_model_dir())
    ap.add_argument("--drafter", type=Path, default=None, help="MoA drafter directory (its TLI N and predictor)")
    ap.add_argument("--tli", type=int, default=3, help="TLI N when no --drafter is given (the default drafter's)")
    ap.add_argument("--data", type=Path, default=Path("data/corpus"), help="corpus directory with val.bin")
    ap.add_argument("--windows", type=int, default=16, help="held-out windows")
    ap.add_argument("--seq-len", type=int, default=256, help="tokens per window")
    ap.add_argument("--batch-size", type=int, default=8, help="windows per forward")
    ap.add_argument("--tau-drafters", type=Path, nargs="*", default=[], help="drafters whose tau bench/spec.py takes")
    ap.add_argument("--tau-prompts", type=int, default=16, help="held-out prompts for bench/spec.py")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)

    # fp32 everywhere: the true-depth row is a check that must come out at rounding level.
    target = Transformer.from_pretrained(args.target, device=args.device, dtype=torch.float32).eval()
    if args.drafter is not None:
        drafter = load_drafter(args.drafter, target, target_fingerprint=fingerprint(args.target)).float()
        if drafter.dcfg.kind != "moa" or not drafter.dcfg.tli:
            raise SystemExit(f"{args.drafter} is not a MoA drafter with TLI N >= 1")
    else:  # the TLI blocks are the target's own: an untrained drafter runs them the same
        drafter = build_drafter(target, DrafterConfig(kind="moa", tli=args.tli)).to(args.device).eval()
    if not (args.data / "val.bin").exists():
        build_corpus(args.data, tokenizer=Tokenizer.from_pretrained(args.target))
    check_corpus_tokenizer(args.target, args.data)  # ids from another tokenizer would be other text
    val = load_tokens(args.data, "val")
    starts = np.linspace(0, len(val) - args.seq_len - 1, args.windows).astype(np.int64)
    windows = torch.from_numpy(np.stack([val[s : s + args.seq_len] for s in starts]).astype(np.int64))
    totals: dict[str, dict] = {}
    for chunk in windows.split(args.batch_size):
        for name, r in tli_rows(target, drafter, chunk.to(args.device)).items():
            t = totals.setdefault(name, {"top1": 0.0, "rel_err": 0.0, "positions": 0})
            for key in ("top1", "rel_err"):
                t[key] += r[key] * r["positions"]
            t["positions"] += r["positions"]
    rows = {name: {"top1": t["top1"] / t["positions"], "rel_err": t["rel_err"] / t["positions"],
                   "positions": t["positions"]} for name, t in totals.items()}  # fmt: skip

    name = args.drafter.name if args.drafter is not None else f"(TLI {args.tli}, no drafter)"
    table = Table(title=f"TLI {drafter.dcfg.tli} vs the target's own last layers, exact inputs, {name}")
    for col in ("lower depth entries", "top-1 agreement", "relative error", "positions"):
        table.add_column(col, justify="right")
    for source, r in rows.items():
        table.add_row(source, f"{r['top1']:.4f}", f"{r['rel_err']:.3g}", str(r["positions"]))
    Console(width=120).print(table)
    result = {
        "bench": "tli_depth",
        "device": args.device,
        "torch": torch.__version__,
        "target": args.target.name,
        "drafter": name,
        "tli": drafter.dcfg.tli,
        "tli_depth": drafter.dcfg.tli_depth,
        "windows": args.windows,
        "seq_len": args.seq_len,
        "rows": rows,
    }
    if args.tau_drafters:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import spec  # bench/spec.py: tau is measured there, once

        measured = spec.main([
            "--target", str(args.target), "--drafters", *map(str, args.tau_drafters), "--data", str(args.data),
            "--prompts", str(args.tau_prompts), "--offline", "32", "--tree", "", "--device", args.device,
        ])  # fmt: skip
        result["tau"] = {Path(p).name: r["tau"] for p, r in zip(args.tau_drafters, measured["drafters"], strict=True)}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
