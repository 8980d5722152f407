"""The client's partial weights: which tensors they are, their manifest, and how they travel in chunks.

The client part (docs/ARCHITECTURE.md, section 3) is everything the edge needs to draft alone: the target's token
embeddings, its last N (TLI) layers, final norm and LM head, plus the drafter's client-side modules (MoA: SA
and CA, not LSA, which runs on the server; EAGLE: all of it). Names are prefixed "target." (Hugging Face
names) and "drafter.".

Contract:
- `client_part_tensors(target, drafter)` -> {name: tensor}; `build_manifest(tensors)` -> [TensorEntry] with
  each tensor's dtype, shape, byte count and sha256 of its bytes (row-major, little-endian), in a fixed order.
- `drafter_fingerprint(config, manifest)`: the sha256 that names a drafter and its client part (ModelInfo's
  drafter_fingerprint): of its config and its tensors' hashes, so the server computes it and a client checks it.
- `iter_chunks(tensors, manifest, resume_tensor, resume_offset, max_chunk)` yields (name, offset, bytes) from
  any (tensor, offset) on, each at most `max_chunk` bytes (1 MiB by default), so a broken download resumes
  exactly where it stopped. A value may be a tensor or bytes-like (bytes, an mmap of a file: the files of an ONNX
  client part, tether.server.client_export). The client reassembles and checks them (tether.client.weight_cache).
- `build_client_part(cfg, dcfg, tensors)` -> (target, drafter): fp32 CPU modules from the client part alone (the
  target's other layers stay on the meta device, never allocated), as both the torch client (tether.client.pairing)
  and the server's ONNX export (tether.server.client_export) build them; ClientPartMismatch when tensors are
  missing or left over.
- The ONNX client part (tether.server.client_export streams it, tether.client.onnx_pairing fetches it): its entries
  are files with fixed names (`onnx_entries(kind)`); each graph's weight matrices travel in a safetensors file
  beside it in one of ONNX_PRECISIONS: `encode_weights(arrays, precision)` -> the arrays to store (fp32 as they
  are; fp16; int8 with one fp32 scale per row, symmetric, under "<name>.scale"), `stored_layout(shape,
  precision)` -> what the client must find for a matrix, `decode_weight(stored, scale)` -> fp32 again.
- The tokenizer part (ClientPartFormat TOKENIZER, streamed by every server, drafter or not, for clients that decode
  with Generate): `tokenizer_part(tokenizer_json)` -> ({name: bytes}, [TensorEntry]), one entry, TOKENIZER_TENSOR,
  holding `canonical_tokenizer_json(text)`: the form tether.shared.tokenizer.Tokenizer.sha256 hashes, so the entry's
  sha256 is ModelInfo.tokenizer_sha256 and a client finds it in its cache by that hash alone.
  `file_entry(name, data)` is the entry of any file a part streams: uint8 [nbytes] and its sha256.
Importing this module does not import torch (the torch-free client reads TensorEntry, MAX_CHUNK and iter_chunks'
constants from it); the functions that handle tensors import it when called.
"""

from __future__ import annotations

import hashlib
import json
import math
import mmap
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch
    from torch import Tensor

    from tether.shared.config import ModelConfig
    from tether.shared.drafter_config import DrafterConfig

MAX_CHUNK = 1 << 20  # 1 MiB: well under gRPC's 4 MiB default message limit
TOKENIZER_TENSOR = "tokenizer.json"  # the stream's entry holding the tokenizer's JSON text as uint8 bytes


@dataclass(frozen=True)
class TensorEntry:
    name: str  # "target.<hf name>" or "drafter.<param name>"; a file name for an ONNX client part
    dtype: str  # torch dtype name, e.g. "bfloat16"
    shape: tuple[int, ...]
    nbytes: int
    sha256: str  # of the tensor's bytes


ONNX_MANIFEST = "onnx_drafter.json"  # the ONNX part's description (tether.server.onnx_export's manifest)
ONNX_PRECISIONS = ("fp32", "fp16", "int8")
SCALE_SUFFIX = ".scale"  # an int8 matrix's row scales, stored beside it
FP16_MAX = 65504.0


def onnx_graph_io(kind: str, tli: int) -> dict[str, tuple[list[str], list[str]]]:
    """{graph: (input names, output names)}, in order, of a drafter kind's graphs (tether.server.onnx_export's
    graph contract, which the runtime, tether.client.onnx_drafter, feeds)."""
    if kind == "moa":
        tli_in = [f"tli_{kv}.{i}" for i in range(tli) for kv in "kv"]
        tli_out = [f"tli_{kv}_new.{i}" for i in range(tli) for kv in "kv"]
        step_in = ["tokens", "positions", "mask", "logit_rows", "sa_k", "sa_v", "ctx_k", "ctx_v", *tli_in]
        step_out = ["logits", "sa_k_new", "sa_v_new", *tli_out]
        return {"step": (step_in, step_out), "context": (["lsa", "positions"], ["ctx_k", "ctx_v"])}
    if kind == "eagle":
        step_in = ["tokens", "positions", "mask", "logit_rows", "prev_feat", "k", "v"]
        return {"step": (step_in, ["logits", "feat", "k_new", "v_new"])}
    raise ValueError(f"no ONNX graphs for a drafter of kind {kind!r} (supported: moa, eagle)")


def onnx_graphs(kind: str) -> tuple[str, ...]:
    """The graphs a drafter kind exports."""
    return tuple(onnx_graph_io(kind, 0))


def onnx_entries(kind: str) -> tuple[str, ...]:
    """Every entry of an ONNX client part, in stream order: small files first, so they are checked early."""
    graphs = onnx_graphs(kind)
    return (ONNX_MANIFEST, TOKENIZER_TENSOR, *(f"{g}.onnx" for g in graphs), *(f"{g}.safetensors" for g in graphs))


def encode_weights(arrays: Mapping[str, np.ndarray], precision: str) -> dict[str, np.ndarray]:
    """fp32 matrices -> what a weights file of `precision` stores (module docstring)."""
    out: dict[str, np.ndarray] = {}
    for name, w in arrays.items():
        w = np.ascontiguousarray(w, dtype=np.float32)
        if precision == "fp32":
            out[name] = w
        elif precision == "fp16":
            if np.abs(w).max(initial=0.0) > FP16_MAX:
                raise ValueError(f"{name} holds values beyond fp16's range")
            out[name] = w.astype(np.float16)
        elif precision == "int8":
            rows = w.reshape(-1, w.shape[-1])
            scale = np.abs(rows).max(axis=1) / 127.0  # symmetric: 0 stays exactly 0
            q = np.rint(rows / np.where(scale > 0, scale, 1.0)[:, None])
            out[name] = np.clip(q, -127, 127).astype(np.int8).reshape(w.shape)
            out[name + SCALE_SUFFIX] = scale.astype(np.float32)
        else:
            raise ValueError(f"unknown precision {precision!r} (one of {', '.join(ONNX_PRECISIONS)})")
    return out


def stored_layout(shape: tuple[int, ...], precision: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{name suffix: (numpy dtype name, shape)} a matrix of `shape` is stored as: "" is the matrix itself."""
    if precision == "int8":
        return {"": ("int8", shape), SCALE_SUFFIX: ("float32", (math.prod(shape[:-1]),))}
    return {"": ({"fp32": "float32", "fp16": "float16"}[precision], shape)}


def decode_weight(stored: np.ndarray, scale: np.ndarray | None = None) -> np.ndarray:
    """A stored matrix as fp32: widened, or dequantized with its row scales."""
    if scale is None:
        return np.ascontiguousarray(stored, dtype=np.float32)
    rows = stored.reshape(-1, stored.shape[-1]).astype(np.float32) * scale[:, None]
    return rows.reshape(stored.shape)


def file_entry(name: str, data: bytes | bytearray | memoryview | mmap.mmap) -> TensorEntry:
    """A file of a client part (ONNX, tokenizer) as a manifest entry: uint8 bytes of shape [nbytes]."""
    return TensorEntry(name, "uint8", (len(data),), len(data), hashlib.sha256(data).hexdigest())


def canonical_tokenizer_json(text: str) -> bytes:
    """tokenizer.json text as the bytes a tokenizer's sha256 is taken of: keys sorted, no whitespace, UTF-8."""
    return json.dumps(json.loads(text), sort_keys=True, ensure_ascii=False, separators=(",", ":")).encode()


def tokenizer_tensor(tokenizer_json: str) -> Tensor:
    """The tensors stream's TOKENIZER_TENSOR entry: the tokenizer's JSON text as uint8 bytes [nbytes]."""
    import torch

    return torch.frombuffer(bytearray(tokenizer_json.encode()), dtype=torch.uint8)


def tokenizer_part(tokenizer_json: str) -> tuple[dict[str, bytes], list[TensorEntry]]:
    """The TOKENIZER client part of a tokenizer's JSON text: ({TOKENIZER_TENSOR: its canonical bytes}, manifest)."""
    data = canonical_tokenizer_json(tokenizer_json)
    return {TOKENIZER_TENSOR: data}, [file_entry(TOKENIZER_TENSOR, data)]


class ClientPartMismatch(ValueError):
    """The tensors given do not make the client part the configs describe."""


def tensor_bytes(t: Tensor) -> bytes:
    """Row-major, little-endian bytes of a tensor (bf16 included, through a uint8 view)."""
    import torch

    t = t.detach().to("cpu").contiguous()
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


def tensor_from_bytes(data: bytes, dtype: str, shape: tuple[int, ...]) -> Tensor:
    import torch

    dt = getattr(torch, dtype, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}")
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return raw.view(dt).reshape(shape)


def client_part_tensors(target: torch.nn.Module, drafter: torch.nn.Module | None) -> dict[str, Tensor]:
    """The tensors the edge client needs, by name, in a fixed order."""
    from tether.shared.checkpoint import to_hf_name

    out: dict[str, Tensor] = {}
    n_layers = target.cfg.n_layers
    tli = drafter.dcfg.tli if drafter is not None else 0
    for name, t in target.state_dict().items():
        keep = name.startswith(("embed_tokens.", "embed_norm.", "norm.", "lm_head."))
        if name.startswith("layers."):
            keep = int(name.split(".")[1]) >= n_layers - tli
        if keep:
            out["target." + to_hf_name(name)] = t
    if drafter is not None:
        for name, t in drafter.state_dict().items():
            if not name.startswith("lsa."):  # LSA runs on the server
                out["drafter." + name] = t
    return out


def drafter_fingerprint(config: Mapping[str, Any], manifest: list[TensorEntry]) -> str:
    """sha256 of the drafter's config (a DrafterConfig's dict) and its client part's tensor hashes, in order."""
    obj = {"config": dict(config), "tensors": [e.sha256 for e in manifest]}
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def build_manifest(tensors: dict[str, Tensor]) -> list[TensorEntry]:
    entries = []
    for name, t in tensors.items():
        data = tensor_bytes(t)
        dtype = str(t.dtype).removeprefix("torch.")
        entries.append(TensorEntry(name, dtype, tuple(t.shape), len(data), hashlib.sha256(data).hexdigest()))
    return entries


def build_client_part(cfg: ModelConfig, dcfg: DrafterConfig, tensors: Mapping[str, Tensor]):
    """(target, drafter) in fp32 on the CPU, in eval mode, from the client part's tensors (module docstring)."""
    import torch

    from tether.shared.checkpoint import from_hf_name
    from tether.shared.drafter_loading import build_drafter
    from tether.shared.model import Transformer, rope_frequencies

    # Build on the meta device and materialise only the client part: an 8B target's other layers would
    # otherwise take the memory for nothing.
    with torch.device("meta"):
        target = Transformer(cfg)
    keep = [target.embed_tokens, target.norm, *target.layers[cfg.n_layers - dcfg.tli :]]
    keep += [m for m in (target.embed_norm, target.lm_head) if m is not None]
    for m in keep:
        m.to_empty(device="cpu")
    target.register_buffer("inv_freq", rope_frequencies(cfg), persistent=False)
    state = {from_hf_name(k.removeprefix("target.")): v.float() for k, v in tensors.items() if k.startswith("target.")}
    ids = {id(m) for m in keep}
    kept = [(prefix, m) for prefix, m in target.named_modules() if id(m) in ids]
    expected = {f"{prefix}.{p}" for prefix, m in kept for p, _ in m.named_parameters()}
    if not expected <= state.keys():
        raise ClientPartMismatch(f"the client part lacks {sorted(expected - state.keys())[:3]}")
    target.load_state_dict(state, strict=False, assign=True)
    target.eval()
    drafter = build_drafter(target, dcfg)
    dstate = {k.removeprefix("drafter."): v.float() for k, v in tensors.items() if k.startswith("drafter.")}
    result = drafter.load_state_dict(dstate, strict=False)
    absent = [k for k in result.missing_keys if not k.startswith("lsa.")]  # LSA runs on the server
    if absent or result.unexpected_keys:
        raise ClientPartMismatch(
            f"drafter weights do not fit its config: missing {absent[:3]}, unexpected {result.unexpected_keys[:3]}"
        )
    return target, drafter.float().eval()


def _entry_bytes(value: Any) -> Any:
    """A bytes-like value as it is (slicing it copies only the chunk), a tensor as its bytes."""
    return value if isinstance(value, bytes | bytearray | memoryview | mmap.mmap) else tensor_bytes(value)


def iter_chunks(
    tensors: Mapping[str, Any],
    manifest: list[TensorEntry],
    resume_tensor: str = "",
    resume_offset: int = 0,
    max_chunk: int = MAX_CHUNK,
) -> Iterator[tuple[str, int, bytes]]:
    """(tensor name, offset, bytes) chunks of the manifest's tensors from (resume_tensor, resume_offset) on."""
    if not 0 < max_chunk <= MAX_CHUNK:
        raise ValueError(f"max_chunk must lie in (0, {MAX_CHUNK}], got {max_chunk}")
    names = [e.name for e in manifest]
    start = 0
    if resume_tensor:
        if resume_tensor not in names:
            raise KeyError(f"unknown tensor {resume_tensor!r} to resume from")
        start = names.index(resume_tensor)
    for i, entry in enumerate(manifest[start:], start):
        data = _entry_bytes(tensors[entry.name])
        offset = resume_offset if i == start else 0
        if not 0 <= offset <= len(data):
            raise ValueError(f"offset {offset} outside tensor {entry.name!r} of {len(data)} bytes")
        for pos in range(offset, len(data), max_chunk):
            yield entry.name, pos, bytes(data[pos : pos + max_chunk])
        if len(data) == 0 and offset == 0:
            yield entry.name, 0, b""
