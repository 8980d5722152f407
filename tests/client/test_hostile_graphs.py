"""A server that sends hostile ONNX graphs: each is refused in one line before onnxruntime sees it
(tether.client.onnx_graph_policy), and what a check of the bytes cannot see is stopped when it runs
(tether.client.onnx_bounds): no hang, no large allocation, no traceback.

The graphs are built with the inspection schema of tether.shared.onnx_subset (the `onnx` package is not installed).
The exporter's own graphs pass (here the tiny drafters'; tests/client/test_onnx_pairing.py pairs with the shipped
ones through the same check).
"""

import hashlib
import json
import resource
from concurrent import futures

import grpc
import numpy as np
import onnxruntime as ort
import pytest
from test_onnx_pairing import Tamper, servers  # noqa: F401  (the module's server fixture)
from tiny_models import tiny_pair

from tether.client import onnx_drafter
from tether.client.cli import main
from tether.client.errors import Problem, ServerDataError
from tether.client.onnx_bounds import DEFAULT_MEMORY_BYTES, Bound, DraftingStopped, RunLimits
from tether.client.onnx_graph_policy import GraphLimits, GraphRefused, check_graph
from tether.client.onnx_pairing import fetch_onnx_part
from tether.server.onnx_export import export_client_onnx
from tether.shared.onnx_subset import ONNX_BOOL, ONNX_EXTERNAL, ONNX_FLOAT, ONNX_INT64, onnx_inspect_class
from tether.v1 import tether_pb2_grpc

LIMITS = GraphLimits(max_dim=4096, max_elements=4096 * 192)  # the default drafter's
DTYPES = {np.dtype("float32"): ONNX_FLOAT, np.dtype("int64"): ONNX_INT64, np.dtype("bool"): ONNX_BOOL}


def tensor(t, array: np.ndarray) -> None:
    t.data_type = DTYPES[array.dtype]
    t.dims.extend(array.shape)
    t.raw_data = array.tobytes()


def value_info(vi, name: str, elem_type: int, shape=()) -> None:
    vi.name = name
    vi.type.tensor_type.elem_type = elem_type
    vi.type.tensor_type.shape.SetInParent()
    for d in shape:
        dim = vi.type.tensor_type.shape.dim.add()
        if isinstance(d, int):
            dim.dim_value = d
        else:
            dim.dim_param = d


def model(nodes, inputs, outputs, initializers=(), opset: int = 17):
    """A ModelProto: nodes (op, inputs, outputs, {attribute: int | np.ndarray | subgraph bytes}), inputs and
    outputs [(name, elem type, shape)], initializers [(name, array)]."""
    m = onnx_inspect_class()()
    m.ir_version = 8
    m.opset_import.add(domain="", version=opset)
    g = m.graph
    g.name = "hostile"
    for op, ins, outs, *attrs in nodes:
        node = g.node.add(op_type=op, input=ins, output=outs)
        for name, v in (attrs[0] if attrs else {}).items():
            a = node.attribute.add(name=name)
            if isinstance(v, bytes):
                a.g, a.type = v, 5
            elif isinstance(v, np.ndarray):
                tensor(a.t, v)
                a.type = 4
            else:
                a.i, a.type = v, 2
    for name, et, shape in inputs:
        value_info(g.input.add(), name, et, shape)
    for name, et, shape in outputs:
        value_info(g.output.add(), name, et, shape)
    for name, array in initializers:
        t = g.initializer.add(name=name)
        tensor(t, array)
    return m


def endless_loop() -> bytes:
    """A Loop of 2^62 iterations, each adding 1."""
    body = model([("Identity", ["cond_in"], ["cond_out"]), ("Add", ["x_in", "one"], ["x_out"])],
                 [("i", ONNX_INT64, []), ("cond_in", ONNX_BOOL, []), ("x_in", ONNX_FLOAT, [])],
                 [("cond_out", ONNX_BOOL, []), ("x_out", ONNX_FLOAT, [])],
                 [("one", np.array(1.0, np.float32))]).graph  # fmt: skip
    return model([("Loop", ["trips", "yes", "x0"], ["x"], {"body": body.SerializeToString()})],
                 [("x0", ONNX_FLOAT, [])], [("x", ONNX_FLOAT, [])],
                 [("trips", np.array(1 << 62, np.int64)), ("yes", np.array(True))]).SerializeToString()  # fmt: skip


def fill(shape_input: bool, n: int = 1 << 30):
    """ConstantOfShape of n floats (4 GiB by default), summed: its shape a constant, or a graph input (seen only
    when it runs)."""
    one = {"value": np.array([1.0], np.float32)}
    nodes = [("ConstantOfShape", ["shape"], ["y"], one), ("ReduceSum", ["y"], ["z"], {"keepdims": 0})]
    if shape_input:
        return model(nodes, [("shape", ONNX_INT64, [1])], [("z", ONNX_FLOAT, [])])
    return model(nodes, [], [("z", ONNX_FLOAT, [])], [("shape", np.array([n], np.int64))])


def edited(edit):
    m = model([("Add", ["x", "x"], ["y"])], [("x", ONNX_FLOAT, ["T"])], [("y", ONNX_FLOAT, ["T"])])
    edit(m)
    return m


def lying_dims(m):
    """An initializer whose dims claim 64 GiB, holding 4 bytes."""
    t = m.graph.initializer.add(name="w", data_type=ONNX_FLOAT, raw_data=b"\0" * 4)
    t.dims.extend([1 << 34])


def small_lie(m):
    t = m.graph.initializer.add(name="w", data_type=ONNX_FLOAT, raw_data=b"\0" * 4)
    t.dims.extend([2, 2])


def unlisted_external(m):
    t = m.graph.initializer.add(name="w", data_type=ONNX_FLOAT, data_location=ONNX_EXTERNAL)
    t.dims.extend([4, 4])
    t.external_data.add(key="location", value="/etc/passwd")


def another_domain(m):
    m.graph.node[0].domain = "com.microsoft"


def custom_op(m):
    m.graph.node[0].op_type = "DynamicQuantizeMatMul"


def with_if(m):
    then = model([("Identity", ["x"], ["z"])], [], [("z", ONNX_FLOAT, [])]).graph.SerializeToString()
    node = m.graph.node.add(op_type="If", input=["c"], output=["w"])
    node.attribute.add(name="then_branch", type=5, g=then)


def subgraph_on_add(m):
    body = model([("Identity", ["x"], ["z"])], [], [("z", ONNX_FLOAT, [])]).graph.SerializeToString()
    m.graph.node[0].attribute.add(name="body", type=5, g=body)


def huge_static_axis(m):
    m.graph.input[0].type.tensor_type.shape.dim[0].dim_value = 1 << 40


def function(m):
    m.functions.append(b"\x0a\x03foo")  # FunctionProto {name: "foo"}


def unknown_field(m):
    m.graph.node[0].attribute.add(name="pad", type=2, i=1)
    m.graph.node[0].attribute[0].MergeFromString(b"\xf8\x07\x01")  # field 127, a varint


def imports(domain: str, version: int):
    def edit(m):
        m.opset_import.add(domain=domain, version=version)

    return edit


def cast_to_string(m):
    m.graph.node.add(op_type="Cast", input=["x"], output=["s"]).attribute.add(name="to", type=2, i=8)


HOSTILE = {
    "a Loop of 2^62 iterations": lambda: endless_loop(),
    "a constant 4 GiB ConstantOfShape": lambda: fill(shape_input=False).SerializeToString(),
    "dims of 64 GiB over 4 bytes": lambda: edited(lying_dims).SerializeToString(),
    "dims that do not match the bytes": lambda: edited(small_lie).SerializeToString(),
    "external data the description does not list": lambda: edited(unlisted_external).SerializeToString(),
    "another operator domain": lambda: edited(another_domain).SerializeToString(),
    "an operator the exporter never emits": lambda: edited(custom_op).SerializeToString(),
    "an If with a subgraph": lambda: edited(with_if).SerializeToString(),
    "a subgraph on an operator we allow": lambda: edited(subgraph_on_add).SerializeToString(),
    "a static axis of 2^40": lambda: edited(huge_static_axis).SerializeToString(),
    "a model-local function": lambda: edited(function).SerializeToString(),
    "a field onnx.proto does not define": lambda: edited(unknown_field).SerializeToString(),
    "an opset out of range": lambda: edited(lambda m: setattr(m.opset_import[0], "version", 99)).SerializeToString(),
    "another domain imported": lambda: edited(imports("evil", 1)).SerializeToString(),
    "a Cast to strings": lambda: edited(cast_to_string).SerializeToString(),
    "bytes that do not parse": lambda: b"\xff" * 64,
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_hostile_graph_is_refused_in_one_line(case):
    with pytest.raises(GraphRefused) as e:
        check_graph(HOSTILE[case](), LIMITS, {})
    assert "\n" not in str(e.value) and str(e.value)


def test_a_harmless_graph_and_the_exporters_graphs_pass(tmp_path):
    check_graph(edited(lambda m: None).SerializeToString(), LIMITS, {})
    for kind, tli in (("moa", 2), ("eagle", 1)):
        target, drafter = tiny_pair(kind, 7, tli)
        export_client_onnx(drafter, tmp_path / kind)
        description = json.loads((tmp_path / kind / "onnx_drafter.json").read_text())
        for g in description["graphs"].values():
            check_graph((tmp_path / kind / g["file"]).read_bytes(), GraphLimits.of(target.cfg, drafter.dcfg), {})


def test_external_data_the_description_lists_passes():
    def listed(m):
        t = m.graph.initializer.add(name="w", data_type=ONNX_FLOAT, data_location=ONNX_EXTERNAL)
        t.dims.extend([4, 4])

    check_graph(edited(listed).SerializeToString(), LIMITS, {"w": [4, 4]})
    with pytest.raises(GraphRefused):
        check_graph(edited(listed).SerializeToString(), LIMITS, {"w": [4, 5]})


def bounded(graph: bytes, **limits):
    session, _ = onnx_drafter._session("evil", graph, {}, 1, RunLimits(**limits))
    return session


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10


def test_a_run_time_allocation_past_the_arena_cap_stops_the_call_not_the_process():
    """The shape comes in as an input, so no check of the bytes sees it: the capped arena refuses the 4 GiB (and
    64 GiB) instead of the process allocating them, and the session goes on serving small calls."""
    session = bounded(fill(shape_input=True).SerializeToString())
    before = peak_rss_bytes()
    for n in (1 << 30, 1 << 34):
        with pytest.raises(DraftingStopped) as e:
            session.run(None, {"shape": np.array([n], np.int64)})
        assert e.value.bound == Bound.FAILED and e.value.problem == Problem.GRAPH and "\n" not in str(e.value)
    assert peak_rss_bytes() - before < 256 << 20
    assert session.run(None, {"shape": np.array([1000], np.int64)})[0] == 1000


def test_a_call_past_the_time_bound_is_terminated():
    """The Loop the graph check refuses, loaded here behind its back: the watchdog terminates the call."""
    session = bounded(endless_loop(), run_timeout_s=0.2)
    with pytest.raises(DraftingStopped) as e:
        session.run(None, {"x0": np.array(0.0, np.float32)})
    assert e.value.bound == Bound.TIME and "\n" not in str(e.value)


def test_the_memory_bound_is_what_the_description_implies():
    shipped = {"shapes": {"max_seq_len": 2048}, "drafter_config": {"n_heads": 6}, "graphs": {}}
    assert RunLimits.implied(shipped).memory_bytes == DEFAULT_MEMORY_BYTES
    larger = {"shapes": {"max_seq_len": 8192}, "drafter_config": {"n_heads": 32},
              "graphs": {"step": {"weights": {"tensors": {"w": [4096, 4096]}}}}}  # fmt: skip
    assert RunLimits.implied(larger).memory_bytes == 4 * (32 * 8192**2 * 4) + 8 * 4096 * 4096


def loop_in_step(part) -> dict[str, bytes]:
    """The files of a server that lies consistently: step.onnx is the endless Loop, the description names its sha256."""
    hostile = endless_loop()
    description = json.loads(bytes(part.files["onnx_drafter.json"]))
    description["graphs"]["step"]["sha256"] = hashlib.sha256(hostile).hexdigest()
    return {"step.onnx": hostile, "onnx_drafter.json": json.dumps(description).encode()}


def test_a_part_with_a_hostile_graph_is_refused_before_onnxruntime_sees_it(servers, tmp_path, monkeypatch):  # noqa: F811
    s = servers()
    created = []
    real = ort.InferenceSession
    monkeypatch.setattr(ort, "InferenceSession", lambda *a, **k: created.append(1) or real(*a, **k))
    with pytest.raises(ServerDataError) as e:
        fetch_onnx_part(
            Tamper(s.stub, files=loop_in_step(s.service.engine.exporter.part("fp32"))), s.info, tmp_path / "c"
        )
    assert e.value.problem == Problem.GRAPH and "step.onnx" in str(e.value) and "\n" not in str(e.value)
    assert created == []


class LyingServer(tether_pb2_grpc.TetherServicer):
    """The real server's model info, and its client part with `files` replaced (Tamper)."""

    def __init__(self, stub, files: dict[str, bytes]):
        self.stub, self.files = stub, files

    def GetModelInfo(self, request, context):
        return self.stub.GetModelInfo(request)

    def FetchWeights(self, request, context):
        yield from Tamper(self.stub, files=self.files).FetchWeights(request)


def test_tether_client_ends_in_one_line_with_status_2(servers, tmp_path, capsys):  # noqa: F811
    s = servers()
    liar = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    tether_pb2_grpc.add_TetherServicer_to_server(
        LyingServer(s.stub, loop_in_step(s.service.engine.exporter.part("fp32"))), liar
    )
    port = liar.add_insecure_port("127.0.0.1:0")
    liar.start()
    try:
        status = main(["generate", "--server", f"127.0.0.1:{port}", "--prompt", "def f(x):", "--json", "--cache-dir",
                       str(tmp_path / "cache"), "--connect-timeout-s", "5"])  # fmt: skip
    finally:
        liar.stop(None)
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert "the server sent an invalid ONNX graph: step.onnx is not a graph this client runs" in err
