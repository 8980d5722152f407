"""Bytes on the wire per verified token, by part and codec, and what each lossy codec costs in draft quality.

For the trained `--target` and its MoA `--drafter` (default: the shipped pair) on `--prompts` held-out prompts
(deploy/models/prompts/heldout.jsonl, the first `--n-prompts`), the target's greedy continuation of `--new-tokens`
is drafted with chains of `--k`; every round's delta is recorded as the server sends it (bfloat16), so the sizes
are of real rounds with the real tokens per round. For each codec (`--codecs`, tether.shared.wire's names):
- sizes: bytes per verified token of each part (the LSA vectors; each TLI layer's K and V; MoDA depth entries do
  not travel: the client predicts them, tether.shared.tli_depth), and of the framing (bundle, frame and zstd
  headers and the KVDelta message around them: the message's size less the parts). A part's figure is its
  payload and scales when encoded as a frame of its own, exact for RAW and the grouped codecs, close for the zstd
  ones. "raw bf16" is the tensors' own bytes, the reference of the issue's targets; `ratio` = bytes / raw bf16.
  The same for an 86M-shaped target (`medium` preset, TLI 4 as its recipe) and a Llama-3-8B-shaped one (TLI 3):
  their deltas are Gaussian values of those shapes with the same tokens per round (sizes only: the fixed-size
  codecs' figures are exact at any values, zstd's depend on them);
- resync: the bytes of one Resync reply's delta for `--resync` offline tokens (the server re-sends only the
  positions the client produced alone: tether.server.resync truncates to the client's verified length first);
- quality (`--quality`): tau of the same chains with every delta decoded through the codec before the drafter takes
  it, the offline agreement (the drafter alone for `--offline` tokens after the prompt, mean over positions)
  likewise, both against FP16_SHUFFLE_ZSTD (lossless: the bfloat16 the server sends). Every output is checked
  against plain greedy decoding (the run fails if one differs: greedy output is the target's whatever the codec).
  tau moves a few percent from run to run of different rounds, so the codecs are also compared paired: during the
  lossless run a shadow drafter per codec takes the same deltas through its codec and drafts from the same roots;
  `same 1st draft` is the share of rounds whose first draft token equals the lossless drafter's, `same drafts` the
  share of draft tokens before the first difference;
- entropy: zstd on each grouped codec's packed symbols against the packed bytes, and how far delta coding along
  tokens would shrink each tensor's variance (var(x[t] - x[t-1]) / var(x[t]) on the prompts' contiguous deltas).
The models run in float32 on `--device` (default: the CPU); the deltas are recorded and encoded on the CPU, as
the server sends them. Prints tables, then one JSON line. On a shared CPU run it with OMP_NUM_THREADS=1.

    OMP_NUM_THREADS=1 python bench/wire_bytes.py --quality
    python bench/wire_bytes.py --quality --device cuda --target runs/86m/medium --drafter runs/86m/drafters/moa4
    python bench/wire_bytes.py --n-prompts 4 --new-tokens 32        # sizes only, quick

Tested by tests/server/test_bench_wire_bytes.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch
import zstandard
from rich.console import Console
from rich.table import Table

from tether.server.engine import SpeculativeEngine, target_states
from tether.server.model_loading import default_model_dir
from tether.shared.codecs import Codec, decode_many, encode_many
from tether.shared.config import preset
from tether.shared.drafter import DraftDelta
from tether.shared.drafter_config import POSITION_AXIS
from tether.shared.drafter_loading import load_drafter
from tether.shared.model import Transformer
from tether.shared.tokenizer import Tokenizer
from tether.shared.wire import parse_many
from tether.shared.wire_codecs import GROUPED_BITS
from tether.v1 import tether_pb2 as pb

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_PROMPTS = ROOT / "deploy/models/prompts/heldout.jsonl"
LOSSLESS = Codec.FP16_SHUFFLE_ZSTD
Round = dict[str, torch.Tensor]  # one delta's bf16 tensors: "lsa" [n, dim], "tli_k" / "tli_v" [N, n, Hkv, D]


class WireDrafter:
    """A drafter whose deltas travel as the server sends them: bfloat16, encoded with `codec`, decoded. It records
    each delta's bf16 tensors (the prompts' and the rounds' apart) and counts the encoded bytes of the rounds."""

    def __init__(self, drafter, codec: Codec):
        self.drafter, self.codec = drafter, codec
        self.prompts: list[Round] = []
        self.rounds: list[Round] = []
        self.round_bytes = 0

    def __getattr__(self, name: str):  # draft, draft_tree, server_delta, ...: the drafter's own
        return getattr(self.drafter, name)

    def _wire(self, delta: DraftDelta, record: list[Round]) -> tuple[DraftDelta, int]:
        sent = {k: t.to("cpu", torch.bfloat16) for k, t in delta.tensors.items()}
        record.append(sent)
        data = encode_many(sent, self.codec)
        got = decode_many(data)
        tensors = {k: got[k].to(t.device, t.dtype) for k, t in delta.tensors.items()}
        return dataclasses.replace(delta, tensors=tensors), len(data)

    def begin(self, delta: DraftDelta, capacity: int):
        return self.drafter.begin(self._wire(delta, self.prompts)[0], capacity)

    def commit(self, delta: DraftDelta, **kwargs):
        delta, nbytes = self._wire(delta, self.rounds)
        self.round_bytes += nbytes
        return self.drafter.commit(delta, **kwargs)


class ShadowedDrafter(WireDrafter):
    """A WireDrafter that also feeds each shadow (a WireDrafter over its own copy of the drafter, with its own codec)
    the same deltas and, at each round, drafts with it from the same root: how often the shadow's chain equals the
    one this drafter sent, paired round by round, so that the codec's effect is not lost in the noise of tau."""

    def __init__(self, drafter, codec: Codec, shadows: list[WireDrafter]):
        super().__init__(drafter, codec)
        self.shadows = shadows
        # per shadow: rounds whose first draft matched, drafts matched before the first difference, drafts, rounds
        self.agree = {s.codec.name: [0, 0, 0, 0] for s in shadows}

    def begin(self, delta: DraftDelta, capacity: int):
        for s in self.shadows:
            s.begin(delta, capacity)
        return super().begin(delta, capacity)

    def commit(self, delta: DraftDelta, **kwargs):
        for s in self.shadows:
            s.commit(delta, **kwargs)
        return super().commit(delta, **kwargs)

    def draft(self, root: int, k: int, **controls):
        out = self.drafter.draft(root, k, **controls)
        for s in self.shadows:
            theirs = s.draft(root, k, **controls)[0]
            same = next((i for i, (a, b) in enumerate(zip(out[0], theirs, strict=True)) if a != b), len(theirs))
            counts = self.agree[s.codec.name]
            counts[0] += same > 0
            counts[1] += same
            counts[2] += len(theirs)
            counts[3] += 1
        return out


def n_of(r: Round) -> int:
    return r["lsa"].shape[POSITION_AXIS["lsa"]]


def kv_message(data: bytes, n: int) -> int:
    """The KVDelta message's size around a bundle of n positions (start and token ids as a session's would be)."""
    return pb.KVDelta(start=300, tokens=[4000] * n, payload=data).ByteSize()


def part_bytes(t: torch.Tensor, codec: Codec) -> int:
    """Payload and scales of `t` as a frame of its own."""
    f = parse_many(encode_many({"x": t}, codec))["x"]
    return len(f.payload) + len(f.scales)


def sizes(rounds: list[Round], codec: Codec) -> dict:
    """Bytes per verified token of each part, the framing and the whole, over `rounds` sent with `codec`."""
    tokens = sum(n_of(r) for r in rounds)
    parts: dict[str, int] = {}
    total = raw = 0
    for r in rounds:
        total += kv_message(encode_many(r, codec), n_of(r))
        raw += sum(t.numel() * 2 for t in r.values())
        parts["lsa"] = parts.get("lsa", 0) + part_bytes(r["lsa"], codec)
        for name in ("tli_k", "tli_v"):
            for i in range(r[name].shape[0]):
                key = f"{name[-1].upper()}{i}"  # K0, V0, ...: the TLI layers from the first
                parts[key] = parts.get(key, 0) + part_bytes(r[name][i], codec)
    return {
        "codec": codec.name,
        "tokens": tokens,
        "raw_bf16": raw / tokens,
        "parts": {k: v / tokens for k, v in parts.items()},
        "framing": (total - sum(parts.values())) / tokens,
        "total": total / tokens,
        "ratio": total / raw,
    }


def synthetic(rounds: list[Round], dim: int, tli: int, kv_heads: int, head_dim: int) -> list[Round]:
    """Gaussian deltas of a target's shapes, one per real round with its tokens."""
    g = torch.Generator().manual_seed(0)
    kv = (tli, 0, kv_heads, head_dim)
    out = []
    for r in rounds:
        n = n_of(r)
        shapes = {"lsa": (n, dim), "tli_k": (*kv[:1], n, *kv[2:]), "tli_v": (*kv[:1], n, *kv[2:])}
        out.append({k: torch.randn(shape, generator=g).bfloat16() for k, shape in shapes.items()})
    return out


def resync_bytes(prompts: list[Round], tokens: int, codec: Codec) -> int | None:
    """One Resync reply's delta for `tokens` offline tokens (a prompt long enough stands in for their states)."""
    for p in prompts:
        if n_of(p) >= tokens:
            piece = {k: t.narrow(POSITION_AXIS[k], 0, tokens) for k, t in p.items()}
            return kv_message(encode_many(piece, codec), tokens)
    return None


def entropy(rounds: list[Round], prompts: list[Round]) -> dict:
    """zstd on the grouped codecs' packed symbols over the packed bytes; the variance left by delta coding along
    tokens over the tensor's own (1 or more: delta coding would not pay)."""
    cctx = zstandard.ZstdCompressor(level=3)
    zstd_over_packed = {}
    for codec in GROUPED_BITS:
        payloads = [f.payload for r in rounds for f in parse_many(encode_many(r, codec)).values()]
        zstd_over_packed[codec.name] = sum(len(cctx.compress(p)) for p in payloads) / sum(map(len, payloads))
    variance = {}
    for name, axis in POSITION_AXIS.items():
        xs = [p[name].float() for p in prompts if name in p and n_of(p) > 1]
        if xs:
            d2 = sum(float(x.diff(dim=axis).pow(2).sum()) for x in xs) / sum(x.diff(dim=axis).numel() for x in xs)
            x2 = sum(float(x.pow(2).sum()) for x in xs) / sum(x.numel() for x in xs)
            variance[name] = d2 / x2
    return {"zstd_over_packed": zstd_over_packed, "token_delta_variance": variance}


def chains(target, drafter, prompts, references, codec: Codec, k: int, new_tokens: int, offline: int, shadows=()):
    """tau and offline agreement with every delta through `codec`, and the WireDrafter that saw the chains' deltas
    (a ShadowedDrafter over `shadows` if any). Raises AssertionError if an output is not the target's own greedy
    continuation."""
    wired = ShadowedDrafter(drafter, codec, list(shadows)) if shadows else WireDrafter(drafter, codec)
    engine = SpeculativeEngine(target, wired, k=k)
    taus = []
    for p, ref in zip(prompts, references, strict=True):
        if [t for c in engine.generate(p, new_tokens) for t in c] != ref:
            raise AssertionError(f"{codec.name}: speculative greedy output differs from plain greedy decoding")
        taus += engine.stats.taus
    hits = np.zeros(offline)
    probe = WireDrafter(drafter, codec)
    for p, ref in zip(prompts, references, strict=True):
        out = target.run(torch.tensor([p], device=target.device), hidden_layers=(target.cfg.n_layers,), return_kv=True)
        probe.begin(drafter.server_delta(target_states(out), 0, p), len(p) + offline + 2)
        drafts, _, _ = probe.draft(ref[0], offline)
        hits += np.array(drafts[:offline]) == np.array(ref[1 : offline + 1])
    figures = {
        "codec": codec.name,
        "tau": float(np.mean(taus)),
        "offline_agreement": float(hits.mean() / len(prompts)),
        "round_bytes_per_token": wired.round_bytes / sum(n_of(r) for r in wired.rounds),
    }
    return figures, wired


def size_table(title: str, rows: list[dict]) -> Table:
    table = Table(title=title)
    parts = list(rows[0]["parts"])
    for col in ("codec", *parts, "framing", "total B/token", "raw bf16", "ratio"):
        table.add_column(col, justify="left" if col == "codec" else "right")
    for r in rows:
        table.add_row(
            r["codec"],
            *[f"{r['parts'][p]:,.1f}" for p in parts],
            f"{r['framing']:,.1f}",
            f"{r['total']:,.1f}",
            f"{r['raw_bf16']:,.0f}",
            f"{r['ratio']:.3f}",
        )
    return table


@torch.inference_mode()
def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, default=default_model_dir())
    ap.add_argument("--drafter", type=Path, default=default_model_dir("drafter"), help="a MoA drafter of --target")
    ap.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS, help="JSONL from bench/heldout_prompts.py")
    ap.add_argument("--n-prompts", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=5, help="draft tokens per chain round")
    ap.add_argument("--offline", type=int, default=32, help="offline agreement over this many tokens")
    ap.add_argument("--resync", type=int, nargs="*", default=[16, 64], help="offline tokens per resync measured")
    ap.add_argument("--codecs", nargs="*", default=[c.name for c in Codec], choices=[c.name for c in Codec])
    ap.add_argument("--quality", action="store_true", help="tau and offline agreement through every lossy codec")
    ap.add_argument("--device", default="cpu", help="where the target and the drafters run (float32)")
    args = ap.parse_args(argv)
    args.offline = min(args.offline, args.new_tokens - 1)  # the reference continuation is what it is checked on

    t_start = time.perf_counter()
    codecs = [Codec[name] for name in args.codecs]
    target = Transformer.from_pretrained(args.target, device=args.device, dtype=torch.float32)
    drafter = load_drafter(args.drafter, target)
    if drafter.dcfg.kind != "moa":
        raise SystemExit(f"{args.drafter} is a {drafter.dcfg.kind} drafter; this bench measures MoA deltas")
    tokenizer = Tokenizer.from_pretrained(args.target)
    lines = [line for line in args.prompts.read_text(encoding="utf-8").splitlines() if line.strip()]
    prompts = [tokenizer.encode(json.loads(line)["text"]) for line in lines[: args.n_prompts]]
    plain = SpeculativeEngine(target, None)
    references = [[t for c in plain.generate(p, args.new_tokens) for t in c] for p in prompts]

    run = (target, drafter, prompts, references)
    lossy = [c for c in codecs if c not in (LOSSLESS, Codec.RAW)] if args.quality else []  # RAW is lossless too
    shadows = [WireDrafter(load_drafter(args.drafter, target), c) for c in lossy]
    lossless, wired = chains(*run, LOSSLESS, args.k, args.new_tokens, args.offline, shadows)
    quality = [lossless]
    if args.quality:
        for codec in lossy:
            figures, _ = chains(*run, codec, args.k, args.new_tokens, args.offline)
            first, same, made, calls = wired.agree[codec.name]
            figures["first_draft_agreement"] = first / calls
            figures["draft_agreement"] = same / made
            figures["tau_loss"] = 1 - figures["tau"] / lossless["tau"]
            figures["offline_loss"] = 1 - figures["offline_agreement"] / max(lossless["offline_agreement"], 1e-9)
            print(json.dumps(figures), file=sys.stderr, flush=True)
            quality.append(figures)

    rounds = wired.rounds
    cfg, tli = target.cfg, drafter.dcfg.tli
    m, big = preset("medium"), preset("llama3-8b")
    shapes = {
        f"{args.target.name} (trained, dim {cfg.dim}, TLI {tli} x {cfg.n_kv_heads} x {cfg.head_dim})": rounds,
        f"86M-shaped (medium, dim {m.dim}, TLI 4 x {m.n_kv_heads} x {m.head_dim}; Gaussian values)": synthetic(
            rounds, m.dim, 4, m.n_kv_heads, m.head_dim
        ),
        f"8B-shaped (llama3-8b, dim {big.dim}, TLI 3 x {big.n_kv_heads} x {big.head_dim}; Gaussian values)": synthetic(
            rounds, big.dim, 3, big.n_kv_heads, big.head_dim
        ),
    }
    size_rows = {name: [sizes(rs, c) for c in codecs] for name, rs in shapes.items()}
    resync = {c.name: {str(g): resync_bytes(wired.prompts, g, c) for g in args.resync} for c in codecs}

    console = Console(width=200)
    tokens = sum(n_of(r) for r in rounds)
    for name, rows in size_rows.items():
        title = f"bytes per verified token: {name}; {len(rounds)} rounds, {tokens} tokens (k={args.k})"
        console.print(size_table(title, rows))
    table = Table(title=f"quality against {LOSSLESS.name}: {len(prompts)} held-out prompts, {args.new_tokens} tokens")
    columns = (
        "codec",
        "round B/token",
        "ratio",
        "tau",
        "tau loss",
        f"offline agree@{args.offline}",
        "loss",
        "same 1st draft",
        "same drafts",
    )
    for col in columns:
        table.add_column(col, justify="left" if col == "codec" else "right")
    raw_per_token = size_rows[next(iter(size_rows))][0]["raw_bf16"]
    for q in quality:
        table.add_row(
            q["codec"],
            f"{q['round_bytes_per_token']:,.1f}",
            f"{q['round_bytes_per_token'] / raw_per_token:.3f}",
            f"{q['tau']:.3f}",
            f"{q.get('tau_loss', 0):+.2%}",
            f"{q['offline_agreement']:.3f}",
            f"{q.get('offline_loss', 0):+.2%}",
            f"{q.get('first_draft_agreement', 1):.3f}",
            f"{q.get('draft_agreement', 1):.3f}",
        )
    console.print(table)
    table = Table(title="bytes of one resync reply's delta, by offline tokens")
    table.add_column("codec")
    for g in args.resync:
        table.add_column(str(g), justify="right")
    for c, row in resync.items():
        table.add_row(c, *[f"{v:,}" if v is not None else "-" for v in row.values()])
    console.print(table)
    ent = entropy(rounds, wired.prompts)
    console.print(
        f"entropy coding: zstd / packed symbols {ent['zstd_over_packed']}; "
        f"delta coding along tokens, var(diff) / var: {ent['token_delta_variance']}"
    )

    result = {
        "bench": "wire_bytes",
        "machine": platform.machine(),
        "device": torch.cuda.get_device_name() if target.device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "zstandard": zstandard.__version__,
        "target": str(args.target),
        "drafter": str(args.drafter),
        "prompts": len(prompts),
        "new_tokens": args.new_tokens,
        "k": args.k,
        "rounds": len(rounds),
        "sizes": size_rows,
        "quality": quality,
        "resync": resync,
        "entropy": ent,
        "seconds": time.perf_counter() - t_start,
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
