"""Pairing with a server: learn what it runs, download the client part once, build the edge drafter from it.

Contract:
- `fetch_client_part(stub, info, cache_dir, metadata=...)` streams the manifest and every tensor the client
  needs (tether.shared.weights), resuming from what `cache_dir` already holds after a broken download (also
  across processes), verifies each tensor's sha256 and the drafter fingerprint, and returns {name: tensor}.
  A server whose fingerprints differ from `info` (another model behind the same address) is refused.
- `build_client_models(info, tensors)` -> ClientModels: the target's client part (embeddings, last N layers,
  final norm, head; the other layers are never allocated), the drafter with its client-side weights, and the
  tokenizer (it travels in the weight stream, checked against info.tokenizer_sha256). Computation is fp32.

    info = stub.GetModelInfo(pb.GetModelInfoRequest())
    models = build_client_models(info, fetch_client_part(stub, info, "~/.cache/tether"))
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from tether.client.weight_cache import WeightCache
from tether.shared.checkpoint import from_hf_name
from tether.shared.config import ModelConfig
from tether.shared.drafter import DrafterConfig, build_drafter
from tether.shared.model import Transformer, rope_frequencies
from tether.shared.tokenizer import Tokenizer
from tether.shared.weights import TOKENIZER_TENSOR, TensorEntry
from tether.v1 import tether_pb2 as pb


class PairingError(RuntimeError):
    """The server's model is not one this client can pair with (or its download does not check out)."""


@dataclass
class ClientModels:
    target: Transformer  # only the client part is materialised
    drafter: torch.nn.Module
    tokenizer: Tokenizer
    info: pb.ModelInfo


def _sha256_json(obj: dict) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def fetch_client_part(
    stub,
    info: pb.ModelInfo,
    cache_dir: str | Path,
    *,
    metadata: tuple = (),
    timeout_s: float = 120.0,
    on_progress: Callable[[int, int], None] | None = None,
) -> dict[str, Tensor]:
    """Download (or find in the cache) the client part of `info`'s model; see the module docstring."""
    cache = WeightCache(Path(cache_dir).expanduser())
    # The manifest alone first: a client whose cache holds everything downloads nothing more.
    req = pb.FetchWeightsRequest(model_fingerprint=info.model_fingerprint, manifest_only=True)
    man = next(iter(stub.FetchWeights(req, metadata=metadata, timeout=timeout_s))).manifest
    if man.model_fingerprint != info.model_fingerprint or man.drafter_fingerprint != info.drafter_fingerprint:
        raise PairingError("the weight manifest belongs to another model than the server described")
    manifest = [TensorEntry(e.name, e.dtype, tuple(e.shape), e.nbytes, e.sha256) for e in man.tensors]
    want = _sha256_json({"config": json.loads(info.drafter_config_json), "tensors": [e.sha256 for e in manifest]})
    if want != info.drafter_fingerprint:
        raise PairingError(f"drafter fingerprint {info.drafter_fingerprint[:12]} does not match its manifest")
    by_name = {e.name: e for e in manifest}
    total = sum(e.nbytes for e in manifest)
    point = cache.resume_point(manifest)
    if point is not None:
        # From where the cache stops (the start, or the middle of a download a dropped link broke).
        req = pb.FetchWeightsRequest(model_fingerprint=info.model_fingerprint, resume_tensor=point[0],
                                     resume_offset=point[1])  # fmt: skip
        stream = stub.FetchWeights(req, metadata=metadata, timeout=timeout_s)
        next(stream)  # the manifest again
        done = sum(cache.held_bytes(e) for e in manifest)
        for msg in stream:
            c = msg.chunk
            cache.write(by_name[c.tensor], c.offset, c.data)
            done += len(c.data)
            if on_progress:
                on_progress(done, total)
        if cache.resume_point(manifest) is not None:
            raise ConnectionError("the weight stream ended before every tensor arrived")
    return cache.load(manifest)


def build_client_models(info: pb.ModelInfo, tensors: dict[str, Tensor]) -> ClientModels:
    cfg = ModelConfig.from_dict(json.loads(info.model_config_json))
    dcfg = DrafterConfig.from_dict(json.loads(info.drafter_config_json))
    tok_json = bytes(tensors[TOKENIZER_TENSOR].numpy()).decode()
    tokenizer = Tokenizer.from_json(tok_json)
    if tokenizer.sha256 != info.tokenizer_sha256:
        raise PairingError("the tokenizer received does not match the server's tokenizer hash")
    # Build on the meta device and materialise only the client part: an 8B target's other layers would
    # otherwise take the edge device's memory for nothing.
    with torch.device("meta"):
        target = Transformer(cfg)
    n = cfg.n_layers
    keep = [target.embed_tokens, target.norm, *target.layers[n - dcfg.tli :]]
    keep += [m for m in (target.embed_norm, target.lm_head) if m is not None]
    for m in keep:
        m.to_empty(device="cpu")
    target.register_buffer("inv_freq", rope_frequencies(cfg), persistent=False)
    state = {from_hf_name(k.removeprefix("target.")): v.float() for k, v in tensors.items() if k.startswith("target.")}
    expected = {f"{prefix}.{p}" for prefix, m in _named(target, keep) for p, _ in m.named_parameters()}
    if not expected <= state.keys():
        raise PairingError(f"the client part lacks {sorted(expected - state.keys())[:3]}")
    target.load_state_dict(state, strict=False, assign=True)
    target.eval()
    drafter = build_drafter(target, dcfg)
    dstate = {k.removeprefix("drafter."): v.float() for k, v in tensors.items() if k.startswith("drafter.")}
    result = drafter.load_state_dict(dstate, strict=False)
    absent = [k for k in result.missing_keys if not k.startswith("lsa.")]  # LSA runs on the server
    if absent or result.unexpected_keys:
        raise PairingError(f"drafter weights do not fit its config: missing {absent[:3]}, "
                           f"unexpected {result.unexpected_keys[:3]}")  # fmt: skip
    return ClientModels(target, drafter.float().eval(), tokenizer, info)


def _named(root: torch.nn.Module, modules: list[torch.nn.Module]) -> list[tuple[str, torch.nn.Module]]:
    ids = {id(m) for m in modules}
    return [(name, m) for name, m in root.named_modules() if id(m) in ids]
