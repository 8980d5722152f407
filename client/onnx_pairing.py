"""Pairing without torch: fetch the ONNX client part the server exported, check it, and draft with onnxruntime.

The server exports the client part to ONNX once per drafter and precision (tether.server.client_export) and streams
its files through FetchWeights (ClientPartFormat in tether.v1): onnx_drafter.json (the description), per graph
<graph>.onnx and <graph>.safetensors (its matrices, in the precision), and tokenizer.json. This module, like
everything it imports, never imports torch: an edge install needs numpy, onnxruntime, safetensors, tokenizers
and gRPC only.

Contract: `fetch_onnx_part(stub, info, cache_dir, *, precision="fp32", metadata=(), timeout_s=120.0,
on_progress=None, max_bytes=DEFAULT_MAX_BYTES, threads=1, tree_width=0)` -> OnnxClientPart(drafter, tokenizer,
nbytes); `threads` is the drafter's onnxruntime intra-op thread count and `tree_width` the top_k of the trees it will
draft (OnnxDrafter.from_files). In order:
- before anything is downloaded: `info` is checked (tether.client.pairing_checks.check_model_info) and must list the
  format; the manifest alone is asked for and must be of that format and of info's model and drafter, its entries
  exactly the fixed file names of the drafter's kind, uint8, each within its bound and all within `max_bytes`;
- the download resumes from what `cache_dir` already holds (a WeightCache: files named by their sha256, which
  must be 64 hex digits; a broken download goes on from the byte it stopped at, also in another process) and
  every entry's sha256 is checked;
- the description (at most MAX_DESCRIPTION_BYTES) must agree with `info`: its format version, the drafter kind and
  config, the shapes the runtime allocates from, the target fingerprint, exactly the kind's graphs with their
  fixed file names, their sha256 the manifest's, their inputs and outputs the graph contract
  (tether.shared.weights.onnx_graph_io), the precision asked, and weight tensors whose stored bytes fit their file
  (so widening int8 or fp16 to fp32 allocates at most 4x what was downloaded); the tokenizer has info's hash;
- each graph must hold only what the exporter emits, within the bounds info's configs imply
  (tether.client.onnx_graph_policy: no control flow, no other operator domain, no tensor or static shape larger
  than the model's own), before onnxruntime sees it;
- tether.client.onnx_drafter.OnnxDrafter.from_files then checks each weights file holds exactly the tensors
  described and that onnxruntime's view of each graph has the described inputs and outputs; drafting runs under a
  memory and a time bound (tether.client.onnx_bounds).
Refusals are PairingError or WeightCacheError (tether.client.errors.ServerDataError, `.problem` says what); a
stream that breaks raises ConnectionError or grpc.RpcError, and calling again resumes.

    info = stub.GetModelInfo(pb.GetModelInfoRequest())
    part = fetch_onnx_part(stub, info, "~/.cache/tether", precision="int8")
    part.drafter.begin(prompt_delta)

Tests: tests/client/test_onnx_pairing.py (a real server in-process, each precision, resume, hostile manifests,
a child process with torch blocked).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tether.client.errors import Problem
from tether.client.onnx_drafter import FORMAT_VERSION, OnnxDrafter
from tether.client.onnx_graph_policy import GraphLimits, GraphRefused, check_graph
from tether.client.pairing_checks import (
    DEFAULT_MAX_BYTES,
    MAX_FINGERPRINT_CHARS,
    PairingError,
    check_model_info,
    check_onnx_manifest,
    check_tokenizer,
    download,
    manifest_entries,
    request_manifest,
)
from tether.client.weight_cache import WeightCache
from tether.shared.config import ModelConfig
from tether.shared.drafter_config import DrafterConfig
from tether.shared.tokenizer import Tokenizer
from tether.shared.weights import (
    ONNX_MANIFEST,
    TOKENIZER_TENSOR,
    TensorEntry,
    onnx_graph_io,
    stored_layout,
)
from tether.v1 import tether_pb2 as pb

FORMATS = {"fp32": pb.CLIENT_PART_ONNX_FP32, "fp16": pb.CLIENT_PART_ONNX_FP16, "int8": pb.CLIENT_PART_ONNX_INT8}
ITEMSIZE = {"float32": 4, "float16": 2, "int8": 1}
MAX_WEIGHT_TENSORS = 1 << 16  # per graph; a real one has a few hundred
MAX_DIMS = 8


@dataclass(frozen=True)
class OnnxClientPart:
    drafter: OnnxDrafter
    tokenizer: Tokenizer
    nbytes: int  # the part's bytes, as downloaded (or found in the cache)


def fetch_onnx_part(
    stub,
    info: pb.ModelInfo,
    cache_dir: str | Path,
    *,
    precision: str = "fp32",
    metadata: tuple = (),
    timeout_s: float = 120.0,
    on_progress: Callable[[int, int], None] | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
    threads: int = 1,
    tree_width: int = 0,
) -> OnnxClientPart:
    """Download (or find in the cache) the ONNX client part of `info`'s drafter; see the module docstring."""
    if precision not in FORMATS:
        raise ValueError(f"precision must be one of {', '.join(FORMATS)}, got {precision!r}")
    cfg, dcfg = check_model_info(info)
    fmt = FORMATS[precision]
    if fmt not in info.client_part_formats:
        raise PairingError(
            Problem.MODEL_INFO,
            f"the server does not offer the ONNX client part in {precision} "
            "(a server older than this client streams tensors only)",
        )
    cache = WeightCache(Path(cache_dir).expanduser())
    req, man = request_manifest(stub, info, fmt, metadata=metadata, timeout_s=timeout_s)
    entries = manifest_entries(man)
    check_onnx_manifest(entries, dcfg.kind, max_bytes=max_bytes)
    download(stub, req, man, entries, cache, metadata=metadata, timeout_s=timeout_s, on_progress=on_progress)
    by_name = {e.name: e for e in entries}
    files = {e.name: cache.blob(e) for e in entries}
    description = _description(files[ONNX_MANIFEST].read_bytes())
    check_description(description, cfg, dcfg, precision, by_name)
    tokenizer = check_tokenizer(files[TOKENIZER_TENSOR].read_bytes(), info)
    check_graphs(description, files, GraphLimits.of(cfg, dcfg))
    try:
        drafter = OnnxDrafter.from_files(description, files, threads=threads, tree_width=tree_width)
    except ValueError as e:
        raise PairingError(Problem.MANIFEST, f"the ONNX part does not load: {str(e)[:300]}") from None
    except Exception as e:  # onnxruntime raises its own types on a graph it refuses
        raise PairingError(
            Problem.MANIFEST, f"onnxruntime refuses the ONNX part: {type(e).__name__}: {str(e)[:300]}"
        ) from None
    return OnnxClientPart(drafter, tokenizer, sum(e.nbytes for e in entries))


def _description(data: bytes) -> dict:
    try:
        description = json.loads(data)
    except ValueError as e:  # UnicodeDecodeError included
        raise PairingError(Problem.MANIFEST, f"{ONNX_MANIFEST} is not JSON: {str(e)[:200]}") from None
    if not isinstance(description, dict):
        raise PairingError(Problem.MANIFEST, f"{ONNX_MANIFEST} is not a JSON object")
    return description


def expected_shapes(cfg: ModelConfig, dcfg: DrafterConfig) -> dict[str, int]:
    """The description's `shapes` (what the runtime allocates its caches from), as info's configs imply them."""
    return {
        "vocab_size": cfg.vocab_size,
        "dim": cfg.dim,
        "max_seq_len": cfg.max_seq_len,
        "tli": dcfg.tli if dcfg.kind == "moa" else 0,
        "draft_kv_heads": dcfg.n_kv_heads,
        "draft_head_dim": dcfg.head_dim,
        "target_kv_heads": cfg.n_kv_heads,
        "target_head_dim": cfg.head_dim,
    }


def check_description(
    d: dict, cfg: ModelConfig, dcfg: DrafterConfig, precision: str, entries: dict[str, TensorEntry]
) -> None:
    """Refuse a description (onnx_drafter.json) that does not agree with info's configs and the manifest."""

    def need(ok: bool, what: str) -> None:
        if not ok:
            raise PairingError(Problem.MANIFEST, f"{ONNX_MANIFEST}: {what}")

    need(d.get("format_version") == FORMAT_VERSION, f"format version is not {FORMAT_VERSION}")
    need(d.get("kind") == dcfg.kind, f"the drafter kind is not the server's {dcfg.kind!r}")
    need(d.get("drafter_config") == dcfg.to_dict(), "the drafter config differs from the server's model info")
    need(d.get("target_fingerprint") == dcfg.target_fingerprint, "the target fingerprint differs from the config's")
    need(d.get("shapes") == expected_shapes(cfg, dcfg), "the shapes differ from what the model info implies")
    io = onnx_graph_io(dcfg.kind, dcfg.tli)
    graphs = d.get("graphs")
    need(isinstance(graphs, dict) and graphs.keys() == io.keys(), f"the graphs are not {', '.join(io)}")
    for name, g in graphs.items():
        need(isinstance(g, dict), f"graph {name!r} is not an object")
        need(
            g.get("file") == f"{name}.onnx" and g.get("sha256") == entries[f"{name}.onnx"].sha256,
            f"graph {name!r} names another file than {name}.onnx",
        )
        need([g.get("inputs"), g.get("outputs")] == list(io[name]), f"graph {name!r} breaks the graph contract")
        w = g.get("weights")
        need(
            isinstance(w, dict)
            and w.get("file") == f"{name}.safetensors"
            and w.get("precision") == precision
            and w.get("sha256") == entries[f"{name}.safetensors"].sha256,
            f"graph {name!r}'s weights are not {name}.safetensors in {precision}",
        )
        stored = _stored_bytes(w.get("tensors"), precision, need)
        need(stored <= entries[f"{name}.safetensors"].nbytes, f"graph {name!r}'s weights do not fit their file")


def check_graphs(description: dict, files: dict[str, Path], limits: GraphLimits) -> None:
    """Refuse a part whose graphs hold anything the exporter does not emit (tether.client.onnx_graph_policy), before
    onnxruntime sees them; `description` is checked already."""
    for g in description["graphs"].values():
        try:
            check_graph(files[g["file"]].read_bytes(), limits, g["weights"]["tensors"])
        except GraphRefused as e:
            raise PairingError(Problem.GRAPH, f"{g['file']} is not a graph this client runs: {e}") from None


def _stored_bytes(tensors: Any, precision: str, need: Callable[[bool, str], None]) -> int:
    """Bytes a graph's weight tensors take as stored, after checking each is a named matrix of sane size."""
    need(isinstance(tensors, dict) and len(tensors) <= MAX_WEIGHT_TENSORS, "a weight list is not a small object")
    total = 0
    for name, shape in tensors.items():
        need(0 < len(name) <= MAX_FINGERPRINT_CHARS, "a weight name is empty or too long")
        ok = isinstance(shape, list) and 2 <= len(shape) <= MAX_DIMS
        ok = ok and all(isinstance(n, int) and not isinstance(n, bool) and 0 < n < 1 << 31 for n in shape)
        need(ok, f"weight {name[:80]!r} has a bad shape")
        for dtype, stored_shape in stored_layout(tuple(shape), precision).values():
            total += math.prod(stored_shape) * ITEMSIZE[dtype]
    return total
