"""Pairing with a server: learn what it runs, download the client part once, build the edge drafter from it.

Contract:
- `fetch_client_part(stub, info, cache_dir, metadata=..., max_bytes=...)` checks `info` and the manifest
  before downloading anything (tether.client.pairing_checks: every tensor the configs imply, shapes, dtypes,
  sizes, at most `max_bytes` in all), then streams every tensor the client needs (tether.shared.weights),
  resuming from what `cache_dir` already holds after a broken download (also across processes), verifies each
  tensor's sha256 and the drafter fingerprint, and returns {name: tensor}. A server whose fingerprints differ
  from `info` (another model behind the same address) is refused, and so is a stream whose chunks do not fit
  the manifest.
- `build_client_models(info, tensors)` -> ClientModels: the target's client part (embeddings, last N layers,
  final norm, head; the other layers are never allocated), the drafter with its client-side weights, and the
  tokenizer (it travels in the weight stream, checked against info.tokenizer_sha256). Computation is fp32.
Every refusal is a PairingError or WeightCacheError, both ServerDataError (tether.client.errors). The torch-free
pairing of an ONNX client part is tether.client.onnx_pairing; both share the checks and the download loop of
tether.client.pairing_checks.

    info = stub.GetModelInfo(pb.GetModelInfoRequest())
    models = build_client_models(info, fetch_client_part(stub, info, "~/.cache/tether"))
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from tether.client.errors import Problem
from tether.client.pairing_checks import DEFAULT_MAX_BYTES as DEFAULT_MAX_BYTES
from tether.client.pairing_checks import PairingError as PairingError
from tether.client.pairing_checks import (
    check_manifest,
    check_model_info,
    check_tokenizer,
    download,
    manifest_entries,
    request_manifest,
)
from tether.client.weight_cache import WeightCache
from tether.shared.model import Transformer
from tether.shared.tokenizer import Tokenizer
from tether.shared.weights import TOKENIZER_TENSOR, ClientPartMismatch, build_client_part, drafter_fingerprint
from tether.v1 import tether_pb2 as pb


@dataclass
class ClientModels:
    target: Transformer  # only the client part is materialised
    drafter: torch.nn.Module
    tokenizer: Tokenizer
    info: pb.ModelInfo


def fetch_client_part(
    stub,
    info: pb.ModelInfo,
    cache_dir: str | Path,
    *,
    metadata: tuple = (),
    timeout_s: float = 120.0,
    on_progress: Callable[[int, int], None] | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> dict[str, Tensor]:
    """Download (or find in the cache) the client part of `info`'s model; see the module docstring."""
    cfg, dcfg = check_model_info(info)
    cache = WeightCache(Path(cache_dir).expanduser())
    req, man = request_manifest(stub, info, pb.CLIENT_PART_TENSORS, metadata=metadata, timeout_s=timeout_s)
    manifest = manifest_entries(man)
    check_manifest(manifest, cfg, dcfg, max_bytes=max_bytes)
    want = drafter_fingerprint(json.loads(info.drafter_config_json), manifest)
    if want != info.drafter_fingerprint:
        raise PairingError(
            Problem.FINGERPRINT, f"drafter fingerprint {info.drafter_fingerprint[:12]} does not match its manifest"
        )
    download(stub, req, man, manifest, cache, metadata=metadata, timeout_s=timeout_s, on_progress=on_progress)
    return cache.load(manifest)


def build_client_models(info: pb.ModelInfo, tensors: dict[str, Tensor]) -> ClientModels:
    cfg, dcfg = check_model_info(info)
    tokenizer = check_tokenizer(bytes(tensors[TOKENIZER_TENSOR].numpy()), info)
    try:
        target, drafter = build_client_part(cfg, dcfg, {k: v for k, v in tensors.items() if k != TOKENIZER_TENSOR})
    except ClientPartMismatch as e:
        raise PairingError(Problem.MANIFEST, str(e)) from None
    return ClientModels(target, drafter, tokenizer, info)
