"""Sessions the edge client derives at load from a drafter's step graph, to cut a round's work besides its drafts.

Why: a draft step is ~700 small graph nodes, so on a CPU edge onnxruntime's cost per node, more than arithmetic, sets
a step's time (the default drafter: ~1 ms a step), and a round does more than its draft steps. Up to three derived
sessions:
- `sa_rows` (MoA): the SA keys and values of verified tokens. SA is the drafter's first layer, so its K/V at a
  position are a function of the token and the position alone (the embedding, SA's input norm, its K and V
  projections, RoPE). Adopting a verdict's delta used to feed the accepted tokens through the whole step graph (SA,
  CA and the TLI layers, their other rows thrown away) for them: ~15% of a pipelined round's work. The step graph
  pruned to those two outputs (`prune_to`) computes the same values from tokens and positions, in a tenth of the
  nodes. A graph whose SA rows would read anything else gets no such session.
- `step1`: the step graph with its new-token and logit-row axes (T, R) fixed at 1 by onnxruntime's free-dimension
  overrides, for the one-token draft steps: onnxruntime folds the shape arithmetic that depends on them at load
  (the default MoA drafter's step: 270 nodes left of 462 after onnxruntime's optimizations; when first measured,
  0.72 against 0.83 ms a step at context 200 on a 2-core EPYC).
- `tree` (with a tree width w >= 2 asked for at load): the step graph with T and R fixed at w, for the levels of a draft
  tree w wide (every level after the root's feeds w frontier nodes and reads w logit rows). The general step graph
  serves them otherwise. The client's default tree (12 levels, 3 wide, 32 nodes) with the default drafter on a 2-core
  EPYC, the same trees: 20.7 against 23.9 ms after 200 tokens of context, 26.4 against 29.8 after 1,000 (`bench/draft.py
  --tree 12,3,32`; 6-7% on an H200 host's Xeon). It keeps pre-packed matrices (w-row products gain from them: slower
  than the step graph without), so it costs about one more copy of the matrices (16 MB more resident for the default
  part), which a chain-only client does not ask for.
All read the same weight arrays as the step session, handed in by name. `step1` keeps no pre-packed copies of the
matrices (`session.disable_prepacking`): a one-row product runs as fast on the matrix as stored (measured), and the
client does not hold a second copy of its part. Calls the runtime routes elsewhere (other T, no logits) keep the
step session, so a part from any server works, derived sessions or none.

Contract: `prune_to(graph, outputs)` -> (the graph computing only `outputs`, the names of the inputs it still
reads); ValueError when an output is missing or a node it keeps holds a subgraph (whose outer reads pruning cannot
see). `derived_graphs(kind, graph, weights, tree_width=0)` -> {name: (graph, weights, session options)} for a kind's
step graph as the step session loaded it (an int8 part's products already rewritten); onnx_drafter builds the
sessions.

    graph, reads = prune_to(step_graph, ["sa_k_new", "sa_v_new"])   # reads == ["tokens", "positions"]

Tests: tests/client/test_onnx_derived.py.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from tether.shared.onnx_subset import ONNX_ATTR_GRAPH, ONNX_ATTR_GRAPHS, onnx_model_class

SA_ROWS_OUTPUTS = ("sa_k_new", "sa_v_new")
SA_ROWS_INPUTS = ("tokens", "positions")  # all an SA row may depend on
ONE_TOKEN = {"T": 1, "R": 1}  # the step graph's free axes a one-token draft step fixes (onnx_export's names)


@dataclass(frozen=True)
class SessionOptions:
    """How onnx_drafter builds a session beyond its graph and weights."""

    fixed_dims: Mapping[str, int] = field(default_factory=dict)  # free-dimension overrides by axis name
    prepack: bool = True  # let onnxruntime keep pre-packed copies of the matrices


def prune_to(graph: bytes, outputs: Sequence[str]) -> tuple[bytes, list[str]]:
    """The graph with only the nodes, inputs and initializers `outputs` need, in their order (module docstring)."""
    model = onnx_model_class()()
    model.ParseFromString(graph)
    g = model.graph
    missing = set(outputs) - {o.name for o in g.output}
    if missing:
        raise ValueError(f"the graph has no output {sorted(missing)}")
    needed, kept = set(outputs), []
    for node in reversed(g.node):
        if not needed.intersection(node.output):
            continue
        if any(a.type in (ONNX_ATTR_GRAPH, ONNX_ATTR_GRAPHS) for a in node.attribute):
            raise ValueError(f"node {node.name!r} ({node.op_type}) holds a subgraph")
        copy = type(node)()
        copy.CopyFrom(node)
        kept.append(copy)
        needed.update(name for name in node.input if name)
    del g.node[:]
    g.node.extend(reversed(kept))
    for repeated, keep in ((g.output, set(outputs)), (g.input, needed), (g.initializer, needed)):
        for item in [item for item in repeated if item.name not in keep]:
            repeated.remove(item)
    return model.SerializeToString(), [i.name for i in g.input]


def _initializers(graph: bytes) -> set[str]:
    model = onnx_model_class()()
    model.ParseFromString(graph)
    return {t.name for t in model.graph.initializer}


def derived_graphs(
    kind: str, graph: bytes, weights: Mapping[str, np.ndarray], tree_width: int = 0
) -> dict[str, tuple[bytes, dict[str, np.ndarray], SessionOptions]]:
    """{session name: (graph, its weights, options)} derived from `kind`'s step graph (module docstring); `tree`
    only for a tree_width of 2 or more."""
    out = {"step1": (graph, dict(weights), SessionOptions(fixed_dims=ONE_TOKEN, prepack=False))}
    if tree_width >= 2:
        out["tree"] = (graph, dict(weights), SessionOptions(fixed_dims={"T": tree_width, "R": tree_width}))
    if kind == "moa":
        try:
            pruned, reads = prune_to(graph, SA_ROWS_OUTPUTS)
        except ValueError:
            return out
        if set(reads) <= set(SA_ROWS_INPUTS):
            used = _initializers(pruned)
            out["sa_rows"] = (pruned, {n: w for n, w in weights.items() if n in used}, SessionOptions())
    return out
