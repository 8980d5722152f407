"""The int8 client part runs its matrix products in int8 (tether.client.onnx_int8).

- The rewrite: every Linear product of the graph (MatMul over a transposed int8 matrix) becomes one
  DynamicQuantizeMatMul over the int8 rows, the unused fp32 matrices and Transposes leave the graph, a matrix still
  read elsewhere (the tied embeddings' lookup) stays, and the contrib domain is imported.
- The drafter on it against the same int8 part widened to fp32 (the path before): the default MoA and EAGLE
  drafters, real deltas from the verifier, logits close and greedy chains mostly the same, on any x86 host (the
  products' 7-bit weights keep onnxruntime's AVX2 kernel from saturating).
- seven_bit: every value within +-63, each row's values times its scale within half a step of the 8-bit ones.
- On small graphs built by hand: a Transpose that is not a matrix's [1, 0], or a matrix that is not int8, is left
  alone; a lookup of the same matrix keeps it; a graph that already names the rewrite's tensors is refused.
"""

import json

import numpy as np
import pytest
import torch
from toy_models import toy_model_dir

from tether.client import onnx_drafter
from tether.client.onnx_drafter import OnnxDrafter, load_stored
from tether.client.onnx_int8 import MS_DOMAIN, int8_matmuls, seven_bit
from tether.server.client_export import ClientExporter
from tether.server.model_loading import load
from tether.server.onnx_export import export_client_onnx
from tether.server.verifier import SequenceVerifier
from tether.shared.checkpoint import fingerprint
from tether.shared.drafter_loading import load_drafter
from tether.shared.onnx_subset import onnx_model_class
from tether.shared.weights import TOKENIZER_TENSOR, client_part_tensors, decode_weight, tokenizer_tensor

CAPACITY = 256


@pytest.fixture(scope="module", params=["drafter", "drafter-eagle"])
def part(request, tmp_path_factory):
    """(the int8 part's directory, target, torch drafter) of a toy drafter, as the server exports it."""
    grad = torch.is_grad_enabled()
    torch.set_grad_enabled(False)  # for this module's tests only: the modules after it train
    model_dir = str(toy_model_dir())
    target, tok = load(model_dir, "cpu")
    drafter = load_drafter(str(toy_model_dir(request.param)), target, target_fingerprint=fingerprint(model_dir))
    out = tmp_path_factory.mktemp("part")
    export_client_onnx(drafter, out)
    weights = client_part_tensors(target, drafter)
    weights[TOKENIZER_TENSOR] = tokenizer_tensor(tok.to_json())
    exporter = ClientExporter(target.cfg, drafter.dcfg, weights, "0" * 64, out)
    exporter.part("int8")
    yield exporter.dir / "int8", target, drafter
    exporter.close()
    torch.set_grad_enabled(grad)


def parsed(graph: bytes):
    model = onnx_model_class()()
    model.ParseFromString(graph)
    return model


def test_linear_products_are_rewritten_to_int8(part):
    path, _, _ = part
    manifest = json.loads((path / onnx_drafter.MANIFEST).read_text())
    spec = manifest["graphs"]["step"]
    graph = (path / spec["file"]).read_bytes()
    stored = load_stored(path / spec["weights"]["file"], spec["weights"])
    before = parsed(graph).graph
    transposed = {n.output[0]: n.input[0] for n in before.node if n.op_type == "Transpose" and n.input[0] in stored}
    linear = [n for n in before.node if n.op_type == "MatMul" and n.input[1] in transposed]
    assert len(linear) >= 8, "the step graph's Linear layers"
    out, weights = int8_matmuls(graph, stored)
    after = parsed(out)
    g = after.graph
    int8 = [n for n in g.node if n.op_type == "DynamicQuantizeMatMul"]
    assert len(int8) == len(linear) and all(n.domain == MS_DOMAIN for n in int8)
    assert {o.domain for o in after.opset_import} >= {"", MS_DOMAIN}
    read = {i for n in g.node for i in n.input}
    inits = {t.name: t for t in g.initializer}
    for n in int8:
        q, scale = seven_bit(*stored[transposed_name(n)])
        b, s = inits[n.input[1]], inits[n.input[2]]
        assert list(b.dims) == [q.shape[1], q.shape[0]] and np.array_equal(
            np.frombuffer(b.raw_data, np.int8).reshape(q.shape[1], q.shape[0]), q.T
        )
        assert np.array_equal(np.frombuffer(s.raw_data, np.float32), scale)
    # What no node reads any more is gone; what one still reads is handed over, dequantized.
    assert set(weights) == {name for name in stored if name in read}
    assert all(name in inits for name in weights) and not any(n.output[0] in transposed and n.output[0] not in read
                                                              for n in g.node)  # fmt: skip
    for name, w in weights.items():
        np.testing.assert_array_equal(w, decode_weight(*stored[name]))


def transposed_name(node) -> str:
    return node.input[1].removesuffix("#int8T")


def widened(graph, stored):
    """The path before: every matrix dequantized to fp32, the graph as exported."""
    return graph, {n: decode_weight(q, s) for n, (q, s) in stored.items()}


def test_int8_drafts_stay_close_to_the_widened_part(part, monkeypatch):
    path, target, drafter = part
    fast = OnnxDrafter.load(path)
    monkeypatch.setattr(onnx_drafter, "int8_matmuls", widened)
    wide = OnnxDrafter.load(path)
    g = torch.Generator().manual_seed(0)
    errs, same_first, agree = [], [], []
    for _ in range(3):
        ver = SequenceVerifier(target, drafter, capacity=CAPACITY)
        prompt = torch.randint(0, target.cfg.vocab_size, (60,), generator=g).tolist()
        root, delta = ver.open(prompt)
        for d in (fast, wide):
            d.begin(delta, capacity=CAPACITY)
        a, b = fast.backend.step(root), wide.backend.step(root)
        errs.append(np.linalg.norm(a - b) / np.linalg.norm(b))
        fast.discard_drafts(), wide.discard_drafts()
        x, y = fast.draft(root, 5)[0], wide.draft(root, 5)[0]
        same_first.append(x[0] == y[0])
        agree.append(next((i for i, (p, q) in enumerate(zip(x, y, strict=True)) if p != q), 5))
        ver.release()
    assert np.isfinite(errs).all() and max(errs) < 0.1, errs
    assert all(same_first) and np.mean(agree) >= 3, (same_first, agree)


def synthetic(perm: list[int] | None = (1, 0), tied: bool = False, extra: str = "") -> bytes:
    """A graph of the subset's fields only: y = x @ Transpose(W) (perm as given), and with `tied` a lookup of W too."""
    model = onnx_model_class()()
    g = model.graph
    t = g.node.add(op_type="Transpose", input=["W"], output=["Wt"])
    if perm is not None:
        t.attribute.add(name="perm", ints=list(perm), type=7)
    g.node.add(op_type="MatMul", input=["x", "Wt"], output=["y"])
    if tied:
        g.node.add(op_type="Gather", input=["W", "ids"], output=["e"])
    for name in ("W", *([extra] if extra else [])):
        g.initializer.add(name=name, data_type=1).dims.extend([4, 3])
    return model.SerializeToString()


def test_only_a_products_transposed_matrix_is_rewritten_and_a_lookup_keeps_it():
    q = np.arange(-6, 6, dtype=np.int8).reshape(4, 3)  # [N, K]
    stored = {"W": (q, np.full(4, 0.5, np.float32))}
    for perm in ((1, 0), None):
        out, weights = int8_matmuls(synthetic(perm), stored)
        g = parsed(out).graph
        assert [n.op_type for n in g.node] == ["DynamicQuantizeMatMul"] and weights == {}
        assert [t.name for t in g.initializer] == ["W#int8T", "W#scale"]
    out, weights = int8_matmuls(synthetic(tied=True), stored)
    g = parsed(out).graph
    assert [n.op_type for n in g.node] == ["DynamicQuantizeMatMul", "Gather"] and set(weights) == {"W"}
    np.testing.assert_array_equal(weights["W"], q.astype(np.float32) * 0.5)
    # Not a Linear's transpose, or not an int8 matrix: left as it was.
    for graph, s in ((synthetic((0, 1)), stored), (synthetic(), {"W": (q.astype(np.float32), None)})):
        out, weights = int8_matmuls(graph, s)
        assert [n.op_type for n in parsed(out).graph.node] == ["Transpose", "MatMul"] and set(weights) == {"W"}
    with pytest.raises(ValueError, match="already names"):
        int8_matmuls(synthetic(extra="W#scale"), stored)


def test_seven_bit_rows_stay_within_63_and_within_half_a_step():
    rng = np.random.default_rng(0)
    q = rng.integers(-127, 128, size=(37, 53), dtype=np.int64).astype(np.int8)  # [N, K]
    q[0, :4] = [127, -127, 1, -1]
    scale = rng.uniform(1e-3, 1.0, size=37).astype(np.float32)  # [N]
    q7, s7 = seven_bit(q, scale)
    assert q7.dtype == np.int8 and s7.dtype == np.float32 and q7.shape == q.shape
    assert np.abs(q7.astype(np.int64)).max() <= 63
    assert np.array_equal(s7, 2 * scale)
    err = np.abs(q7 * s7[:, None].astype(np.float64) - q * scale[:, None].astype(np.float64))  # [N, K]
    assert (err <= scale[:, None] * 1.0 + 1e-9).all()  # one 8-bit step at most: half a 7-bit step, 2 x the scale
