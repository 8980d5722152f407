"""Wire codecs on real payloads: compression ratio, encode/decode throughput, and INT8's error.

The payloads are the ones tether actually sends, in bf16 (the wire dtype):
- the MoA delta of a `--tokens`-token prefill: lsa [n, dim], tli_k / tli_v [N, n, Hkv, D];
- per-round deltas: the same states cut into `--round`-token rounds (what follows each verification),
  each sent as one encode_many bundle, so the framing overhead of small messages is counted;
- the target's weights (its state_dict, tied tensors once).
The text is the source of a standard-library module (`--module`, default json.decoder), tokenized with the
target's tokenizer. Each codec is compared with plain zstd at the same level on the unshuffled bytes, the
reference that shows what the byte-plane shuffle buys. Ratio = raw bf16 bytes / framed bytes; MB/s counts
raw bytes; decode includes parsing the frame; INT8 error = ||x - decode(x)|| / ||x||.
Prints a table, then one JSON line.

    python bench/delta_codecs.py
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch
import zstandard
from rich.console import Console
from rich.table import Table

from tether.server.engine import target_states
from tether.server.model_loading import default_model_dir
from tether.shared.codecs import Codec, EncodedTensor, decode, decode_many, encode, encode_many
from tether.shared.drafter_loading import load_drafter
from tether.shared.model import Transformer
from tether.shared.tokenizer import Tokenizer

PLAIN_ZSTD = "zstd, no shuffle"


def best_time(fn: Callable[[], object], min_seconds: float) -> float:
    """Best wall time of repeated calls (at least 3, and at least `min_seconds` in all)."""
    best, spent, calls = float("inf"), 0.0, 0
    while calls < 3 or spent < min_seconds:
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        best, spent, calls = min(best, dt), spent + dt, calls + 1
    return best


def rel_error(items: list[torch.Tensor], decoded: list[torch.Tensor]) -> float:
    num = sum(float((a.float() - b.float()).pow(2).sum()) for a, b in zip(items, decoded, strict=True))
    den = sum(float(a.float().pow(2).sum()) for a in items)
    return (num / den) ** 0.5 if den else 0.0


def measure_tensors(name: str, items: list[torch.Tensor], codec: Codec | str, level: int, min_s: float) -> dict:
    """Encode each tensor on its own (one frame each) and total the bytes."""
    raw = sum(t.numel() * t.element_size() for t in items)
    if codec == PLAIN_ZSTD:
        cctx, dctx = zstandard.ZstdCompressor(level=level), zstandard.ZstdDecompressor()
        blobs = [t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() for t in items]
        frames = [cctx.compress(b) for b in blobs]
        enc = best_time(lambda: [cctx.compress(b) for b in blobs], min_s)
        dec = best_time(lambda: [dctx.decompress(f) for f in frames], min_s)
        encoded, err = sum(map(len, frames)), 0.0
    else:
        frames = [encode(t, codec, level=level).to_bytes() for t in items]
        enc = best_time(lambda: [encode(t, codec, level=level).to_bytes() for t in items], min_s)
        dec = best_time(lambda: [decode(EncodedTensor.from_bytes(f)) for f in frames], min_s)
        encoded = sum(map(len, frames))
        err = rel_error(items, [decode(EncodedTensor.from_bytes(f)) for f in frames])
    return row(name, items, codec, raw, encoded, enc, dec, err, len(items))


def measure_bundles(name: str, rounds: list[dict[str, torch.Tensor]], codec: Codec, level: int, min_s: float) -> dict:
    """One encode_many bundle per round, as the server would send it."""
    items = [t for r in rounds for t in r.values()]
    raw = sum(t.numel() * t.element_size() for t in items)
    bundles = [encode_many(r, codec, level=level) for r in rounds]
    enc = best_time(lambda: [encode_many(r, codec, level=level) for r in rounds], min_s)
    dec = best_time(lambda: [decode_many(b) for b in bundles], min_s)
    err = rel_error(items, [t for b in bundles for t in decode_many(b).values()])
    return row(name, items, codec, raw, sum(map(len, bundles)), enc, dec, err, len(rounds))


def row(name, items, codec, raw, encoded, enc, dec, err, messages) -> dict:
    shapes = sorted({tuple(t.shape) for t in items}, key=str)
    return {
        "data": name,
        "codec": codec if isinstance(codec, str) else codec.name,
        "shape": [list(s) for s in shapes] if len(shapes) <= 3 else f"{len(items)} tensors",
        "messages": messages,
        "raw_bytes": raw,
        "encoded_bytes": encoded,
        "bytes_per_message": encoded / messages,
        "ratio": raw / encoded,
        "encode_MBps": raw / enc / 1e6,
        "decode_MBps": raw / dec / 1e6,
        "rel_error": err,
    }


@torch.inference_mode()
def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, default=default_model_dir())
    ap.add_argument("--drafter", type=Path, default=default_model_dir("drafter"))
    ap.add_argument("--module", default="json.decoder", help="standard-library module whose source is the text")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--round", type=int, default=4, help="tokens verified per round (per-round delta size)")
    ap.add_argument("--level", type=int, default=3, help="zstd level")
    ap.add_argument("--min-seconds", type=float, default=0.2, help="timing budget per measurement")
    args = ap.parse_args(argv)

    t_start = time.perf_counter()
    target = Transformer.from_pretrained(args.target, dtype=torch.float32)
    drafter = load_drafter(args.drafter, target)
    text = inspect.getsource(importlib.import_module(args.module))
    ids = Tokenizer.from_pretrained(args.target).encode(text)[: args.tokens]
    n = len(ids)
    out = target.run(torch.tensor([ids]), hidden_layers=(target.cfg.n_layers,), return_kv=True)
    states = target_states(out)
    wire = torch.bfloat16
    delta = {k: v.to(wire) for k, v in drafter.server_delta(states, 0, ids).tensors.items()}
    rounds = []
    for s in range(0, n - args.round + 1, args.round):
        d = drafter.server_delta(states.select(list(range(s, s + args.round))), s, ids[s : s + args.round])
        rounds.append({k: v.to(wire) for k, v in d.tensors.items()})
    seen, weights = set(), []
    for t in target.state_dict().values():
        if t.data_ptr() not in seen:  # tied embeddings appear under two names
            seen.add(t.data_ptr())
            weights.append(t.to(wire))

    codecs: list[Codec | str] = [Codec.RAW, PLAIN_ZSTD, *(c for c in Codec if c != Codec.RAW)]
    results = []
    for key, t in delta.items():
        for c in codecs:
            results.append(measure_tensors(f"prefill {key}", [t], c, args.level, args.min_seconds))
    for c in codecs:
        results.append(measure_tensors("prefill weights", weights, c, args.level, args.min_seconds))
    for c in codecs:
        if c != PLAIN_ZSTD:
            results.append(measure_bundles(f"round of {args.round} tokens", rounds, c, args.level, args.min_seconds))

    table = Table(title=f"wire codecs: {n} tokens of {args.module}, bf16, zstd level {args.level}")
    for col in ("data", "codec", "shape", "msgs", "raw", "encoded", "B/msg", "ratio", "enc MB/s", "dec MB/s", "err"):
        table.add_column(col, justify="left" if col in ("data", "codec", "shape") else "right")
    last = None
    for r in results:
        if last is not None and r["data"] != last:
            table.add_section()
        last = r["data"]
        table.add_row(r["data"], r["codec"], str(r["shape"]), str(r["messages"]), f"{r['raw_bytes']:,}",
                      f"{r['encoded_bytes']:,}", f"{r['bytes_per_message']:,.0f}", f"{r['ratio']:.3f}",
                      f"{r['encode_MBps']:.0f}", f"{r['decode_MBps']:.0f}",
                      f"{r['rel_error']:.2e}" if r["rel_error"] else "0")  # fmt: skip
    Console(width=170).print(table)
    result = {
        "bench": "codecs",
        "machine": platform.machine(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "zstandard": zstandard.__version__,
        "module": args.module,
        "tokens": n,
        "round": args.round,
        "level": args.level,
        "wire_dtype": str(wire).removeprefix("torch."),
        "seconds": time.perf_counter() - t_start,
        "results": results,
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
