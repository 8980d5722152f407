"""The wire codecs for torch tensors: tether.shared.wire (the format and its one implementation, on numpy) with
tensors in and out, for the server and the torch client.

Contract (the format, the codecs and their guarantees are tether.shared.wire's):
- `encode(t, codec) -> EncodedTensor` (any device: copied to the CPU); `decode(e) -> Tensor` returns a CPU tensor
  of the original dtype and shape, bfloat16 included (bit-exact through the lossless codecs).
- `encode_many(tensors, codec) -> bytes` / `decode_many(data) -> dict[str, Tensor]`: named bundles;
  `parse_many`, `EncodedTensor`, `Codec`, `CodecError`, `DEFAULT_MAX_NBYTES` are tether.shared.wire's.
- `compression_ratio(t, codec)`: raw bytes over framed encoded bytes.

    from tether.shared.codecs import Codec, decode_many, encode_many
    wire = encode_many(delta.tensors, Codec.INT8_ZSTD)  # {"lsa": [n, dim], "tli_k": [N, n, Hkv, D], ...}
    tensors = decode_many(wire)
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
from torch import Tensor

from tether.shared import wire
from tether.shared.wire import DEFAULT_MAX_NBYTES, Codec, CodecError, EncodedTensor, parse_many

__all__ = [
    "DEFAULT_MAX_NBYTES",
    "Codec",
    "CodecError",
    "EncodedTensor",
    "bf16_bits",
    "compression_ratio",
    "decode",
    "decode_many",
    "encode",
    "encode_many",
    "parse_many",
]

_NAMES = {getattr(torch, name): name for name in wire.DTYPE_NAMES}  # torch dtype -> the format's name for it


def _array(t: Tensor) -> tuple[np.ndarray, str]:
    """A tensor as the array tether.shared.wire takes (bfloat16 as its uint16 bits), and its dtype name."""
    name = _NAMES.get(t.dtype)
    if name is None:
        raise CodecError(f"unsupported dtype {t.dtype} (supported: {', '.join(wire.DTYPE_NAMES)})")
    if t.device.type != "cpu" or t.requires_grad:
        t = t.detach().to("cpu")
    # A strided view (a row's slice of a step's delta) goes to numpy as it is and is made contiguous there: one
    # numpy copy instead of torch's, whose per-call cost the server pays on every tensor of every round.
    a = t.view(torch.int16).numpy().view(np.uint16) if name == "bfloat16" else t.numpy()
    return (a if a.flags.c_contiguous else a.copy()), name


def bf16_bits(t: Tensor) -> np.ndarray:
    """A floating tensor's values in bfloat16 (rounded as `.to(torch.bfloat16)` rounds) as a numpy array of their
    uint16 bits on the CPU: the form tether.shared.wire.encode_bf16_bundle takes. A view when `t` already is a CPU
    bfloat16 tensor (strides kept)."""
    if t.dtype != torch.bfloat16 or t.device.type != "cpu" or t.requires_grad:
        t = t.detach().to("cpu", torch.bfloat16)
    return t.view(torch.int16).numpy().view(np.uint16)


def _tensor(a: np.ndarray, name: str) -> Tensor:
    """Inverse of _array, for a writable array tether.shared.wire decoded."""
    if name == "bfloat16":
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def encode(t: Tensor, codec: Codec, *, level: int = 3, fp32_as_fp16: bool = False) -> EncodedTensor:
    """Encode `t` (any device; copied to CPU). `level` is zstd's; `fp32_as_fp16` lets FP16_SHUFFLE_ZSTD
    send fp32 tensors as fp16 (lossy, decoded back to fp32). Raises CodecError for unsupported input."""
    a, name = _array(t)
    return wire.encode_array(a, codec, dtype=name, level=level, fp32_as_fp16=fp32_as_fp16)


def decode(e: EncodedTensor) -> Tensor:
    """The CPU tensor `e` encodes, in its original dtype and shape. Raises CodecError on a bad payload."""
    return _tensor(wire.decode_array(e), e.dtype)


def compression_ratio(t: Tensor, codec: Codec, *, level: int = 3, fp32_as_fp16: bool = False) -> float:
    """Raw bytes / framed encoded bytes (header included: what actually crosses the wire)."""
    e = encode(t, codec, level=level, fp32_as_fp16=fp32_as_fp16)
    return e.raw_nbytes / e.nbytes


def encode_many(tensors: Mapping[str, Tensor], codec: Codec, *, level: int = 3, fp32_as_fp16: bool = False) -> bytes:
    """A bundle of named tensors (e.g. a KV delta's "lsa", "tli_k", "tli_v"), each its own frame."""
    return wire.encode_many({k: _array(t) for k, t in tensors.items()}, codec, level=level, fp32_as_fp16=fp32_as_fp16)


def decode_many(data: bytes | bytearray | memoryview, *, max_nbytes: int = DEFAULT_MAX_NBYTES) -> dict[str, Tensor]:
    """Inverse of encode_many. `max_nbytes` bounds the decoded bundle as a whole. Raises CodecError."""
    return {name: decode(e) for name, e in parse_many(data, max_nbytes=max_nbytes).items()}
