"""Skinny linear layers on the GPU: tether.kernels.linear against cuBLAS (F.linear) at a verify step's row counts.

For each weight of a `--preset` target (default Llama-3-8B shapes, bf16, random values: qkv, o_proj + residual,
gate_up + SiLU x up, down_proj + residual, the LM head) and each row count M in `--rows` (8: one row of k = 8; 64:
eight), the GPU time of one call replayed from a CUDA graph, three ways:
- cuBLAS: F.linear alone;
- cuBLAS + epilogue: what the unfused model runs (F.linear then the residual add, or then the SiLU x up kernel);
- ours: tether.kernels.linear with the epilogue inside (autotuned; the chosen tile is printed).
Each call reads a different copy of the weight (copies cycled past the 50 MB L2), so nothing is served from cache.
Reported: microseconds, the weights' read bandwidth (GB/s) and that over the device-to-device copy bandwidth
measured in the same run (the yardstick the step's HBM roofline uses), and the sum over one layer plus the head.
Prints the table, then one JSON line.

    python bench/linear.py
    python bench/linear.py --rows 8 --preset llama3-8b
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

from tether.kernels.linear import counters_needed, linear, linear_fwd_kernel_autotuned
from tether.kernels.pointwise import silu_mul
from tether.shared.config import preset

L2_BYTES = 64 << 20  # at least this many bytes of weight copies per shape: H200's L2 is 50 MB


def load_kernels_bench():
    """bench/moda_kernels.py as a module (bench/ is no package), for its CUDA-graph timer and copy bandwidth."""
    if "tether_bench_kernels" not in sys.modules:
        path = Path(__file__).resolve().parent / "moda_kernels.py"
        spec = importlib.util.spec_from_file_location("tether_bench_kernels", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules["tether_bench_kernels"] = module
        spec.loader.exec_module(module)
    return sys.modules["tether_bench_kernels"]


def shapes(name: str) -> list[tuple[str, int, int, str]]:
    """(label, weight rows, K, epilogue) of one layer's projections and the head; epilogue in none/residual/gated."""
    c = preset(name)
    qkv = (c.n_heads + 2 * c.n_kv_heads) * c.head_dim
    return [
        ("qkv", qkv, c.dim, "none"),
        ("o_proj + residual", c.dim, c.n_heads * c.head_dim, "residual"),
        ("gate_up + SiLU x up", 2 * c.ffn_dim, c.dim, "gated"),
        ("down_proj + residual", c.dim, c.ffn_dim, "residual"),
        ("lm_head", c.vocab_size, c.dim, "none"),
    ]


def measure(rows: int, n: int, k: int, epilogue: str, graph_timed) -> dict:
    dev, dt = torch.device("cuda"), torch.bfloat16
    wbytes = n * k * 2
    copies = max(2, -(-L2_BYTES // wbytes))
    ws = [torch.randn(n, k, device=dev, dtype=dt) * k**-0.5 for _ in range(copies)]
    x = torch.randn(rows, k, device=dev, dtype=dt)
    n_out = n // 2 if epilogue == "gated" else n
    res = torch.randn(rows, n_out, device=dev, dtype=dt)
    counters = torch.zeros(counters_needed(n_out), dtype=torch.int32, device=dev)
    it = iter(range(1 << 62))

    def w():
        return ws[next(it) % copies]

    def cublas():
        return F.linear(x, w())

    def unfused():
        y = F.linear(x, w())
        return silu_mul(y) if epilogue == "gated" else (res + y if epilogue == "residual" else y)

    def ours():
        kw = {"gated": True} if epilogue == "gated" else ({"residual": res} if epilogue == "residual" else {})
        return linear(x, w(), **kw, counters=counters)

    # Same values through both paths before timing anything.
    got, want = ours().float(), unfused().float()
    err = ((got - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt()).item()
    reps = copies * max(1, 8 // copies)
    t = {name: graph_timed(fn, reps=reps) * 1e3 for name, fn in (("cublas", cublas), ("unfused", unfused),
                                                                   ("ours", ours))}  # fmt: skip
    key = (n_out, k, max(16, 1 << (rows - 1).bit_length()), epilogue == "gated")
    best = next((str(c) for kk, c in linear_fwd_kernel_autotuned.cache.items() if tuple(kk[:4]) == key), "?")
    return {"rows": rows, "n": n, "k": k, "epilogue": epilogue, "weight_mb": wbytes / 2**20, "rel_err": err,
            "us": t, "gb_s": {name: wbytes / (us * 1e-6) / 1e9 for name, us in t.items()}, "config": best}  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="llama3-8b")
    ap.add_argument("--rows", type=int, nargs="+", default=[8, 64])
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench/linear.py needs a CUDA GPU")
    kb = load_kernels_bench()
    copy_gb_s = kb.copy_bandwidth()
    results = []
    for rows in args.rows:
        for label, n, k, epi in shapes(args.preset):
            results.append({"label": label} | measure(rows, n, k, epi, kb.graph_timed))
    table = Table(title=f"skinny linear, {args.preset} shapes, bf16; copy bandwidth {copy_gb_s:,.0f} GB/s")
    for col in ("M", "weight", "MB", "cuBLAS us", "cuBLAS+epi us", "ours us", "ours GB/s", "ours / copy BW",
                "cuBLAS / copy BW", "err", "tile"):  # fmt: skip
        table.add_column(col)
    for r in results:
        table.add_row(str(r["rows"]), r["label"], f"{r['weight_mb']:.0f}", f"{r['us']['cublas']:.1f}",
                      f"{r['us']['unfused']:.1f}", f"{r['us']['ours']:.1f}", f"{r['gb_s']['ours']:,.0f}",
                      f"{r['gb_s']['ours'] / copy_gb_s:.2f}", f"{r['gb_s']['cublas'] / copy_gb_s:.2f}",
                      f"{r['rel_err']:.1e}", r["config"])  # fmt: skip
    Console().print(table)
    layer = {}
    for rows in args.rows:
        sel = [r for r in results if r["rows"] == rows]
        layer[rows] = {name: sum(r["us"][name] for r in sel if r["label"] != "lm_head") for name in ("unfused", "ours")}
        print(f"M={rows}: one layer's projections {layer[rows]['unfused']:.0f} us unfused (cuBLAS + epilogues) -> "
              f"{layer[rows]['ours']:.0f} us ours")  # fmt: skip
    record = {"bench": "linear", "preset": args.preset, "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "copy_gb_s": copy_gb_s, "results": results, "layer_us": layer}  # fmt: skip
    print(json.dumps(record))
    return record


if __name__ == "__main__":
    main()
