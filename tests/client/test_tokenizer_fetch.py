"""The tokenizer streamed by itself (ClientPartFormat TOKENIZER), for clients of a server without a drafter.

- A server with no drafter lists the tokenizer part alone and streams it; a client with no --tokenizer fetches it
  and its greedy text equals the server's own `generate --drafter none`.
- One entry, the tokenizer's canonical JSON, whose sha256 is ModelInfo.tokenizer_sha256: a server with a drafter
  streams the same bytes; other parts from a server without a drafter are refused with REASON_NO_DRAFTER.
- A cached tokenizer is found by that hash with no call to the server; a download broken mid-file resumes from
  the byte it stopped at; `--tokenizer PATH` overrides the server's (checked against its hash).
- Tampered, oversized or malformed tokenizer parts, and an older server without the part, are refused in one line
  with their Problem, before a byte is written where the manifest alone gives them away.
The server runs in this process on 127.0.0.1 with the toy target; nothing depends on time.
"""

import hashlib

import grpc
import pytest
from toy_models import toy_model_dir

from tether.client.errors import Problem, ServerDataError
from tether.client.refusals import Refusal
from tether.client.server_only import ServerOnlySession, fetch_tokenizer, server_tokenizer
from tether.client.session import ClientConfig, EdgeSession
from tether.client.transport import FormatNotOffered
from tether.client.weight_cache import WeightCache
from tether.server.engine_core import Engine
from tether.server.generate import GenerateConfig, generate_text
from tether.server.model_loading import load
from tether.server.rpc_server import make_server
from tether.server.serve_config import ServiceConfig
from tether.server.service import TetherService
from tether.shared.checkpoint import fingerprint
from tether.shared.drafter_loading import load_drafter
from tether.shared.tokenizer import Tokenizer
from tether.shared.weights import TOKENIZER_TENSOR, TensorEntry, canonical_tokenizer_json
from tether.v1 import tether_pb2 as pb
from tether.v1 import tether_pb2_grpc

PROMPT = "def read_config(path):\n    with open(path"
NEW = 24


class Served:
    """A server of the toy target, with its drafter or none, and a stub on its own channel."""

    def __init__(self, target, tok, drafter=None):
        self.service = TetherService(Engine(target, drafter, tok, ServiceConfig(),
                                     model_fingerprint=fingerprint(toy_model_dir())))  # fmt: skip
        self.server, port = make_server(self.service, "127.0.0.1:0")
        self.server.start()
        self.address = f"127.0.0.1:{port}"
        self.channel = grpc.insecure_channel(self.address)
        self.stub = tether_pb2_grpc.TetherStub(self.channel)
        self.info = self.stub.GetModelInfo(pb.GetModelInfoRequest())

    def close(self) -> None:
        self.channel.close()
        self.server.stop(None)
        self.service.engine.close()


@pytest.fixture(scope="module")
def model():
    return load(toy_model_dir(), "cpu")


@pytest.fixture(scope="module")
def alone(model):
    """A server without a drafter (`serve --drafter none`)."""
    served = Served(*model)
    yield served
    served.close()


class Relay:
    """The real stub with FetchWeights watched: requests kept, data bytes counted; `edit(manifest)` changes the
    manifest and `data`, when given, replaces the tokenizer's bytes (the manifest's entry left as `edit` makes it)."""

    def __init__(self, stub, edit=None, data: bytes | None = None):
        self.stub, self.edit, self.data = stub, edit, data
        self.requests: list[pb.FetchWeightsRequest] = []
        self.received = 0

    def FetchWeights(self, req, **kw):
        self.requests.append(pb.FetchWeightsRequest.FromString(req.SerializeToString()))
        return self._watch(self.stub.FetchWeights(req, **kw), req)

    def _watch(self, stream, req):
        first = next(stream)
        if self.edit is not None:
            self.edit(first.manifest)
        yield first
        if self.data is not None:
            stream.cancel()
            data = self.data[req.resume_offset :]
            self.received += len(data)
            yield pb.WeightChunk(chunk=pb.TensorChunk(tensor=TOKENIZER_TENSOR, offset=req.resume_offset, data=data))
            return
        for msg in stream:
            self.received += len(msg.chunk.data)
            yield msg


def entry(manifest: pb.WeightManifest) -> pb.TensorEntry:
    return manifest.tensors[0]


def test_a_client_without_a_tokenizer_generates_what_the_server_generates_alone(alone, model, tmp_path):
    assert alone.info.server_only and list(alone.info.client_part_formats) == [pb.CLIENT_PART_TOKENIZER]
    session = EdgeSession(ClientConfig(server=alone.address, max_new_tokens=NEW, cache_dir=str(tmp_path)))
    downloads = []
    session.on_event = lambda e: downloads.append((e.count, e.total)) if e.kind == "download" else None
    try:
        tok = server_tokenizer(session)
        info = session.model_info()
        alone_here = ServerOnlySession(session.link.stub, session.link.metadata, session.cfg, info, tok)
        result = alone_here.run(tok.encode(PROMPT))
    finally:
        session.close()
    assert tok.sha256 == info.tokenizer_sha256 == model[1].sha256
    assert downloads and downloads[-1][0] == downloads[-1][1]  # the download was reported to its end
    plain = GenerateConfig(model=str(toy_model_dir()), drafter="none", prompt=PROMPT, max_new_tokens=NEW, device="cpu")
    own = generate_text(plain)
    assert result.token_ids == own["token_ids"] and result.continuation(tok, alone_here.stop_ids) == own["text"]
    assert result.stats.server_only


def test_the_part_is_the_canonical_json_from_any_server_and_only_it_comes_without_a_drafter(alone, model):
    target, tok = model
    messages = list(alone.stub.FetchWeights(pb.FetchWeightsRequest(model_fingerprint=alone.info.model_fingerprint,
                                                                   format=pb.CLIENT_PART_TOKENIZER)))  # fmt: skip
    man = messages[0].manifest
    data = b"".join(m.chunk.data for m in messages[1:])
    assert man.format == pb.CLIENT_PART_TOKENIZER and man.drafter_fingerprint == ""
    assert [(e.name, e.dtype, list(e.shape), e.nbytes) for e in man.tensors] == [
        (TOKENIZER_TENSOR, "uint8", [len(data)], len(data))]  # fmt: skip
    assert entry(man).sha256 == hashlib.sha256(data).hexdigest() == tok.sha256
    assert Tokenizer.from_json(data.decode()).sha256 == tok.sha256
    for fmt in (pb.CLIENT_PART_TENSORS, pb.CLIENT_PART_ONNX_FP32):
        with pytest.raises(grpc.RpcError) as e:
            list(alone.stub.FetchWeights(pb.FetchWeightsRequest(model_fingerprint=alone.info.model_fingerprint,
                                                                format=fmt)))  # fmt: skip
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert Refusal.of_rpc_error(e.value).reason == pb.REASON_NO_DRAFTER
    with_drafter = Served(target, tok, load_drafter(toy_model_dir("drafter"), target))
    try:
        assert pb.CLIENT_PART_TOKENIZER in with_drafter.info.client_part_formats
        req = pb.FetchWeightsRequest(model_fingerprint=with_drafter.info.model_fingerprint,
                                     format=pb.CLIENT_PART_TOKENIZER)  # fmt: skip
        theirs = list(with_drafter.stub.FetchWeights(req))
    finally:
        with_drafter.close()
    assert theirs[0].manifest.tensors == man.tensors
    assert theirs[0].manifest.drafter_fingerprint == with_drafter.info.drafter_fingerprint
    assert b"".join(m.chunk.data for m in theirs[1:]) == data


def test_a_cached_tokenizer_is_not_fetched_again_and_a_broken_download_resumes(alone, model, tmp_path):
    tok = model[1]
    watched = Relay(alone.stub)
    fetch_tokenizer(watched, alone.info, tmp_path / "whole")
    assert len(watched.requests) == 2 and watched.requests[0].manifest_only  # the manifest, then the bytes
    size = watched.received
    assert fetch_tokenizer(watched, alone.info, tmp_path / "whole").sha256 == tok.sha256
    assert len(watched.requests) == 2  # found by its hash: not one call to the server
    # A download another process left half done goes on from the byte it stopped at.
    data = canonical_tokenizer_json(tok.to_json())
    held = size // 2
    WeightCache(tmp_path / "half").write(TensorEntry(TOKENIZER_TENSOR, "uint8", (size,), size, tok.sha256), 0,
                                         data[:held])  # fmt: skip
    resumed = Relay(alone.stub)
    assert fetch_tokenizer(resumed, alone.info, tmp_path / "half").sha256 == tok.sha256
    assert resumed.requests[-1].resume_offset == held and resumed.received == size - held


def test_the_tokenizer_flag_overrides_the_servers(alone, tmp_path):
    session = EdgeSession(ClientConfig(server=alone.address, cache_dir=str(tmp_path)))
    try:
        assert server_tokenizer(session, toy_model_dir()).sha256 == alone.info.tokenizer_sha256
        other = tmp_path / "other.json"
        other.write_text(Tokenizer.train(texts=["x = 1\n"] * 10, vocab_size=260).to_json(), encoding="utf-8")
        with pytest.raises(ValueError, match="not the server's tokenizer"):
            server_tokenizer(session, other)
    finally:
        session.close()
    assert not any(tmp_path.rglob("*.bin"))  # nothing was fetched


def oversize(man):
    entry(man).nbytes = 64 << 20
    entry(man).shape[:] = [64 << 20]


def two_entries(man):
    man.tensors.add(name="vocab.json", dtype="uint8", shape=[1], nbytes=1, sha256="0" * 64)


def other_tokenizer_entry(data: bytes):
    def edit(man):
        entry(man).nbytes, entry(man).sha256 = len(data), hashlib.sha256(data).hexdigest()
        entry(man).shape[:] = [len(data)]

    return edit


OTHER = Tokenizer.train(texts=["x = 1\n"] * 10, vocab_size=260).to_json().encode()
HOSTILE = {
    "an oversized tokenizer": (oversize, None, Problem.WEIGHT_SIZE),
    "a second entry": (two_entries, None, Problem.MANIFEST),
    "an entry that names a path": (lambda m: setattr(entry(m), "name", "../tokenizer.json"), None, Problem.MANIFEST),
    "an entry that is not bytes": (lambda m: setattr(entry(m), "dtype", "float32"), None, Problem.MANIFEST),
    "another tokenizer's hash": (lambda m: setattr(entry(m), "sha256", "0" * 64), None, Problem.TOKENIZER),
    "another model": (lambda m: setattr(m, "model_fingerprint", "0" * 64), None, Problem.FINGERPRINT),
    "another format": (lambda m: setattr(m, "format", pb.CLIENT_PART_TENSORS), None, Problem.MANIFEST),
    "tampered bytes": (None, b"{" * 1000, Problem.CHECKSUM),
    "another tokenizer, its entry to match": (other_tokenizer_entry(OTHER), OTHER, Problem.TOKENIZER),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_hostile_tokenizer_part_is_refused_in_one_line(alone, tmp_path, case):
    edit, data, problem = HOSTILE[case]
    if data is not None and edit is None:  # tampered: the size the manifest says, other bytes
        size = len(b"".join(m.chunk.data for m in alone.stub.FetchWeights(pb.FetchWeightsRequest(
            model_fingerprint=alone.info.model_fingerprint, format=pb.CLIENT_PART_TOKENIZER))))  # fmt: skip
        data = (data * (size // len(data) + 1))[:size]
    liar = Relay(alone.stub, edit, data)
    with pytest.raises(ServerDataError) as e:
        fetch_tokenizer(liar, alone.info, tmp_path)
    assert e.value.problem == problem, e.value
    assert "\n" not in str(e.value)
    if data is None:
        assert liar.received == 0 and not any(tmp_path.rglob("*.*"))  # refused from the manifest alone
    assert not any(tmp_path.rglob("*.bin"))  # nothing refused is ever kept


def test_an_older_server_or_a_malformed_hash_is_refused_before_any_call(alone, tmp_path):
    watched = Relay(alone.stub)
    old = pb.ModelInfo.FromString(alone.info.SerializeToString())
    del old.client_part_formats[:]  # a server older than the tokenizer part
    with pytest.raises(FormatNotOffered, match="--tokenizer"):
        fetch_tokenizer(watched, old, tmp_path)
    old.tokenizer_sha256 = "../" + "0" * 61
    with pytest.raises(ServerDataError) as e:
        fetch_tokenizer(watched, old, tmp_path)
    assert e.value.problem == Problem.CACHE_KEY and watched.requests == []
