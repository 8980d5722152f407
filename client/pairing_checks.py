"""What the client checks of the server's model description before it downloads or allocates anything.

A server (or whoever answers at its address) decides every field of ModelInfo and of the weight manifest. The
client accepts them only when they agree with each other and stay within bounds it sets itself:
- `check_model_info(info)` -> (ModelConfig, DrafterConfig): the config JSON is at most MAX_CONFIG_JSON bytes and
  an object whose fields have the dataclass's types and values in sane ranges (MODEL_LIMITS, DRAFTER_LIMITS);
  the drafter fits the target (TLI depth, LSA width), the sha256 identities that name files are 64 hex digits, and
  the end-of-text ids (at most MAX_EOS_IDS) are of the vocabulary.
- `expected_client_part(cfg, dcfg)` -> {name: (shape, floating)}: what the client part must hold, computed from
  the configs on the meta device (nothing allocated), the same way the server computes what it sends
  (tether.shared.weights.client_part_tensors).
- `check_manifest(entries, cfg, dcfg, max_bytes=...)`: every expected tensor present exactly once and nothing
  else; each shape exactly the expected one; a known dtype (a float dtype for float tensors, the tokenizer's
  bytes as uint8); nbytes == prod(shape) * itemsize; the tokenizer at most MAX_TOKENIZER_BYTES; the whole at
  most `max_bytes`; cache keys well formed. So a lying manifest is refused before a byte is written.
- `check_onnx_manifest(entries, kind, max_bytes=...)`: the same for an ONNX client part, whose entries are files:
  exactly the fixed names of tether.shared.weights.onnx_entries, each uint8 [nbytes], non-empty, the description
  at most MAX_DESCRIPTION_BYTES, the tokenizer at most MAX_TOKENIZER_BYTES, the whole at most `max_bytes`.
- `check_tokenizer(data, info)` -> Tokenizer: the tokenizer entry parses and has info's hash; its end-of-text
  ids are the server's (ModelInfo.eos_ids, else eos_id, else its own) and it cleans up spaces as the server says
  (`served_tokenizer`, which `--tokenizer PATH` goes through too).
- `request_manifest(stub, info, fmt, ...)`, `first_manifest(stream)` and `download(stub, request, man, entries,
  cache, ...)`: the weight stream itself (both
  formats): it starts with the manifest checked before, then sends chunks of the manifest's entries only and no
  more bytes than they hold (plus one chunk sent again after a reconnect); they go into the WeightCache, which
  checks every chunk's place and every entry's sha256.
Every refusal is a ServerDataError (tether.client.errors) with Problem MODEL_INFO, FINGERPRINT, MANIFEST,
WEIGHT_SIZE, CACHE_KEY, CHUNK or TOKENIZER; the pairing-level ones are PairingError. Importing this module does
not import torch (tether.client.onnx_pairing pairs without it); `expected_client_part` imports it when called.

    cfg, dcfg = check_model_info(info)
    check_manifest(manifest_entries(reply.manifest), cfg, dcfg, max_bytes=2048 << 20)
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections.abc import Callable, Mapping
from types import MappingProxyType

from tether.client.errors import Problem, ServerDataError
from tether.client.weight_cache import WeightCache, is_sha256
from tether.shared.config import ModelConfig
from tether.shared.drafter_config import DrafterConfig
from tether.shared.tokenizer import Tokenizer
from tether.shared.weights import MAX_CHUNK, ONNX_MANIFEST, TOKENIZER_TENSOR, TensorEntry, onnx_entries
from tether.v1 import tether_pb2 as pb

DEFAULT_MAX_BYTES = 2048 << 20  # the client part's size limit when the caller gives none (ClientConfig.max_weights_mb)
MAX_CONFIG_JSON = 64 << 10  # bytes of model_config_json / drafter_config_json (a real config is under 1 KB)
MAX_TOKENIZER_BYTES = 32 << 20  # the tokenizer's JSON (Llama 3's is 9 MB)
MAX_DESCRIPTION_BYTES = 1 << 20  # an ONNX part's onnx_drafter.json (the default drafter's is 10 KB)
MAX_FINGERPRINT_CHARS = 256  # model_fingerprint is compared and saved, never parsed
MAX_EOS_IDS = 64  # ModelInfo.eos_ids (Llama 3 instruct names 3)
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


class PairingError(ServerDataError):
    """The server's model is not one this client can pair with (or its download does not check out)."""


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
    outside = [i for i in served_eos_ids(info) if i >= cfg.vocab_size]
    if outside:
        raise ServerDataError(Problem.MODEL_INFO, f"end-of-text id {outside[0]} is outside the vocabulary")
    return cfg, dcfg


@functools.lru_cache(maxsize=8)  # building even a meta model takes a tenth of a second; chat pairs every line
def expected_client_part(cfg: ModelConfig, dcfg: DrafterConfig) -> Mapping[str, tuple[tuple[int, ...], bool]]:
    """{name: (shape, is floating)} of the client part the configs imply (the tokenizer aside)."""
    import torch

    from tether.shared.drafter_loading import build_drafter
    from tether.shared.model import Transformer
    from tether.shared.weights import client_part_tensors

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
        _check_key(e)
    _check_total(entries, max_bytes)


def check_onnx_manifest(entries: list[TensorEntry], kind: str, *, max_bytes: int) -> None:
    """Refuse an ONNX part's manifest that is not exactly the files of a `kind` drafter, or over a bound."""
    names = [e.name for e in entries]
    if sorted(names) != sorted(onnx_entries(kind)):
        extra = [n[:80] for n in sorted(set(names) - set(onnx_entries(kind)))[:3]]
        raise ServerDataError(
            Problem.MANIFEST,
            f"the ONNX part's entries are {len(names)} files, unknown: {extra}; "
            f"a {kind} drafter's are {', '.join(onnx_entries(kind))}",
        )
    limits = {ONNX_MANIFEST: MAX_DESCRIPTION_BYTES, TOKENIZER_TENSOR: MAX_TOKENIZER_BYTES}
    for e in entries:
        if e.dtype != "uint8" or e.shape != (e.nbytes,) or e.nbytes < 1:
            raise ServerDataError(
                Problem.MANIFEST,
                f"entry {e.name!r} must be uint8 bytes, not {e.dtype[:40]!r} {list(e.shape)[:4]} of {e.nbytes} bytes",
            )
        if e.nbytes > limits.get(e.name, max_bytes):
            raise ServerDataError(Problem.WEIGHT_SIZE, f"entry {e.name!r} is {e.nbytes} bytes, over its limit")
        _check_key(e)
    _check_total(entries, max_bytes)


def _check_key(e: TensorEntry) -> None:
    """An entry's sha256 names its file in the cache."""
    if not is_sha256(e.sha256):
        raise ServerDataError(Problem.CACHE_KEY, f"{e.name[:80]!r}: sha256 {e.sha256[:80]!r} is not 64 lowercase hex")


def _check_total(entries: list[TensorEntry], max_bytes: int) -> None:
    total = sum(e.nbytes for e in entries)
    if total > max_bytes:
        raise ServerDataError(
            Problem.WEIGHT_SIZE,
            f"the client part is {total >> 20} MiB, over the client's limit of "
            f"{max_bytes >> 20} MiB (--max-weights-mb)",
        )


def served_eos_ids(info: pb.ModelInfo) -> tuple[int, ...]:
    """Every end-of-text id the server names: ModelInfo.eos_id first (when set), then eos_ids; empty from a server
    older than both (the tokenizer's own are taken then). PairingError past MAX_EOS_IDS; the vocabulary is the
    tokenizer's to check."""
    if len(info.eos_ids) > MAX_EOS_IDS:
        raise PairingError(
            Problem.MODEL_INFO, f"{len(info.eos_ids)} end-of-text ids, more than the {MAX_EOS_IDS} a model has"
        )
    return tuple(dict.fromkeys([*([info.eos_id] if info.HasField("eos_id") else []), *info.eos_ids]))


def served_tokenizer(text: str, info: pb.ModelInfo) -> Tokenizer:
    """A tokenizer.json's text as the server's model uses it: its end-of-text ids the server's (served_eos_ids, each
    in the vocabulary: ValueError otherwise; the tokenizer's own from an older server) and its clean-up of
    tokenization spaces. Does not check the hash."""
    ids = served_eos_ids(info)
    return Tokenizer.from_json(
        text, eos_id=ids[0] if ids else None, eos_ids=ids, clean_up_spaces=info.clean_up_tokenization_spaces
    )


def check_tokenizer(data: bytes, info: pb.ModelInfo) -> Tokenizer:
    """The tokenizer entry's JSON as a Tokenizer (served_tokenizer: its end-of-text ids the server's), refused
    unless it passes tether.shared.tokenizer_trust (no regex that may backtrack for ever), parses, has info's
    tokenizer hash and every end-of-text id is in its vocabulary."""
    try:
        tokenizer = served_tokenizer(data.decode(), info)
    except Exception as e:  # the tokenizers library raises its own types on text it cannot read
        raise PairingError(Problem.TOKENIZER, f"the tokenizer is refused: {str(e)[:200]}") from None
    if tokenizer.sha256 != info.tokenizer_sha256:
        raise PairingError(Problem.TOKENIZER, "the tokenizer received does not match the server's tokenizer hash")
    return tokenizer


def first_manifest(stream) -> pb.WeightManifest:
    """The first message of a FetchWeights stream, which must be the manifest."""
    first = next(iter(stream), None)
    if first is None:
        raise ConnectionError("the weight stream ended before its manifest")
    if first.WhichOneof("body") != "manifest":
        raise PairingError(Problem.MANIFEST, "the weight stream does not start with its manifest")
    return first.manifest


def request_manifest(
    stub, info: pb.ModelInfo, fmt: int, *, metadata: tuple, timeout_s: float
) -> tuple[pb.FetchWeightsRequest, pb.WeightManifest]:
    """Ask for the manifest alone first (a client whose cache holds everything downloads nothing more); refused
    unless it is of format `fmt` and of the model and drafter `info` describes. Returns (request, manifest)."""
    req = pb.FetchWeightsRequest(model_fingerprint=info.model_fingerprint, manifest_only=True, format=fmt)
    man = first_manifest(stub.FetchWeights(req, metadata=metadata, timeout=timeout_s))
    if man.model_fingerprint != info.model_fingerprint or man.drafter_fingerprint != info.drafter_fingerprint:
        raise PairingError(
            Problem.FINGERPRINT, "the weight manifest belongs to another model than the server described"
        )
    if man.format != fmt:
        raise PairingError(Problem.MANIFEST, f"the manifest is of client part format {man.format}, not {fmt}")
    return req, man


def download(
    stub,
    request: pb.FetchWeightsRequest,
    man: pb.WeightManifest,
    entries: list[TensorEntry],
    cache: WeightCache,
    *,
    metadata: tuple,
    timeout_s: float,
    on_progress: Callable[[int, int], None] | None,
) -> None:
    """Fetch what `cache` lacks of `entries` (checked before, as `man`), from where the cache stops: the start, or
    the middle of a download a dropped link broke (also in another process)."""
    point = cache.resume_point(entries)
    if point is None:
        return
    by_name = {e.name: e for e in entries}
    total = sum(e.nbytes for e in entries)
    req = pb.FetchWeightsRequest()
    req.CopyFrom(request)  # a copy: the caller's request stays as it was
    req.resume_tensor, req.resume_offset, req.manifest_only = point[0], point[1], False
    stream = stub.FetchWeights(req, metadata=metadata, timeout=timeout_s)
    if first_manifest(stream) != man:
        raise PairingError(Problem.MANIFEST, "the weight stream's manifest differs from the one checked")
    done = sum(cache.held_bytes(e) for e in entries)
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
    if cache.resume_point(entries) is not None:
        raise ConnectionError("the weight stream ended before every tensor arrived")
