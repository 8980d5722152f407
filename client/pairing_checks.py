"""What the client checks of the server's model description before it downloads or allocates anything.

A server (or whoever answers at its address) decides every field of ModelInfo and of the weight manifest. The
client accepts them only when they agree with each other and stay within bounds it sets itself:
- `check_model_info(info)` -> (ModelConfig, DrafterConfig): the config JSON is at most MAX_CONFIG_JSON bytes and
  an object whose fields have the dataclass's types and values in sane ranges (MODEL_LIMITS, DRAFTER_LIMITS);
  the drafter fits the target (TLI depth, LSA width) and the sha256 identities that name files are 64 hex digits.
- `expected_client_part(cfg, dcfg)` -> {name: (shape, floating)}: what the client part must hold, computed from
  the configs on the meta device (nothing allocated), the same way the server computes what it sends
  (tether.shared.weights.client_part_tensors).
- `check_manifest(entries, cfg, dcfg, max_bytes=...)`: every expected tensor present exactly once and nothing
  else; each shape exactly the expected one; a known dtype (a float dtype for float tensors, the tokenizer's
  bytes as uint8); nbytes == prod(shape) * itemsize; the tokenizer at most MAX_TOKENIZER_BYTES; the whole at
  most `max_bytes`; cache keys well formed. So a lying manifest is refused before a byte is written.
Every refusal is a ServerDataError (tether.client.errors) with Problem MODEL_INFO, FINGERPRINT, MANIFEST,
WEIGHT_SIZE or CACHE_KEY.

    cfg, dcfg = check_model_info(info)
    check_manifest(manifest_entries(reply.manifest), cfg, dcfg, max_bytes=2048 << 20)
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections.abc import Mapping
from types import MappingProxyType

import torch

from tether.client.errors import Problem, ServerDataError
from tether.client.weight_cache import is_sha256
from tether.shared.config import ModelConfig
from tether.shared.drafter import DrafterConfig, build_drafter
from tether.shared.model import Transformer
from tether.shared.weights import TOKENIZER_TENSOR, TensorEntry, client_part_tensors
from tether.v1 import tether_pb2 as pb

MAX_CONFIG_JSON = 64 << 10  # bytes of model_config_json / drafter_config_json (a real config is under 1 KB)
MAX_TOKENIZER_BYTES = 32 << 20  # the tokenizer's JSON (Llama 3's is 9 MB)
MAX_FINGERPRINT_CHARS = 256  # model_fingerprint is compared and saved, never parsed
MAX_ROPE_SCALING_ITEMS = 16
# Inclusive integer ranges: far beyond any model an edge client pairs with, far below what would overflow a
# shape or make building the meta model slow.
MODEL_LIMITS = {
    "vocab_size": (1, 1 << 21),
    "dim": (1, 1 << 16),
    "n_layers": (1, 1 << 10),
    "n_heads": (1, 1 << 10),
    "n_kv_heads": (1, 1 << 10),
    "head_dim": (1, 1 << 12),
    "ffn_dim": (1, 1 << 18),
    "max_seq_len": (1, 1 << 22),
}
DRAFTER_LIMITS = {
    "tli": (0, 1 << 10),
    "n_heads": (1, 1 << 10),
    "n_kv_heads": (1, 1 << 10),
    "head_dim": (1, 1 << 12),
    "ffn_dim": (1, 1 << 18),
    "lsa_heads": (1, 1 << 10),
    "lsa_kv_heads": (1, 1 << 10),
    "lsa_ffn_dim": (1, 1 << 18),
    "eagle_ffn_dim": (0, 1 << 18),
}
FLOAT_DTYPES = {"float32": 4, "bfloat16": 2, "float16": 2}  # what a float tensor may travel as
ITEMSIZE = FLOAT_DTYPES | {"uint8": 1, "int8": 1, "int16": 2, "int32": 4, "int64": 8, "bool": 1}


def _parse_config(text: str, what: str) -> dict:
    if len(text.encode()) > MAX_CONFIG_JSON:
        raise ServerDataError(Problem.MODEL_INFO, f"{what} is {len(text.encode())} bytes, over {MAX_CONFIG_JSON}")
    try:
        d = json.loads(text)
    except ValueError as e:
        raise ServerDataError(Problem.MODEL_INFO, f"{what} is not JSON: {e}") from None
    if not isinstance(d, dict):
        raise ServerDataError(Problem.MODEL_INFO, f"{what} is not a JSON object")
    return d


def _check_fields(d: dict, cls, limits: dict[str, tuple[int, int]], what: str) -> None:
    """Each value has its field's type (an int is a float's value too, a bool is never an int) and range."""
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    for key, value in d.items():
        if key not in defaults:
            raise ServerDataError(Problem.MODEL_INFO, f"{what}: unknown field {key!r}")
        default = defaults[key]
        if key == "rope_scaling":
            ok = value is None or (
                isinstance(value, dict)
                and len(value) <= MAX_ROPE_SCALING_ITEMS
                and all(isinstance(v, str | int | float) and not isinstance(v, bool) for v in value.values())
            )
        elif isinstance(default, bool):
            ok = isinstance(value, bool)
        elif isinstance(default, int):
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif isinstance(default, float):
            ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value > 0
        else:
            ok = isinstance(value, str) and len(value) <= MAX_FINGERPRINT_CHARS
        if not ok:
            raise ServerDataError(Problem.MODEL_INFO, f"{what}: field {key!r} has a bad value {str(value)[:80]!r}")
        if key in limits and not limits[key][0] <= value <= limits[key][1]:
            lo, hi = limits[key]
            raise ServerDataError(Problem.MODEL_INFO, f"{what}: {key}={value} is outside [{lo}, {hi}]")


def check_model_info(info: pb.ModelInfo) -> tuple[ModelConfig, DrafterConfig]:
    """The target's and drafter's configs from `info`, refused unless well formed and sane (module docstring)."""
    for what in ("drafter_fingerprint", "tokenizer_sha256"):
        if not is_sha256(getattr(info, what)):
            raise ServerDataError(
                Problem.CACHE_KEY, f"{what} {getattr(info, what)[:80]!r} is not 64 lowercase hex digits"
            )
    if not 0 < len(info.model_fingerprint) <= MAX_FINGERPRINT_CHARS:
        raise ServerDataError(
            Problem.MODEL_INFO, f"model_fingerprint must hold 1 to {MAX_FINGERPRINT_CHARS} characters"
        )
    model = _parse_config(info.model_config_json, "model_config_json")
    drafter = _parse_config(info.drafter_config_json, "drafter_config_json")
    _check_fields(model, ModelConfig, MODEL_LIMITS, "model_config_json")
    _check_fields(drafter, DrafterConfig, DRAFTER_LIMITS, "drafter_config_json")
    try:
        cfg, dcfg = ModelConfig.from_dict(model), DrafterConfig.from_dict(drafter)
    except (ValueError, TypeError) as e:
        raise ServerDataError(Problem.MODEL_INFO, str(e)) from None
    if dcfg.kind not in ("moa", "eagle"):
        raise ServerDataError(Problem.MODEL_INFO, f"unknown drafter kind {dcfg.kind!r}")
    if dcfg.tli > cfg.n_layers or info.tli_layers != dcfg.tli:
        raise ServerDataError(
            Problem.MODEL_INFO,
            f"TLI depth {dcfg.tli} (info says {info.tli_layers}) does not fit a {cfg.n_layers}-layer target",
        )
    return cfg, dcfg


@functools.lru_cache(maxsize=8)  # building even a meta model takes a tenth of a second; chat pairs every line
def expected_client_part(cfg: ModelConfig, dcfg: DrafterConfig) -> Mapping[str, tuple[tuple[int, ...], bool]]:
    """{name: (shape, is floating)} of the client part the configs imply (the tokenizer aside)."""
    try:
        with torch.device("meta"):  # shapes only: an 8B target costs no memory here
            target = Transformer(cfg)
            drafter = build_drafter(target, dcfg)
    except (ValueError, RuntimeError, KeyError, TypeError) as e:  # e.g. an LSA width its heads do not divide
        raise ServerDataError(Problem.MODEL_INFO, f"the configs do not build a model: {e}") from None
    part = client_part_tensors(target, drafter)
    return MappingProxyType({name: (tuple(t.shape), t.is_floating_point()) for name, t in part.items()})


def manifest_entries(manifest: pb.WeightManifest) -> list[TensorEntry]:
    return [TensorEntry(e.name, e.dtype, tuple(e.shape), e.nbytes, e.sha256) for e in manifest.tensors]


def check_manifest(entries: list[TensorEntry], cfg: ModelConfig, dcfg: DrafterConfig, *, max_bytes: int) -> None:
    """Refuse a manifest that is not exactly the client part of (cfg, dcfg), or over `max_bytes` in all."""
    expected = expected_client_part(cfg, dcfg)
    names = [e.name for e in entries]
    if len(set(names)) != len(names):
        raise ServerDataError(Problem.MANIFEST, "a tensor is listed twice")
    unknown = set(names) - expected.keys() - {TOKENIZER_TENSOR}
    missing = (expected.keys() | {TOKENIZER_TENSOR}) - set(names)
    if unknown or missing:
        extra = [n[:80] for n in sorted(unknown)[:3]]
        raise ServerDataError(
            Problem.MANIFEST, f"tensors the config does not imply: {extra}; missing: {sorted(missing)[:3]}"
        )
    for e in entries:
        if e.name == TOKENIZER_TENSOR:
            if e.dtype != "uint8" or e.shape != (e.nbytes,) or not 0 < e.nbytes <= MAX_TOKENIZER_BYTES:
                raise ServerDataError(
                    Problem.MANIFEST,
                    f"the tokenizer must be 1 to {MAX_TOKENIZER_BYTES} uint8 bytes, "
                    f"not {e.dtype} {list(e.shape)} of {e.nbytes} bytes",
                )
        else:
            shape, floating = expected[e.name]
            if e.shape != shape:
                raise ServerDataError(
                    Problem.MANIFEST, f"tensor {e.name!r} has shape {list(e.shape)}, the config implies {list(shape)}"
                )
            if (e.dtype not in FLOAT_DTYPES) if floating else (e.dtype not in ITEMSIZE or e.dtype in FLOAT_DTYPES):
                raise ServerDataError(Problem.MANIFEST, f"tensor {e.name!r} has dtype {e.dtype[:40]!r}")
        if e.nbytes != math.prod(e.shape) * ITEMSIZE[e.dtype]:
            raise ServerDataError(
                Problem.MANIFEST,
                f"tensor {e.name!r} declares {e.nbytes} bytes, its shape and dtype "
                f"hold {math.prod(e.shape) * ITEMSIZE[e.dtype]}",
            )
        if not is_sha256(e.sha256):
            raise ServerDataError(
                Problem.CACHE_KEY, f"tensor {e.name!r}: sha256 {e.sha256[:80]!r} is not 64 lowercase hex"
            )
    total = sum(e.nbytes for e in entries)
    if total > max_bytes:
        raise ServerDataError(
            Problem.WEIGHT_SIZE,
            f"the client part is {total >> 20} MiB, over the client's limit of "
            f"{max_bytes >> 20} MiB (--max-weights-mb)",
        )
