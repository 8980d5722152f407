"""`tether-client generate` against a server that lies: one line on stderr, exit status 2, nothing written outside
the weight cache, and nothing downloaded before the model info and the manifest check out.

The fake server (plain gRPC on 127.0.0.1) describes a tiny model honestly, then each case changes one thing the
way a hostile server would, recomputing the drafter fingerprint so that the lie is self-consistent. It streams the
client part as tensors only (like a server older than the ONNX part), so the client runs `--backend torch`; the
ONNX part's hostile manifests are tests/client/test_onnx_pairing.py's.
"""

import dataclasses
import hashlib
import json
from concurrent import futures
from pathlib import Path

import grpc
import pytest
import torch
from tiny_models import tiny_moa_drafter, tiny_target
from toy_models import toy_model_dir

from tether.client.cli import main
from tether.shared.tokenizer import Tokenizer
from tether.shared.weights import (
    TOKENIZER_TENSOR,
    TensorEntry,
    build_manifest,
    client_part_tensors,
    iter_chunks,
    tokenizer_tensor,
)
from tether.v1 import tether_pb2 as pb
from tether.v1 import tether_pb2_grpc

TOKENIZER = toy_model_dir()


def sha256_json(obj: dict) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


@dataclasses.dataclass
class Model:
    """What an honest server of the tiny model would say; the cases edit a copy."""

    model_config: dict
    drafter_config: dict
    weights: dict[str, torch.Tensor]
    manifest: list[TensorEntry]
    tokenizer_sha256: str
    chunks_per_stream: int = 1 << 30  # a stream that breaks off early leaves a partial file where it was written

    def info(self) -> pb.ModelInfo:
        fp = sha256_json({"config": self.drafter_config, "tensors": [e.sha256 for e in self.manifest]})
        return pb.ModelInfo(protocol_version=1, model_id="tiny", model_config_json=json.dumps(self.model_config),
                            model_fingerprint="f" * 64, tokenizer_sha256=self.tokenizer_sha256,
                            drafter_config_json=json.dumps(self.drafter_config), drafter_fingerprint=fp,
                            tli_layers=self.drafter_config["tli"], max_draft_tokens=8)  # fmt: skip


@pytest.fixture(scope="module")
def honest() -> Model:
    target = tiny_target()
    drafter = tiny_moa_drafter(target)
    tok = Tokenizer.from_pretrained(TOKENIZER)
    weights = {k: v.to(torch.bfloat16) for k, v in client_part_tensors(target, drafter).items()}
    weights[TOKENIZER_TENSOR] = tokenizer_tensor(tok.to_json())
    return Model(target.cfg.to_dict(), drafter.dcfg.to_dict(), weights, build_manifest(weights), tok.sha256)


class FakeServer(tether_pb2_grpc.TetherServicer):
    """GetModelInfo and FetchWeights from `model`, whatever it claims; records what the client asks."""

    def __init__(self, model: Model):
        self.model = model
        self.requests: list[pb.FetchWeightsRequest] = []
        self.metadata: list[dict] = []

    def GetModelInfo(self, request, context):
        self.metadata.append(dict(context.invocation_metadata()))
        return self.model.info()

    def FetchWeights(self, request, context):
        self.requests.append(request)
        m = self.model
        entries = [pb.TensorEntry(name=e.name, dtype=e.dtype, shape=e.shape, nbytes=e.nbytes, sha256=e.sha256)
                   for e in m.manifest]  # fmt: skip
        yield pb.WeightChunk(manifest=pb.WeightManifest(model_fingerprint="f" * 64,
                             drafter_fingerprint=m.info().drafter_fingerprint, tensors=entries))  # fmt: skip
        if request.manifest_only:
            return
        # Chunks of the real bytes under the manifest's names, from wherever the client resumes.
        real = {e.name: e for e in build_manifest(m.weights)}
        served = [real[e.name] for e in m.manifest]
        chunks = iter_chunks(m.weights, served, request.resume_tensor, request.resume_offset, max_chunk=1000)
        for _, (name, offset, data) in zip(range(m.chunks_per_stream), chunks, strict=False):
            yield pb.WeightChunk(chunk=pb.TensorChunk(tensor=name, offset=offset, data=data))


@pytest.fixture
def serve():
    servers = []

    def start(model: Model) -> tuple[FakeServer, str]:
        fake = FakeServer(model)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        tether_pb2_grpc.add_TetherServicer_to_server(fake, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        return fake, f"127.0.0.1:{port}"

    yield start
    for server in servers:
        server.stop(None)


def entry(model: Model, name: str, **changes) -> Model:
    """A copy of `model` whose manifest entry `name` says something else."""
    manifest = [dataclasses.replace(e, **changes) if e.name == name else e for e in model.manifest]
    return dataclasses.replace(model, manifest=manifest)


def escape(model: Model, key: str) -> Model:
    """The first tensor's file named by `key`, its download broken off after one chunk: the old client left that
    chunk wherever `key` pointed."""
    first = model.manifest[0].name
    return dataclasses.replace(entry(model, first, sha256=key), chunks_per_stream=1)


def generate(address: str, cache: Path, *extra: str) -> list[str]:
    return ["generate", "--server", address, "--prompt", "def f(x):", "--json", "--cache-dir", str(cache),
            "--backend", "torch", "--connect-timeout-s", "5", "--backoff-initial-s", "0.01", "--backoff-max-s", "0.02",
            *extra]  # fmt: skip


EMBED = "target.model.embed_tokens.weight"


def cases(tmp: Path) -> dict:
    """name -> (edit of the honest model, the problem the one line names)."""
    return {
        "relative_path": (lambda m: escape(m, "../../escaped"), "cache key"),
        "absolute_path": (lambda m: escape(m, str(tmp / "escaped")), "cache key"),
        "uppercase_hex": (lambda m: entry(m, EMBED, sha256=entry_of(m, EMBED).sha256.upper()), "cache key"),
        # The shape contradicts the bytes (once a RuntimeError traceback when the tensor was rebuilt).
        "shape_vs_nbytes": (lambda m: entry(m, EMBED, shape=(7, 7)), "weight manifest"),
        # 1 GiB that the config does not imply: refused before a chunk is asked for.
        "one_gib": (lambda m: entry(m, EMBED, shape=(1 << 19, 1 << 10), nbytes=1 << 30), "weight manifest"),
        "unknown_dtype": (lambda m: entry(m, EMBED, dtype="Tensor"), "weight manifest"),
        "missing_tensor": (lambda m: dataclasses.replace(m, manifest=m.manifest[1:]), "weight manifest"),
        "wrong_checksum": (lambda m: entry(m, EMBED, sha256="0" * 64), "weight checksum"),
        "string_dim": (lambda m: dataclasses.replace(m, model_config=m.model_config | {"dim": "wide"}), "model info"),
        "huge_config": (
            lambda m: dataclasses.replace(m, model_config=m.model_config | {"pad": " " * (1 << 17)}),
            "model info",
        ),  # fmt: skip
        "tli_mismatch": (lambda m: dataclasses.replace(m, drafter_config=m.drafter_config | {"tli": 9}), "model info"),
    }


def entry_of(model: Model, name: str) -> TensorEntry:
    return next(e for e in model.manifest if e.name == name)


@pytest.mark.parametrize("case", list(cases(Path("."))))
def test_a_lying_server_ends_the_client_in_one_line_with_status_2(honest, serve, tmp_path, capsys, case):
    edit, problem = cases(tmp_path)[case]
    fake, address = serve(edit(honest))
    cache = tmp_path / "cache"
    status = main(generate(address, cache))
    outside = [p for p in tmp_path.rglob("*") if not p.is_relative_to(cache)]
    assert outside == [cache] or outside == [], outside
    assert status == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert f"the server sent an invalid {problem}:" in err, err
    if problem in ("model info", "cache key", "weight manifest"):  # refused before any download
        assert all(r.manifest_only for r in fake.requests), case
        assert not list((cache / "partial").glob("*")) if cache.exists() else True


def test_a_client_part_over_the_limit_is_refused_before_download(honest, serve, tmp_path, capsys):
    fake, address = serve(honest)
    assert main(generate(address, tmp_path / "cache", "--max-weights-mb", "0")) == 2
    err = capsys.readouterr().err
    assert "invalid weight size" in err and "--max-weights-mb" in err and err.count("\n") == 1
    assert all(r.manifest_only for r in fake.requests)


@pytest.mark.parametrize("source", ["env", "file"])
def test_the_api_key_comes_from_the_environment_or_a_file(honest, serve, tmp_path, capsys, monkeypatch, source):
    fake, address = serve(entry(honest, EMBED, shape=(7, 7)))  # any refusal ends the run after GetModelInfo
    extra = []
    if source == "env":
        monkeypatch.setenv("TETHER_API_KEY", "key-from-env")
    else:
        monkeypatch.delenv("TETHER_API_KEY", raising=False)
        (tmp_path / "key").write_text("key-from-file\n")
        extra = ["--api-key-file", str(tmp_path / "key")]
    assert main(generate(address, tmp_path / "cache", *extra)) == 2
    assert fake.metadata[0]["authorization"] == f"Bearer key-from-{source}"


def test_the_command_line_key_wins_and_two_sources_are_refused(honest, serve, tmp_path, capsys, monkeypatch):
    fake, address = serve(entry(honest, EMBED, shape=(7, 7)))
    monkeypatch.setenv("TETHER_API_KEY", "key-from-env")
    assert main(generate(address, tmp_path / "cache", "--api-key", "key-from-argv")) == 2
    assert fake.metadata[0]["authorization"] == "Bearer key-from-argv"
    (tmp_path / "key").write_text("k")
    assert main(generate(address, tmp_path / "cache", "--api-key", "a", "--api-key-file", str(tmp_path / "key"))) == 2
    assert "not both" in capsys.readouterr().err
    (tmp_path / "key").write_text("two keys\n")
    assert main(generate(address, tmp_path / "cache", "--api-key-file", str(tmp_path / "key"))) == 2
    assert "one API key" in capsys.readouterr().err
