"""MoDA Triton kernels against torch's SDPA backends on the GPU: prefill time and verify bandwidth.

Prefill (B=1, Hq=32, Hkv=8, D=128, bf16, causal): for T in `--prefill-t`, torch SDPA with the flash (FA2) and
cuDNN backends without depth, our `moda_attention` without depth (L=0), and with depth L in `--depths`
(the MoDA work on top). Reported: median ms, TFLOP/s of the causal sequence part (4*Hq*T^2*D/2 FLOPs; depth adds
4*Hq*T*L*D), and our time over SDPA flash's at the same T (the target: MoDA L=32 at T=64K <= 1.00x).
Verify (one layer of the paged pool, block size 16, bf16): k new tokens (`--verify-k`) against contexts of
`--contexts` tokens, depth L=32, one sequence: the kernels' GPU time (calls replayed from a CUDA graph) and the
achieved HBM bandwidth (the cache's K/V bytes read over that time), next to the device-to-device copy bandwidth
measured in the same run (the target: k=8 at 32K >= 70% of it); and the eager time per call, host work included.
Prints the tables, then one JSON line.

    python bench/moda_kernels.py
    python bench/moda_kernels.py --prefill-t 4096 --contexts 32768 --depths 32        # a quick look
    python bench/moda_kernels.py --prefill-t --contexts 32768 --verify-k 8 --verify-tiles 64,4,3 128,4,2 \
        --verify-splits 17 33 49                                                 # tune the verify tiles
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table
from torch.nn.attention import SDPBackend, sdpa_kernel


def timed(fn, warmup: int = 3, iters: int = 10) -> float:
    """Median milliseconds of fn() over `iters` runs (CUDA events)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def graph_timed(fn, reps: int = 20, iters: int = 10) -> float:
    """Median GPU milliseconds of one fn() replayed from a CUDA graph of `reps` calls: the kernels' own time,
    without the host's launch work (what a server that captures its verify step pays)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    return timed(graph.replay, warmup=1, iters=iters) / reps


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in GB/s (bytes read + written) of 1 GiB buffers: the better of an eager
    copy and copies replayed from a CUDA graph (the stricter yardstick for the kernels)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = min(timed(lambda: dst.copy_(src), iters=20), graph_timed(lambda: dst.copy_(src), reps=5))
    return 2 * src.numel() / (ms * 1e-3) / 1e9


def sdpa(q, k, v, backend):
    """torch SDPA on [B, T, H, D] tensors, GQA expanded natively when the backend allows it."""
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    with sdpa_kernel(backend):
        try:
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True)
        except RuntimeError:
            g = q.shape[2] // k.shape[2]
            kt, vt = kt.repeat_interleave(g, 1), vt.repeat_interleave(g, 1)
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)


def prefill_rows(args) -> list[dict]:
    rows = []
    for T in args.prefill_t:
        rows += prefill_at(T, args.depths)
        torch.cuda.empty_cache()
    return rows


def prefill_at(T: int, depths: list[int]) -> list[dict]:
    from tether.kernels.moda import moda_attention

    B, Hq, Hkv, D = 1, 32, 8, 128
    rows = []
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, T, Hq, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(B, T, Hkv, D, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn_like(k)
    flops = 4 * B * Hq * T * T * D / 2
    base = {}
    for name, backend in (("sdpa flash", SDPBackend.FLASH_ATTENTION), ("sdpa cudnn", SDPBackend.CUDNN_ATTENTION)):
        try:
            ms = timed(lambda backend=backend: sdpa(q, k, v, backend))
        except RuntimeError as e:
            rows.append({"op": name, "T": T, "L": 0, "error": str(e)[:120]})
            continue
        base[name] = ms
        rows.append({"op": name, "T": T, "L": 0, "ms": ms, "tflops": flops / ms / 1e9})
    for L in [0, *depths]:
        dk = torch.randn(B, T, L, Hkv, D, device="cuda", dtype=torch.bfloat16, generator=g)
        dv = torch.randn_like(dk)
        ms = timed(lambda dk=dk, dv=dv: moda_attention(q, k, v, dk, dv, causal=True))
        f = flops + 4 * B * Hq * T * L * D
        row = {"op": "moda (ours)", "T": T, "L": L, "ms": ms, "tflops": f / ms / 1e9}
        if "sdpa flash" in base:
            row["vs_flash"] = ms / base["sdpa flash"]
        if "sdpa cudnn" in base:
            row["vs_cudnn_throughput"] = base["sdpa cudnn"] / ms
        rows.append(row)
    return rows


def verify_rows(args, copy_gbs: float) -> list[dict]:
    from tether.kernels.moda import moda_verify

    Hq, Hkv, D, bs, L = 32, 8, 128, 16, 32
    rows = []
    for ctx in args.contexts:
        for k in args.verify_k:
            n = ctx + k
            blocks = -(-n // bs)
            g = torch.Generator(device="cuda").manual_seed(1)
            kc = torch.randn(blocks, bs, Hkv, D, device="cuda", dtype=torch.bfloat16, generator=g)
            vc = torch.randn_like(kc)
            table = torch.randperm(blocks, device="cuda", generator=g).to(torch.int32)[None]  # scattered blocks
            lens = torch.tensor([n], device="cuda", dtype=torch.int32)
            q_lens = torch.tensor([k], device="cuda", dtype=torch.int32)
            q = torch.randn(1, k, Hq, D, device="cuda", dtype=torch.bfloat16, generator=g)
            dk = torch.randn(1, k, L, Hkv, D, device="cuda", dtype=torch.bfloat16, generator=g)
            dv = torch.randn_like(dk)
            out = torch.empty_like(q)
            call = lambda q=q, kc=kc, vc=vc, t=table, ln=lens, ql=q_lens, dk=dk, dv=dv, o=out: moda_verify(  # noqa: E731
                q, kc, vc, t, ln, ql, dk, dv, out=o
            )
            ms = graph_timed(call)
            eager_ms = timed(call, iters=30)
            read = 2 * n * Hkv * D * 2  # K and V of the cache, bf16
            gbs = read / (ms * 1e-3) / 1e9
            rows.append({"ctx": ctx, "k": k, "us": 1000 * ms, "GB_s": gbs, "of_copy": gbs / copy_gbs,
                         "eager_us": 1000 * eager_ms})  # fmt: skip
            for tile, splits in itertools.product(args.verify_tiles, args.verify_splits or [None]):
                bn, nw, ns, cw = (int(x) for x in (tile + ",1").split(",")[:4])
                cfg = {"BLOCK_N": bn, "num_warps": nw, "num_stages": ns, "combine_warps": cw}
                sweep = lambda q=q, kc=kc, vc=vc, t=table, ln=lens, ql=q_lens, dk=dk, dv=dv, o=out, c=cfg, s=splits: (  # noqa: E731
                    moda_verify(q, kc, vc, t, ln, ql, dk, dv, out=o, num_splits=s, config=c)
                )
                ms = graph_timed(sweep)
                gbs = read / (ms * 1e-3) / 1e9
                rows.append({"ctx": ctx, "k": k, "tile": tile, "splits": splits, "us": 1000 * ms, "GB_s": gbs,
                             "of_copy": gbs / copy_gbs})  # fmt: skip
            del kc, vc
            torch.cuda.empty_cache()
    return rows


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-12))


def check_on_gpu() -> dict:
    """The kernels in bf16 on the GPU against the fp32 references, on awkward shapes (the CI tests run the
    kernels under the CPU interpreter, where bf16 cannot be checked)."""
    from tether.kernels.moda import moda_attention, moda_verify
    from tether.kernels.moda.naive import moda_attention_naive, moda_verify_naive

    out = {}
    g = torch.Generator(device="cuda").manual_seed(2)
    for T, Hq, Hkv, D, L in ((1025, 32, 8, 128, 13), (4099, 16, 2, 64, 32), (777, 8, 8, 128, 0)):
        q = torch.randn(2, T, Hq, D, device="cuda", dtype=torch.bfloat16, generator=g)
        k = torch.randn(2, T, Hkv, D, device="cuda", dtype=torch.bfloat16, generator=g)
        v, dk = torch.randn_like(k), torch.randn(2, T, L, Hkv, D, device="cuda", dtype=torch.bfloat16, generator=g)
        dv = torch.randn_like(dk)
        ref = moda_attention_naive(q.float(), k.float(), v.float(), dk.float(), dv.float())
        out[f"prefill T={T} Hq={Hq} Hkv={Hkv} D={D} L={L}"] = rel_rms(moda_attention(q, k, v, dk, dv), ref)
    for ctx, kq, Hq, Hkv, D, L in ((32768, 8, 32, 8, 128, 32), (1025, 5, 16, 4, 64, 3)):
        bs = 16
        n = ctx + kq
        blocks = -(-n // bs)
        kc = torch.randn(blocks, bs, Hkv, D, device="cuda", dtype=torch.bfloat16, generator=g)
        vc = torch.randn_like(kc)
        table = torch.randperm(blocks, device="cuda", generator=g).to(torch.int32)[None]
        lens = torch.tensor([n], device="cuda", dtype=torch.int32)
        ql = torch.tensor([kq], device="cuda", dtype=torch.int32)
        q = torch.randn(1, kq, Hq, D, device="cuda", dtype=torch.bfloat16, generator=g)
        dk = torch.randn(1, kq, L, Hkv, D, device="cuda", dtype=torch.bfloat16, generator=g)
        dv = torch.randn_like(dk)
        ref = moda_verify_naive(q.float(), kc.float(), vc.float(), table, lens, ql, dk.float(), dv.float())
        out[f"verify ctx={ctx} k={kq} Hq={Hq} Hkv={Hkv} D={D} L={L}"] = rel_rms(
            moda_verify(q, kc, vc, table, lens, ql, dk, dv), ref
        )
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefill-t", type=int, nargs="*", default=[4096, 16384, 65536])
    ap.add_argument("--depths", type=int, nargs="*", default=[16, 32, 64])
    ap.add_argument("--contexts", type=int, nargs="*", default=[4096, 16384, 32768, 131072])
    ap.add_argument("--verify-k", type=int, nargs="*", default=[1, 8, 32])
    ap.add_argument("--verify-tiles", nargs="*", default=[], metavar="BLOCK_N,WARPS,STAGES[,COMBINE_WARPS]",
                    help="also time these verify configs (tuning), e.g. 64,4,3 128,4,2,4")  # fmt: skip
    ap.add_argument("--verify-splits", type=int, nargs="*", default=[],
                    help="split counts for --verify-tiles (default: the heuristic's)")  # fmt: skip
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/moda_kernels.py needs a CUDA GPU")
    import triton

    console = Console()
    checks = check_on_gpu()
    for name, err in checks.items():
        console.print(f"check {name}: rel RMS {err:.2e} {'ok' if err < 5e-3 else 'FAIL'}")
    copy_gbs = copy_bandwidth()
    pre = prefill_rows(args) if args.prefill_t else []
    ver = verify_rows(args, copy_gbs) if args.contexts else []
    t = Table(title=f"prefill: B=1 Hq=32 Hkv=8 D=128 bf16 causal, {torch.cuda.get_device_name()}")
    for c in ("op", "T", "L", "ms", "TFLOP/s", "x sdpa flash time", "x cudnn throughput"):
        t.add_column(c, justify="right")
    for r in pre:
        if "error" in r:
            t.add_row(r["op"], str(r["T"]), "0", r["error"], "", "", "")
            continue
        t.add_row(r["op"], str(r["T"]), str(r["L"]), f"{r['ms']:.3f}", f"{r['tflops']:.0f}",
                  f"{r['vs_flash']:.2f}" if "vs_flash" in r else "",
                  f"{r['vs_cudnn_throughput']:.2f}" if "vs_cudnn_throughput" in r else "")  # fmt: skip
    console.print(t)
    t = Table(title=f"verify over the paged cache: one row, L=32, block 16; copy bandwidth {copy_gbs:.0f} GB/s")
    for c in ("context", "k", "GPU us (graph)", "GB/s", "of copy bw", "eager us per call"):
        t.add_column(c, justify="right")
    for r in ver:
        if "tile" in r:
            continue
        t.add_row(str(r["ctx"]), str(r["k"]), f"{r['us']:.1f}", f"{r['GB_s']:.0f}", f"{r['of_copy']:.2f}",
                  f"{r['eager_us']:.1f}")  # fmt: skip
    console.print(t)
    tuned = [r for r in ver if "tile" in r]
    if tuned:
        t = Table(title="verify tile sweep: the fastest per shape (all in the JSON line)")
        for c in ("context", "k", "tile", "splits", "GPU us", "of copy bw", "x default"):
            t.add_column(c, justify="right")
        for ctx, k in sorted({(r["ctx"], r["k"]) for r in tuned}):
            best = min((r for r in tuned if (r["ctx"], r["k"]) == (ctx, k)), key=lambda r: r["us"])
            default = next(r["us"] for r in ver if (r["ctx"], r["k"]) == (ctx, k) and "tile" not in r)
            t.add_row(str(ctx), str(k), best["tile"], str(best["splits"] or "auto"), f"{best['us']:.1f}",
                      f"{best['of_copy']:.2f}", f"{default / best['us']:.2f}")  # fmt: skip
        console.print(t)
    record = {
        "bench": "kernels",
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "copy_GB_s": copy_gbs,
        "checks": checks,
        "prefill": pre,
        "verify": ver,
    }
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
