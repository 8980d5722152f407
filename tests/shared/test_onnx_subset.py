"""The ONNX message classes built at run time (tether.shared.onnx_subset) under threads: a nested message's class is
built once and never again, so two threads can never build it at once (#42: that left upb's class cache pointing at
a freed class, and a later graph check segfaulted).

The race runs in a child process, where a crash is an exit status rather than the end of the test worker: a garbage
collection inside one thread's first access to a nested message runs a finalizer that hands the GIL to a second
thread reaching the same message, and waits for it.

    .venv/bin/python -m pytest tests/shared/test_onnx_subset.py
"""

import gc
import subprocess
import sys
import weakref

import pytest

from tether.shared.onnx_subset import onnx_inspect_class, onnx_model_class

CLASSES = {"inspect": onnx_inspect_class, "model": onnx_model_class}

RACE = """
import gc, sys, threading
from tether.shared.onnx_subset import onnx_inspect_class, onnx_model_class

cls = {"inspect": onnx_inspect_class, "model": onnx_model_class}[sys.argv[1]]()
model = cls()
model.graph.node.add(op_type="Add", input=["a", "b"], output=["c"])
graph_bytes = model.SerializeToString()
del model

def parsed():
    m = cls()
    m.ParseFromString(graph_bytes)
    return m

class HandOver:
    # Cyclic garbage: the collector finalizes it, inside whatever allocation set the collection off.
    def __init__(self, go, done):
        self.cycle, self.go, self.done = self, go, done

    def __del__(self):
        self.go.set()
        self.done.wait(10)  # the GIL goes to the other thread meanwhile

split = 0
for attempt in range(6):
    gc.collect()
    models = {"first": parsed(), "second": parsed()}
    go, done, graphs = threading.Event(), threading.Event(), {}

    def other():
        go.wait(10)
        graphs["second"] = models["second"].graph
        done.set()

    t = threading.Thread(target=other)
    t.start()
    HandOver(go, done)
    thresholds = gc.get_threshold()
    gc.set_threshold(1)
    try:
        graphs["first"] = models["first"].graph
    finally:
        gc.set_threshold(*thresholds)
        go.set()
    t.join()
    split += type(graphs["first"]) is not type(graphs["second"])
    for name in ("first", "second") if attempt % 2 else ("second", "first"):
        del models[name], graphs[name]
        gc.collect()  # frees that one's class, unless it is the class upb's cache holds
        for _ in range(3):  # each access asks upb's cache for the class
            assert [n.op_type for n in parsed().graph.node] == ["Add"]
print("classes split", split)
"""


@pytest.mark.parametrize("name", CLASSES)
def test_two_threads_reaching_a_nested_message_at_once_share_its_class(name):
    child = subprocess.run([sys.executable, "-c", RACE, name], capture_output=True, text=True, timeout=60)
    assert (child.returncode, child.stdout.strip()) == (0, "classes split 0"), child.stderr[-2000:]


@pytest.mark.parametrize("name", CLASSES)
def test_a_nested_message_class_outlives_its_instances(name):
    model = CLASSES[name]()()
    model.graph.node.add(op_type="Add").attribute.add(name="axis")
    classes = [weakref.ref(type(m)) for m in (model.graph, model.graph.node[0], model.graph.node[0].attribute[0])]
    del model
    gc.collect()
    again = CLASSES[name]()()
    again.graph.node.add().attribute.add()
    assert [type(m) for m in (again.graph, again.graph.node[0], again.graph.node[0].attribute[0])] == [
        c() for c in classes
    ]
