"""The sessions the ONNX drafter derives from its step graph at load (tether.client.onnx_derived).

- prune_to keeps what the outputs need: MoA's SA rows read tokens and positions only, in a fraction of the nodes,
  and compute what the whole step graph computes for them; a missing output or a kept node with a subgraph is
  refused.
- A loaded drafter has `step1` (both kinds) and `sa_rows` (MoA), for fp32 and int8 parts; one-token steps run on
  step1, T > 1 and logit-free calls on the step graph, and adopting a delta runs no step graph at all.
- With its derived sessions and without them the drafter drafts the same and holds the same caches; derived
  sessions onnxruntime cannot build are left out and the step graph serves.
- Asked for trees w wide, it derives `tree`, runs every w-wide level on it (the root's on step1, others on the step
  graph), and grows the same trees as without it.
"""

import numpy as np
import pytest
from tiny_models import tiny_pair

from tether.client import onnx_drafter
from tether.client.onnx_derived import SA_ROWS_OUTPUTS, derived_graphs, prune_to
from tether.client.onnx_drafter import OnnxDrafter
from tether.server.client_export import ClientExporter
from tether.server.onnx_export import export_client_onnx
from tether.server.verifier import SequenceVerifier
from tether.shared.onnx_subset import ONNX_ATTR_GRAPH, onnx_model_class
from tether.shared.speculative import DraftTree
from tether.shared.weights import TOKENIZER_TENSOR, client_part_tensors, tokenizer_tensor

VOCAB = 7
PROMPT = [1, 2, 3, 4, 5, 6, 0, 1, 3, 2, 2]
CAPACITY = 96


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    """kind -> (target, torch drafter, fp32 export dir, int8 part dir)."""
    made, exporters = {}, []
    for kind in ("moa", "eagle"):
        target, drafter = tiny_pair(kind, VOCAB, 2)
        out = tmp_path_factory.mktemp(kind)
        export_client_onnx(drafter, out)
        weights = client_part_tensors(target, drafter)
        weights[TOKENIZER_TENSOR] = tokenizer_tensor('{"tokenizer": 1}')
        exporter = ClientExporter(target.cfg, drafter.dcfg, weights, "0" * 64, out)
        exporter.part("int8")
        exporters.append(exporter)
        made[kind] = target, drafter, out, exporter.dir / "int8"
    yield made
    for exporter in exporters:
        exporter.close()


def parsed(graph: bytes):
    model = onnx_model_class()()
    model.ParseFromString(graph)
    return model


class CountingSession:
    def __init__(self, inner):
        self.inner, self.shapes = inner, []

    def run(self, names, feeds):
        self.shapes.append(feeds["tokens"].shape[1])
        return self.inner.run(names, feeds)

    def get_inputs(self):
        return self.inner.get_inputs()


def test_sa_rows_are_the_step_graph_pruned_to_them(parts):
    target, drafter, out, _ = parts["moa"]
    graph = (out / "step.onnx").read_bytes()
    pruned, reads = prune_to(graph, SA_ROWS_OUTPUTS)
    assert reads == ["tokens", "positions"]
    whole, small = parsed(graph), parsed(pruned)
    assert [o.name for o in small.graph.output] == list(SA_ROWS_OUTPUTS)
    assert 0 < len(small.graph.node) < len(whole.graph.node) // 5
    assert {t.name for t in small.graph.initializer} < {t.name for t in whole.graph.initializer}
    # Every node's inputs are made before it (graph inputs, initializers or an earlier node's outputs).
    made = {"", *reads, *(t.name for t in small.graph.initializer)}
    for node in small.graph.node:
        assert set(node.input) <= made, node.name
        made.update(node.output)

    loaded = OnnxDrafter.load(out).backend
    T, P = 4, 6
    tokens, positions = np.array([[3, 1, 6, 2]]), np.arange(P, P + T)[None]
    mask = np.ones((T, P + T), dtype=bool)
    mask[:, P:] = np.tri(T, dtype=bool)
    rng = np.random.default_rng(0)
    hs, ds = loaded.draft_kv
    hkv, d = loaded.target_kv
    feeds = [tokens, positions, mask, np.array([T - 1]), *rng.standard_normal((4, 1, P, hs, ds), dtype=np.float32)]
    feeds += list(rng.standard_normal((2 * loaded.tli, 1, P, hkv, d), dtype=np.float32))
    _, sa_k, sa_v, *_ = loaded.sessions["step"].run(None, dict(zip(loaded.step_inputs, feeds, strict=True)))
    rows_k, rows_v = loaded.sessions["sa_rows"].run(None, {"tokens": tokens, "positions": positions})
    np.testing.assert_allclose(rows_k, sa_k, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(rows_v, sa_v, rtol=1e-5, atol=1e-6)


def test_prune_refuses_a_missing_output_and_a_kept_subgraph():
    model = onnx_model_class()()
    g = model.graph
    g.input.add(name="x")
    g.output.add(name="y")
    g.output.add(name="z")
    branch = g.node.add(op_type="If", name="if", input=["x"], output=["y"])
    branch.attribute.add(name="then_branch", type=ONNX_ATTR_GRAPH)
    g.node.add(op_type="Neg", name="neg", input=["x"], output=["z"])
    graph = model.SerializeToString()
    with pytest.raises(ValueError, match="no output"):
        prune_to(graph, ["w"])
    with pytest.raises(ValueError, match="subgraph"):
        prune_to(graph, ["y"])
    pruned, reads = prune_to(graph, ["z"])  # the If node is not kept, so its subgraph does not matter
    assert [n.name for n in parsed(pruned).graph.node] == ["neg"] and reads == ["x"]


@pytest.mark.parametrize("precision", ["fp32", "int8"])
@pytest.mark.parametrize("kind", ["moa", "eagle"])
def test_derived_sessions_serve_the_calls_they_are_for(parts, kind, precision):
    target, ref, out, int8 = parts[kind]
    drafter = OnnxDrafter.load(out if precision == "fp32" else int8)
    assert sorted(drafter.sessions) == (["context", "sa_rows", "step", "step1"] if kind == "moa" else ["step", "step1"])
    sessions = {name: CountingSession(s) for name, s in drafter.sessions.items() if name != "context"}
    drafter.backend.sessions = {**drafter.sessions, **sessions}
    server = SequenceVerifier(target, ref, capacity=CAPACITY)
    root, delta = server.open(PROMPT)
    drafter.begin(delta, capacity=CAPACITY)
    drafts, _, _ = drafter.draft(root, 4)
    guess = drafter.feed([3, 5, 1])
    drafter.discard_drafts()
    tree = drafter.draft_tree(root, depth=2, top_k=2, total_tokens=4)
    shapes = {name: s.shapes for name, s in sessions.items()}
    if kind == "moa":
        assert shapes["step1"] == [1, 1, 1, 1, 1]  # the chain's four steps and the tree's root level
        assert shapes["sa_rows"] == [len(PROMPT)]  # begin's SA rows: no step graph run for them
        assert shapes["step"] == [3, 2]  # the feed in one call, and the tree's second level
    else:  # EAGLE feeds a token a step, and its begin re-runs its layer over the prompt
        assert shapes["step1"] == [1, 1, 1, 1, 1, 1, 1, 1]
        assert shapes["step"] == [len(PROMPT), 2]
    assert guess is not None and len(drafts) == 4 and len(tree.tokens) == 4


@pytest.mark.parametrize("kind", ["moa", "eagle"])
def test_with_and_without_derived_sessions_the_drafter_drafts_the_same(parts, kind, monkeypatch):
    target, ref, out, _ = parts[kind]
    with_derived = OnnxDrafter.load(out)
    monkeypatch.setattr(onnx_drafter, "derived_graphs", lambda *a: {})
    without = OnnxDrafter.load(out)
    assert set(with_derived.sessions) - set(without.sessions) == ({"step1", "sa_rows"} if kind == "moa" else {"step1"})
    server = SequenceVerifier(target, ref, capacity=CAPACITY)
    root, delta = server.open(PROMPT)
    for d in (with_derived, without):
        d.begin(delta, capacity=CAPACITY)
    for r in range(6):
        a, _, _ = with_derived.draft(root, 3)
        b, _, _ = without.draft(root, 3)
        assert a == b, f"round {r}"
        verdict, delta = server.verify(DraftTree.chain(root, a))
        root = verdict.bonus
        for d in (with_derived, without):
            d.discard_drafts()
            d.commit(delta)
    n = with_derived.verified_length()
    assert n == without.verified_length() == with_derived.backend.rows() == without.backend.rows()
    held = {"sa_k": n, "sa_v": n, "ctx_k": n, "ctx_v": n} if kind == "moa" else {"k": n, "v": n}
    for name, rows in held.items():
        np.testing.assert_allclose(getattr(with_derived.backend, name)[:rows], getattr(without.backend, name)[:rows],
                                   rtol=1e-5, atol=1e-6)  # fmt: skip
    if kind == "moa":  # the server's exact K/V, copied
        np.testing.assert_array_equal(with_derived.backend.tli_k[:, :n], without.backend.tli_k[:, :n])


def test_sessions_onnxruntime_cannot_build_are_left_out(parts, monkeypatch):
    target, ref, out, _ = parts["moa"]
    real = derived_graphs

    def broken(kind, graph, weights, tree_width=0):
        made = real(kind, graph, weights, tree_width)
        pruned, w, options = made["sa_rows"]
        return {**made, "sa_rows": (b"not a graph", w, options)}

    monkeypatch.setattr(onnx_drafter, "derived_graphs", broken)
    drafter = OnnxDrafter.load(out)
    assert sorted(drafter.sessions) == ["context", "step", "step1"]
    root, delta = SequenceVerifier(target, ref, capacity=CAPACITY).open(PROMPT)
    drafter.begin(delta, capacity=CAPACITY)  # SA rows by the step graph
    assert drafter.backend.rows() == len(PROMPT) and len(drafter.draft(root, 3)[0]) == 3


@pytest.mark.parametrize("precision", ["fp32", "int8"])
@pytest.mark.parametrize("kind", ["moa", "eagle"])
def test_the_tree_session_serves_levels_as_wide_as_asked_and_grows_the_same_trees(parts, kind, precision):
    target, ref, out, int8 = parts[kind]
    path = out if precision == "fp32" else int8
    plain, wide = OnnxDrafter.load(path), OnnxDrafter.load(path, tree_width=2)
    assert "tree" not in plain.sessions and plain.tree_width == 0
    assert set(wide.sessions) - set(plain.sessions) == {"tree"} and wide.tree_width == 2
    assert "tree" not in OnnxDrafter.load(path, tree_width=1).sessions  # a chain's width: step1 serves it
    sessions = {name: CountingSession(s) for name, s in wide.sessions.items() if name in ("step", "step1", "tree")}
    wide.backend.sessions = {**wide.sessions, **sessions}
    server = SequenceVerifier(target, ref, capacity=CAPACITY)
    root, delta = server.open(PROMPT)
    for d in (plain, wide):
        d.begin(delta, capacity=CAPACITY)
    for shape in ((4, 2, 7), (3, 3, 8), (4, 2, 7)):
        depth, top_k, total = shape
        counts = {name: len(s.shapes) for name, s in sessions.items()}
        a = plain.draft_tree(root, depth=depth, top_k=top_k, total_tokens=total)
        b = wide.draft_tree(root, depth=depth, top_k=top_k, total_tokens=total)
        assert (a.tokens, a.parents) == (b.tokens, b.parents), shape
        new = {name: s.shapes[counts[name] :] for name, s in sessions.items()}
        if top_k == 2:  # the root's level on step1, the three levels below it two wide on tree
            assert new["step1"] == [1] and new["tree"] == [2, 2, 2] and new["step"] == []
        else:  # three wide: not what the tree session is fixed at
            assert new["step1"] == [1] and new["tree"] == [] and new["step"] == [3, 3]
        for d in (plain, wide):
            d.discard_drafts()
    assert plain.backend.rows() == wide.backend.rows() == len(PROMPT)
