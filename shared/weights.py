"""The client's partial weights: which tensors they are, their manifest, and how they travel in chunks.

The client part (docs/ARCHITECTURE.md, section 3) is everything the edge needs to draft alone: the target's token
embeddings, its last N (TLI) layers, final norm and LM head, plus the drafter's client-side modules (MoA: SA
and CA, not LSA, which runs on the server; EAGLE: all of it). Names are prefixed "target." (Hugging Face
names) and "drafter.".

Contract:
- `client_part_tensors(target, drafter)` -> {name: tensor}; `build_manifest(tensors)` -> [TensorEntry] with
  each tensor's dtype, shape, byte count and sha256 of its bytes (row-major, little-endian), in a fixed order.
- `iter_chunks(tensors, manifest, resume_tensor, resume_offset, max_chunk)` yields (name, offset, bytes) from
  any (tensor, offset) on, each at most `max_chunk` bytes (1 MiB by default), so a broken download resumes
  exactly where it stopped. The client reassembles and checks them (tether.client.weight_cache).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from tether.shared.checkpoint import to_hf_name

MAX_CHUNK = 1 << 20  # 1 MiB: well under gRPC's 4 MiB default message limit
TOKENIZER_TENSOR = "tokenizer.json"  # the stream's entry holding the tokenizer's JSON text as uint8 bytes


@dataclass(frozen=True)
class TensorEntry:
    name: str  # "target.<hf name>" or "drafter.<param name>"
    dtype: str  # torch dtype name, e.g. "bfloat16"
    shape: tuple[int, ...]
    nbytes: int
    sha256: str  # of the tensor's bytes


def tensor_bytes(t: Tensor) -> bytes:
    """Row-major, little-endian bytes of a tensor (bf16 included, through a uint8 view)."""
    t = t.detach().to("cpu").contiguous()
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


def tensor_from_bytes(data: bytes, dtype: str, shape: tuple[int, ...]) -> Tensor:
    dt = getattr(torch, dtype, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}")
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return raw.view(dt).reshape(shape)


def client_part_tensors(target: torch.nn.Module, drafter: torch.nn.Module | None) -> dict[str, Tensor]:
    """The tensors the edge client needs, by name, in a fixed order."""
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


def build_manifest(tensors: dict[str, Tensor]) -> list[TensorEntry]:
    entries = []
    for name, t in tensors.items():
        data = tensor_bytes(t)
        dtype = str(t.dtype).removeprefix("torch.")
        entries.append(TensorEntry(name, dtype, tuple(t.shape), len(data), hashlib.sha256(data).hexdigest()))
    return entries


def iter_chunks(
    tensors: dict[str, Tensor],
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
        data = tensor_bytes(tensors[entry.name])
        offset = resume_offset if i == start else 0
        if not 0 <= offset <= len(data):
            raise ValueError(f"offset {offset} outside tensor {entry.name!r} of {len(data)} bytes")
        for pos in range(offset, len(data), max_chunk):
            yield entry.name, pos, data[pos : pos + max_chunk]
        if len(data) == 0 and offset == 0:
            yield entry.name, 0, b""
