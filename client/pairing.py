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
Every refusal is a PairingError or WeightCacheError, both ServerDataError (tether.client.errors).

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

from tether.client.errors import Problem, ServerDataError
from tether.client.pairing_checks import check_manifest, check_model_info, manifest_entries
from tether.client.weight_cache import WeightCache
from tether.shared.checkpoint import from_hf_name
from tether.shared.drafter import build_drafter
from tether.shared.model import Transformer, rope_frequencies
from tether.shared.tokenizer import Tokenizer
from tether.shared.weights import MAX_CHUNK, TOKENIZER_TENSOR
from tether.v1 import tether_pb2 as pb

DEFAULT_MAX_BYTES = 2048 << 20  # the client part's size limit when the caller gives none (ClientConfig.max_weights_mb)


class PairingError(ServerDataError):
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
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> dict[str, Tensor]:
    """Download (or find in the cache) the client part of `info`'s model; see the module docstring."""
    cfg, dcfg = check_model_info(info)
    cache = WeightCache(Path(cache_dir).expanduser())
    # The manifest alone first: a client whose cache holds everything downloads nothing more.
    req = pb.FetchWeightsRequest(model_fingerprint=info.model_fingerprint, manifest_only=True)
    man = _manifest(stub.FetchWeights(req, metadata=metadata, timeout=timeout_s))
    if man.model_fingerprint != info.model_fingerprint or man.drafter_fingerprint != info.drafter_fingerprint:
        raise PairingError(
            Problem.FINGERPRINT, "the weight manifest belongs to another model than the server described"
        )
    manifest = manifest_entries(man)
    check_manifest(manifest, cfg, dcfg, max_bytes=max_bytes)
    want = _sha256_json({"config": json.loads(info.drafter_config_json), "tensors": [e.sha256 for e in manifest]})
    if want != info.drafter_fingerprint:
        raise PairingError(
            Problem.FINGERPRINT, f"drafter fingerprint {info.drafter_fingerprint[:12]} does not match its manifest"
        )
    by_name = {e.name: e for e in manifest}
    total = sum(e.nbytes for e in manifest)
    point = cache.resume_point(manifest)
    if point is not None:
        # From where the cache stops (the start, or the middle of a download a dropped link broke).
        req = pb.FetchWeightsRequest(model_fingerprint=info.model_fingerprint, resume_tensor=point[0],
                                     resume_offset=point[1])  # fmt: skip
        stream = stub.FetchWeights(req, metadata=metadata, timeout=timeout_s)
        if _manifest(stream) != man:
            raise PairingError(Problem.MANIFEST, "the weight stream's manifest differs from the one checked")
        done = sum(cache.held_bytes(e) for e in manifest)
        for msg in stream:
            if msg.WhichOneof("body") != "chunk" or msg.chunk.tensor not in by_name:
                raise PairingError(Problem.CHUNK, "the weight stream sent something other than a chunk of the manifest")
            c = msg.chunk
            done += len(c.data)
            # A chunk sent twice is harmless, an endless stream of them is not.
            if done > total + MAX_CHUNK:
                raise PairingError(Problem.CHUNK, f"the weight stream sent over {done} bytes for {total}")
            cache.write(by_name[c.tensor], c.offset, c.data)
            if on_progress:
                on_progress(min(done, total), total)
        if cache.resume_point(manifest) is not None:
            raise ConnectionError("the weight stream ended before every tensor arrived")
    return cache.load(manifest)


def _manifest(stream) -> pb.WeightManifest:
    """The first message of a FetchWeights stream, which must be the manifest."""
    first = next(iter(stream), None)
    if first is None:
        raise ConnectionError("the weight stream ended before its manifest")
    if first.WhichOneof("body") != "manifest":
        raise PairingError(Problem.MANIFEST, "the weight stream does not start with its manifest")
    return first.manifest


def build_client_models(info: pb.ModelInfo, tensors: dict[str, Tensor]) -> ClientModels:
    cfg, dcfg = check_model_info(info)
    try:
        tokenizer = Tokenizer.from_json(bytes(tensors[TOKENIZER_TENSOR].numpy()).decode())
    except Exception as e:  # the tokenizers library raises its own types on text it cannot read
        raise PairingError(Problem.TOKENIZER, f"the tokenizer does not parse: {str(e)[:200]}") from None
    if tokenizer.sha256 != info.tokenizer_sha256:
        raise PairingError(Problem.TOKENIZER, "the tokenizer received does not match the server's tokenizer hash")
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
        raise PairingError(Problem.MANIFEST, f"the client part lacks {sorted(expected - state.keys())[:3]}")
    target.load_state_dict(state, strict=False, assign=True)
    target.eval()
    drafter = build_drafter(target, dcfg)
    dstate = {k.removeprefix("drafter."): v.float() for k, v in tensors.items() if k.startswith("drafter.")}
    result = drafter.load_state_dict(dstate, strict=False)
    absent = [k for k in result.missing_keys if not k.startswith("lsa.")]  # LSA runs on the server
    if absent or result.unexpected_keys:
        raise PairingError(Problem.MANIFEST, f"drafter weights do not fit its config: missing {absent[:3]}, "
                           f"unexpected {result.unexpected_keys[:3]}")  # fmt: skip
    return ClientModels(target, drafter.float().eval(), tokenizer, info)


def _named(root: torch.nn.Module, modules: list[torch.nn.Module]) -> list[tuple[str, torch.nn.Module]]:
    ids = {id(m) for m in modules}
    return [(name, m) for name, m in root.named_modules() if id(m) in ids]
