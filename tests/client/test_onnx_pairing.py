"""Torch-free pairing (tether.client.onnx_pairing) against a real in-process server running the toy models.

- fp32: the ONNX part drafts exactly what the torch client drafts (same tokens, logits within 1e-4).
- fp16 / int8: drafts agree with the torch client's on most tokens. Measured over these 60 rounds of 5 tokens
  (3 prompts x 20, the same verified text for everyone): fp16 100% (MoA and EAGLE); int8 100% of first tokens, 99%
  (MoA) and 93% (EAGLE) of chain tokens before a chain's first difference. Asserted with room for other CPUs'
  rounding: first tokens >= 90%, chain tokens >= 95% (fp16) and >= 80% (int8). The error is in the weights only
  (fp16's 11-bit mantissa; int8's per-row step of max|w| / 127), so a near-tie between two tokens can flip.
- A broken download resumes from the byte it stopped at; a part in the cache is not downloaded again, and the
  server does not export it again.
- Hostile manifests and files are refused with their Problem before anything is written or loaded.
- A child process with torch blocked pairs against the server in this process and drafts.
"""

import hashlib
import json
import subprocess
import sys
import textwrap

import grpc
import numpy as np
import pytest
import torch
from safetensors.numpy import load, save
from toy_models import toy_model_dir

from tether.client.errors import Problem, ServerDataError
from tether.client.onnx_drafter import ArrayDelta, OnnxDrafter
from tether.client.onnx_pairing import OnnxClientPart, fetch_onnx_part
from tether.client.pairing import build_client_models, fetch_client_part
from tether.server.engine_core import Engine
from tether.server.model_loading import load as load_model
from tether.server.rpc_server import make_server
from tether.server.serve_config import ServiceConfig
from tether.server.service import TetherService
from tether.server.verifier import SequenceVerifier
from tether.shared.checkpoint import fingerprint
from tether.shared.codecs import Codec, encode_many
from tether.shared.drafter_loading import load_drafter
from tether.shared.speculative import DraftTree
from tether.shared.tokenizer import Tokenizer
from tether.shared.wire import decode_many
from tether.v1 import tether_pb2 as pb
from tether.v1 import tether_pb2_grpc

PROMPTS = ["import os\nimport sys\n\n\ndef main(argv):\n", "class Queue:\n    def __init__(self, maxsize=0):\n",
           "def read_lines(path):\n    with open(path) as f:\n"]  # fmt: skip
K = 5


class Served:
    def __init__(self, name: str, export_dir):
        torch.set_grad_enabled(False)
        self.target, self.tok = load_model(toy_model_dir(), "cpu")
        self.drafter = load_drafter(toy_model_dir(name), self.target)
        fp = fingerprint(toy_model_dir())
        self.service = TetherService(Engine(self.target, self.drafter, self.tok, ServiceConfig(), model_fingerprint=fp,
                                     export_dir=export_dir))  # fmt: skip
        self.server, port = make_server(self.service, "127.0.0.1:0")
        self.server.start()
        self.address = f"127.0.0.1:{port}"
        self.channel = grpc.insecure_channel(self.address)
        self.stub = tether_pb2_grpc.TetherStub(self.channel)
        self.info = self.stub.GetModelInfo(pb.GetModelInfoRequest())

    def close(self):
        self.channel.close()
        self.server.stop(grace=None)
        self.service.engine.close()


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    made: dict[str, Served] = {}

    def get(name: str = "drafter") -> Served:
        if name not in made:
            made[name] = Served(name, tmp_path_factory.mktemp(f"exports-{name}"))
        return made[name]

    yield get
    for s in made.values():
        s.close()


def torch_drafter(s: Served, cache):
    return build_client_models(s.info, fetch_client_part(s.stub, s.info, cache)).drafter


def drive(s: Served, ref, others: dict, rounds: int = 20) -> dict[str, list[tuple[list[int], list[int]]]]:
    """Every drafter drafts K tokens from the same verified text each round; the torch drafter's chain is
    verified, and the others drop their own drafts and adopt the same verdict. {name: [(theirs, torch's)]}."""
    seen: dict[str, list] = {name: [] for name in others}
    for text in PROMPTS:
        ver = SequenceVerifier(s.target, s.drafter, capacity=512)
        root, delta = ver.open(s.tok.encode(text))
        for d in (ref, *others.values()):
            d.begin(delta)
        for _ in range(rounds):
            want = ref.draft(root, K)[0]
            for name, d in others.items():
                seen[name].append((d.draft(root, K)[0], want))
                d.discard_drafts()
            verdict, delta = ver.verify(DraftTree.chain(root, want))
            root = verdict.bonus
            for d in (ref, *others.values()):
                d.commit(delta)
        ver.release()
    return seen


def recording(monkeypatch, drafter, log: list) -> None:
    """Log every logits row the drafter's one-token forward returns (a torch module's _step, the ONNX backend's
    step), as numpy."""
    owner, name = (drafter.backend, "step") if isinstance(drafter, OnnxDrafter) else (drafter, "_step")
    inner = getattr(owner, name)

    def step(token):
        out = inner(token)
        log.append(out.float().numpy() if isinstance(out, torch.Tensor) else out)
        return out

    monkeypatch.setattr(owner, name, step)


@pytest.mark.parametrize("name", ["drafter", "drafter-eagle"])
def test_each_precision_drafts_as_the_torch_client(servers, tmp_path, monkeypatch, name):
    s = servers(name)
    ref = torch_drafter(s, tmp_path)
    parts = {p: fetch_onnx_part(s.stub, s.info, tmp_path, precision=p) for p in ("fp32", "fp16", "int8")}
    assert all(isinstance(part, OnnxClientPart) and part.tokenizer.sha256 == s.info.tokenizer_sha256
               for part in parts.values())  # fmt: skip
    assert parts["int8"].nbytes < parts["fp16"].nbytes < parts["fp32"].nbytes
    logits: dict[str, list] = {"torch": [], "fp32": []}
    for who, d in (("torch", ref), ("fp32", parts["fp32"].drafter)):
        recording(monkeypatch, d, logits[who])
    seen = drive(s, ref, {p: part.drafter for p, part in parts.items()})
    assert all(got == want for got, want in seen["fp32"])
    for a, b in zip(logits["torch"], logits["fp32"], strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-4)
    for p, least in (("fp16", 0.95), ("int8", 0.80)):
        first = np.mean([got[0] == want[0] for got, want in seen[p]])
        chain = np.mean([agreeing(got, want) for got, want in seen[p]]) / K
        assert first >= 0.9 and chain >= least, (p, first, chain)


def agreeing(got: list[int], want: list[int]) -> int:
    """Tokens before a chain's first difference (after it, the chains condition on different tokens)."""
    return next((i for i, (x, y) in enumerate(zip(got, want, strict=True)) if x != y), len(want))


class Relay:
    """The real stub with FetchWeights watched: every request kept, the data bytes streamed counted, and the
    stream cut (ConnectionError) after `cut_after` messages, once."""

    def __init__(self, stub, cut_after: int | None = None):
        self.stub, self.cut_after, self.requests, self.received = stub, cut_after, [], 0

    def FetchWeights(self, req, **kw):
        self.requests.append(pb.FetchWeightsRequest.FromString(req.SerializeToString()))
        return self._watch(self.stub.FetchWeights(req, **kw))

    def _watch(self, stream):
        for i, msg in enumerate(stream):
            self.received += len(msg.chunk.data)
            yield msg
            if self.cut_after is not None and i == self.cut_after:
                self.cut_after = None
                stream.cancel()
                raise ConnectionError("the link dropped")


def test_a_broken_download_resumes_and_a_cached_part_is_not_fetched_again(servers, tmp_path):
    s = servers()
    exports = s.service.engine.exporter.exports
    cut = Relay(s.stub, cut_after=7)  # the manifest, the small files, then into step.safetensors's 10 MiB
    with pytest.raises(ConnectionError):
        fetch_onnx_part(cut, s.info, tmp_path)
    held = cut.received
    again = Relay(s.stub)
    progress = []
    part = fetch_onnx_part(again, s.info, tmp_path, on_progress=lambda done, total: progress.append((done, total)))
    resumed = [r for r in again.requests if not r.manifest_only]
    assert len(resumed) == 1 and resumed[0].resume_tensor == "step.safetensors" and resumed[0].resume_offset > 0
    assert again.received == part.nbytes - held and progress[-1] == (part.nbytes, part.nbytes)
    cached = Relay(s.stub)
    assert fetch_onnx_part(cached, s.info, tmp_path).nbytes == part.nbytes
    assert [r.manifest_only for r in cached.requests] == [True]  # the manifest, and nothing else to fetch
    assert s.service.engine.exporter.exports == max(exports, 1)  # exported once for this server, whoever asked


class Tamper(Relay):
    """A server that lies: the real stream with its manifest edited (`edit(manifest)`) and some files replaced by
    `files` {name: bytes} (their manifest entries made to match). For fresh downloads only."""

    def __init__(self, stub, edit=None, files=None):
        super().__init__(stub)
        self.edit, self.files = edit, files or {}

    def _watch(self, stream):
        first = next(stream)
        man = first.manifest
        for e in man.tensors:
            if e.name in self.files:
                data = self.files[e.name]
                e.nbytes, e.sha256 = len(data), hashlib.sha256(data).hexdigest()
                e.shape[:] = [len(data)]
        if self.edit:
            self.edit(man)
        yield pb.WeightChunk(manifest=man)
        for msg in stream:
            if msg.chunk.tensor not in self.files:
                yield msg
        for name, data in self.files.items():
            for pos in range(0, len(data), 1 << 20):
                yield pb.WeightChunk(chunk=pb.TensorChunk(tensor=name, offset=pos, data=data[pos : pos + (1 << 20)]))


def entry(man, name):
    return next(e for e in man.tensors if e.name == name)


def rewritten(weights=None, description=None):
    """New files for a server that lies consistently: `weights(tensors)` edits step.safetensors, `description(d)`
    onnx_drafter.json, which then names the new weights file's sha256. Returns part -> {name: bytes}."""

    def files(part) -> dict[str, bytes]:
        d = json.loads(bytes(part.files["onnx_drafter.json"]))
        out = {}
        if weights:
            tensors = load(bytes(part.files["step.safetensors"]))
            weights(tensors)
            out["step.safetensors"] = save(tensors)
            d["graphs"]["step"]["weights"]["sha256"] = hashlib.sha256(out["step.safetensors"]).hexdigest()
        if description:
            description(d)
        return out | {"onnx_drafter.json": json.dumps(d).encode()}

    return files


def rename_embeddings(tensors: dict) -> None:
    tensors["target.embed_tokens.weight.evil"] = tensors.pop("target.embed_tokens.weight")


def drop_embeddings(tensors: dict) -> None:
    tensors.pop("target.embed_tokens.weight")


def another_tokenizer(part):
    return {"tokenizer.json": Tokenizer.train(texts=["x = 1\n"] * 10, vocab_size=260).to_json().encode()}


HOSTILE = {
    "an entry that names a path": (lambda m: setattr(entry(m, "step.onnx"), "name", "../step.onnx"), None,
                                   Problem.MANIFEST),
    "an extra entry": (lambda m: m.tensors.add(name="x.bin", dtype="uint8", shape=[1], nbytes=1, sha256="0" * 64),
                       None, Problem.MANIFEST),
    "an entry that is not bytes": (lambda m: setattr(entry(m, "step.onnx"), "dtype", "float32"), None,
                                   Problem.MANIFEST),
    "an oversize description": (lambda m: (setattr(entry(m, "onnx_drafter.json"), "nbytes", 2 << 20),
                                           entry(m, "onnx_drafter.json").shape.__setitem__(0, 2 << 20)),
                                None, Problem.WEIGHT_SIZE),
    "a cache key that is not a sha256": (lambda m: setattr(entry(m, "step.onnx"), "sha256", "A" * 64), None,
                                         Problem.CACHE_KEY),
    "a wrong sha256": (lambda m: setattr(entry(m, "context.onnx"), "sha256", hashlib.sha256(b"x").hexdigest()), None,
                       Problem.CHECKSUM),
    "another format": (lambda m: setattr(m, "format", pb.CLIENT_PART_ONNX_FP16), None, Problem.MANIFEST),
    "another drafter": (lambda m: setattr(m, "drafter_fingerprint", "0" * 64), None, Problem.FINGERPRINT),
    "a description of another drafter": (None, rewritten(description=lambda d: d["drafter_config"].update(n_heads=3)),
                                         Problem.MANIFEST),
    "a description breaking the graph contract": (None, rewritten(description=lambda d: d["graphs"]["step"]["inputs"]
                                                                  .reverse()), Problem.MANIFEST),
    "a description naming other weights": (None, rewritten(drop_embeddings, lambda d: d["graphs"]["step"]["weights"]
                                                           .update(sha256="0" * 64)), Problem.MANIFEST),
    "weights the description does not list": (None, rewritten(rename_embeddings), Problem.MANIFEST),
    "weights that do not fit their file": (None, rewritten(drop_embeddings), Problem.MANIFEST),
    "a tokenizer that does not parse": (None, lambda part: {"tokenizer.json": b'{"version": "1.0"}'},
                                        Problem.TOKENIZER),
    "a tokenizer of another hash": (None, another_tokenizer, Problem.TOKENIZER),
}  # fmt: skip


@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_hostile_part_is_refused_with_its_problem(servers, tmp_path, case):
    s = servers()
    edit, files, problem = HOSTILE[case]
    liar = Tamper(s.stub, edit, files(s.service.engine.exporter.part("fp32")) if files else None)
    with pytest.raises(ServerDataError) as e:
        fetch_onnx_part(liar, s.info, tmp_path / "cache")
    assert e.value.problem == problem, e.value
    if problem in (Problem.MANIFEST, Problem.WEIGHT_SIZE, Problem.CACHE_KEY, Problem.FINGERPRINT) and not files:
        assert not any((tmp_path / "cache").rglob("*.*"))  # refused before a byte was written


def test_limits_and_formats_the_server_does_not_offer_are_refused_before_downloading(servers, tmp_path):
    s = servers()
    watched = Relay(s.stub)
    with pytest.raises(ServerDataError) as e:
        fetch_onnx_part(watched, s.info, tmp_path, max_bytes=1 << 20)
    assert e.value.problem == Problem.WEIGHT_SIZE and watched.received == 0
    old = pb.ModelInfo.FromString(s.info.SerializeToString())
    del old.client_part_formats[:]  # an older server streams tensors only
    with pytest.raises(ServerDataError) as e:
        fetch_onnx_part(watched, old, tmp_path)
    assert e.value.problem == Problem.MODEL_INFO
    with pytest.raises(ValueError, match="precision"):
        fetch_onnx_part(watched, s.info, tmp_path, precision="int4")


def test_a_graph_that_names_a_file_we_did_not_supply_does_not_load(servers, tmp_path, monkeypatch):
    """Its weight left out of the weights file and the description, the graph still names it as external data in
    step.safetensors: onnxruntime would read it from the working directory, where such a file now lies. The graph
    check refuses it (external data the description does not list) before onnxruntime sees it."""
    s = servers()
    part = s.service.engine.exporter.part("fp32")
    files = rewritten(drop_embeddings, lambda d: d["graphs"]["step"]["weights"]["tensors"].pop(
        "target.embed_tokens.weight"))(part)  # fmt: skip
    monkeypatch.chdir(tmp_path)
    (tmp_path / "step.safetensors").write_bytes(bytes(16 << 20))
    with pytest.raises(ServerDataError) as e:
        fetch_onnx_part(Tamper(s.stub, files=files), s.info, tmp_path / "cache")
    assert e.value.problem == Problem.GRAPH


CHILD = textwrap.dedent(
    """
    import json, sys
    sys.modules["torch"] = None  # any import of torch now fails
    from pathlib import Path

    import grpc

    from tether.client.onnx_drafter import ArrayDelta
    from tether.client.onnx_pairing import fetch_onnx_part
    from tether.shared.wire import decode_many
    from tether.v1 import tether_pb2 as pb, tether_pb2_grpc

    address, work = sys.argv[1], Path(sys.argv[2])
    stub = tether_pb2_grpc.TetherStub(grpc.insecure_channel(address))
    info = stub.GetModelInfo(pb.GetModelInfoRequest())
    part = fetch_onnx_part(stub, info, work / "cache", precision="int8")
    drafts = []
    for i, r in enumerate(json.loads((work / "rounds.json").read_text())):
        delta = ArrayDelta(r["start"], r["tokens"], decode_many((work / f"delta{i}.bin").read_bytes()))
        part.drafter.begin(delta) if i == 0 else part.drafter.commit(delta)
        drafts.append(part.drafter.draft(r["root"], 4)[0])
    loaded = sorted(m for m, mod in sys.modules.items() if m.split(".")[0] == "torch" and mod is not None)
    print(json.dumps({"drafts": drafts, "text": part.tokenizer.decode(drafts[0]) is not None, "torch": loaded}))
    """
)


def test_pairing_and_drafting_import_no_torch(servers, tmp_path):
    s = servers()
    here = fetch_onnx_part(s.stub, s.info, tmp_path / "parent", precision="int8").drafter
    ver = SequenceVerifier(s.target, s.drafter, capacity=256)
    root, delta = ver.open(s.tok.encode(PROMPTS[0]))
    meta, want = [], []
    for i in range(4):
        wire = encode_many(delta.tensors, Codec.FP16_SHUFFLE_ZSTD)
        (tmp_path / f"delta{i}.bin").write_bytes(wire)
        received = ArrayDelta(delta.start, list(delta.tokens), decode_many(wire))
        here.begin(received) if i == 0 else here.commit(received)
        meta.append({"start": delta.start, "tokens": list(delta.tokens), "root": root})
        want.append(here.draft(root, 4)[0])
        verdict, delta = ver.verify(DraftTree.chain(root, want[-1]))
        root = verdict.bonus
    ver.release()
    (tmp_path / "rounds.json").write_text(json.dumps(meta))
    proc = subprocess.run([sys.executable, "-c", CHILD, s.address, str(tmp_path)], capture_output=True, text=True,
                          timeout=300, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"drafts": want, "text": True, "torch": []}
