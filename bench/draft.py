"""The edge client's draft step against context length: the onnxruntime drafter (and the torch one) after a prompt.

For each context length in `--contexts`: a random prompt of that many tokens is opened on an in-process verifier
(the default target and drafter on the CPU: what the server would send), the drafter begins from its delta, and
`--k`-token chains are drafted `--reps` times from the prompt's root (each chain discarded after), so every step
attends over the whole context. Reported: median milliseconds per draft step (one token), for the ONNX drafter
(exported here from the same drafter, `--threads` onnxruntime threads) and, with `--torch`, the torch drafter. The
issue's bar ([4/7]): <= 2 ms a step for the default TLI 3 drafter, flat in context up to 2K, on a 2-core CPU.
Beside it, the re-feed of a pipelined round ([6/7]): the k + 1 tokens of a round sent ahead, stepped over once its
verdict is in, one draft step per token against one causal `feed` call (milliseconds for all of them).
With `--precisions`, also the parts the server streams (tether.server.client_export: its graphs with the weights in
fp32, fp16 or int8; fp16 widened to fp32 at load, int8 run in int8), each timed the same way, with its size on the
wire. With `--tree depth,top_k,nodes` (nodes not counting the root, as the client's tree_nodes; bench/spec.py's
total_tokens counts it), also the median milliseconds of a whole draft tree from the root, on the general step graph
and on the tree session derived for that width (tether.client.onnx_derived), interleaved. `--idle-ms` sleeps before
each chain, as a client does while a round trip is out: its caches go cold.
Prints a table, then one JSON line.

    python bench/draft.py
    python bench/draft.py --contexts 64 2000 --torch
    python bench/draft.py --precisions fp32 fp16 int8 --idle-ms 10
    python bench/draft.py --contexts 200 1000 --tree 12,3,32        # the client's default tree
    python bench/draft.py --model runs/medium --drafter runs/drafters/moa3 --threads 4
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time

import torch
from rich.console import Console
from rich.table import Table

from tether.client.onnx_drafter import OnnxDrafter
from tether.server.client_export import ClientExporter
from tether.server.model_loading import default_model_dir, load
from tether.server.onnx_export import export_client_onnx
from tether.server.verifier import SequenceVerifier
from tether.shared.checkpoint import fingerprint
from tether.shared.drafter_loading import load_drafter
from tether.shared.weights import ONNX_PRECISIONS, TOKENIZER_TENSOR, client_part_tensors, tokenizer_tensor


def step_ms(drafter, root: int, k: int, reps: int, idle_s: float = 0.0) -> float:
    """Median ms per drafted token over `reps` chains of k from `root`, each discarded after; with `idle_s`, each
    chain after that long asleep (a client drafting once a verdict is in, its caches gone cold meanwhile)."""
    times = []
    for _ in range(reps):
        if idle_s:
            time.sleep(idle_s)
        t0 = time.perf_counter()
        drafter.draft(root, k)
        times.append((time.perf_counter() - t0) / k * 1e3)
        drafter.discard_drafts()
    return statistics.median(times)


def refeed_ms(drafter, tokens: list[int], reps: int, *, batched: bool) -> float:
    """Median ms to step the drafter over `tokens` (all of them), in one feed() call or one draft step each."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        if batched:
            drafter.feed(tokens)
        else:
            for t in tokens:
                drafter.draft(t, 1)
        times.append((time.perf_counter() - t0) * 1e3)
        drafter.discard_drafts()
    return statistics.median(times)


def tree_shape(value: str) -> tuple[int, int, int] | None:
    """`--tree` as (depth, top_k, nodes), None for ''."""
    if not value:
        return None
    shape = tuple(int(x) for x in value.split(","))
    if len(shape) != 3 or shape[0] < 1 or shape[1] < 2 or shape[2] < 1:
        raise SystemExit(f"--tree {value!r}: expected depth,top_k,nodes with depth, nodes >= 1 and top_k >= 2")
    return shape


def tree_ms(drafters: list, root: int, shape: tuple[int, int, int], reps: int) -> list[float]:
    """Median ms per draft tree of `shape` from `root` for each drafter, their trees drawn in turn (so a drift in
    the machine's speed falls on all alike), each tree's rows dropped after; the trees must be the same."""
    depth, top_k, nodes = shape
    times = [[] for _ in drafters]
    for _ in range(reps):
        grown = []
        for d, ts in zip(drafters, times, strict=True):
            t0 = time.perf_counter()
            tree = d.draft_tree(root, depth=depth, top_k=top_k, total_tokens=nodes + 1)
            ts.append((time.perf_counter() - t0) * 1e3)
            d.discard_drafts()
            grown.append((tree.tokens, tree.parents))
        if any(g != grown[0] for g in grown):
            raise AssertionError("the drafters grew different trees from the same root")
    return [statistics.median(ts) for ts in times]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[64, 512, 1024, 2000])
    ap.add_argument("--k", type=int, default=5, help="tokens per chain")
    ap.add_argument("--reps", type=int, default=30, help="chains per context")
    ap.add_argument("--threads", type=int, default=1, help="onnxruntime intra-op threads")
    ap.add_argument("--idle-ms", type=float, default=0.0, help="sleep this long before each chain (a round trip)")
    ap.add_argument("--torch", action="store_true", help="also time the torch drafter")
    ap.add_argument("--precisions", nargs="*", default=[], choices=ONNX_PRECISIONS,
                    help="also time the server's ONNX parts in these precisions")  # fmt: skip
    ap.add_argument("--tree", default="",
                    help="also time draft trees of this depth,top_k,nodes, nodes without the root as the client's "
                         "--tree-nodes ('' to skip)")  # fmt: skip
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default="", help="target directory (default: the default target)")
    ap.add_argument("--drafter", default="", help="drafter directory trained against it (default: the default one)")
    args = ap.parse_args(argv)
    torch.set_grad_enabled(False)
    model_dir, drafter_dir = args.model or str(default_model_dir()), args.drafter or str(default_model_dir("drafter"))
    target, tok = load(model_dir, "cpu")
    drafter = load_drafter(drafter_dir, target, target_fingerprint=fingerprint(model_dir))
    tree = tree_shape(args.tree)
    fed = 1 + (tree[0] - 1) * tree[1] if tree else 0  # the most rows a tree feeds: the root, then top_k a level
    capacity = max(args.contexts) + max(args.k, fed) + 8
    if capacity > target.cfg.max_seq_len:
        raise SystemExit(f"contexts up to {target.cfg.max_seq_len - max(args.k, fed) - 8} fit the target's max_seq_len")
    with tempfile.TemporaryDirectory() as out:
        export_client_onnx(drafter, out)
        onnx = OnnxDrafter.load(out, threads=args.threads)
        widened = OnnxDrafter.load(out, threads=args.threads, tree_width=tree[1]) if tree else None
        weights = client_part_tensors(target, drafter)
        weights[TOKENIZER_TENSOR] = tokenizer_tensor(tok.to_json())
        exporter = ClientExporter(target.cfg, drafter.dcfg, weights, "0" * 64, out)
        part_bytes = {p: exporter.part(p).nbytes for p in args.precisions}
        served = {p: OnnxDrafter.load(exporter.dir / p, threads=args.threads) for p in args.precisions}
        g = torch.Generator().manual_seed(args.seed)
        rows = []
        for ctx in args.contexts:
            ver = SequenceVerifier(target, drafter, capacity=capacity)
            prompt = torch.randint(0, target.cfg.vocab_size, (ctx,), generator=g).tolist()
            root, delta = ver.open(prompt)
            onnx.begin(delta, capacity=capacity)
            idle = args.idle_ms / 1e3
            row = {"context": ctx, "onnx_ms": step_ms(onnx, root, args.k, args.reps, idle)}
            known = [root] + torch.randint(0, target.cfg.vocab_size, (args.k,), generator=g).tolist()
            row["onnx_refeed_stepped_ms"] = refeed_ms(onnx, known, args.reps, batched=False)
            row["onnx_refeed_fed_ms"] = refeed_ms(onnx, known, args.reps, batched=True)
            if tree:
                widened.begin(delta, capacity=capacity)
                row["tree_step_graph_ms"], row["tree_session_ms"] = tree_ms([onnx, widened], root, tree, args.reps)
            for p, d in served.items():
                d.begin(delta, capacity=capacity)
                row[f"onnx_{p}_ms"] = step_ms(d, root, args.k, args.reps, idle)
            if args.torch:
                drafter.begin(delta, capacity=capacity)
                row["torch_ms"] = step_ms(drafter, root, args.k, args.reps)
            rows.append(row)
            ver.release()
        exporter.close()
    which = f"{args.drafter or 'default drafter'} ({drafter.dcfg.kind}, TLI {drafter.dcfg.tli})"
    which += f", after {args.idle_ms:g} ms idle" if args.idle_ms else ""
    table = Table(title=f"draft step, {which}, k={args.k}, {args.threads} thread(s), CPU ({platform.machine()})")
    keys = ["onnx_ms", *(f"onnx_{p}_ms" for p in args.precisions)] + (["torch_ms"] if args.torch else [])
    table.add_column("context", justify="right")
    for key in keys:
        name = key.removesuffix("_ms").replace("_", " ")
        wire = f" ({part_bytes[name[5:]] / 2**20:.1f} MiB)" if name[5:] in part_bytes else ""
        table.add_column(f"{name}{wire} ms / step", justify="right")
    k1 = args.k + 1
    table.add_column(f"re-feed {k1} tokens: {k1} steps ms", justify="right")
    table.add_column("one feed ms", justify="right")
    if tree:
        table.add_column(f"tree {args.tree}: step graph ms", justify="right")
        table.add_column("tree session ms", justify="right")
    for r in rows:
        refeed = (f"{r['onnx_refeed_stepped_ms']:.2f}", f"{r['onnx_refeed_fed_ms']:.2f}")
        trees = (f"{r['tree_step_graph_ms']:.2f}", f"{r['tree_session_ms']:.2f}") if tree else ()
        table.add_row(str(r["context"]), *(f"{r[key]:.2f}" for key in keys), *refeed, *trees)
    Console().print(table)
    record = {"bench": "draft", "model": model_dir, "drafter": drafter_dir, "kind": drafter.dcfg.kind,
              "tli": drafter.dcfg.tli, "k": args.k, "threads": args.threads, "idle_ms": args.idle_ms,
              "tree": list(tree) if tree else None,
              "torch": torch.__version__, "part_bytes": part_bytes, "rows": rows}  # fmt: skip
    print(json.dumps(record))
    return record


if __name__ == "__main__":
    main()
