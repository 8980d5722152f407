"""Decode wire tensor bundles into numpy arrays without torch, for the torch-free onnxruntime client.

tether.shared.codecs (the format's definition: frames, bundles, codecs RAW / FP16_SHUFFLE_ZSTD / INT8_ZSTD)
imports torch and returns torch tensors. This module reads the same bytes with numpy and zstandard alone and
applies the same checks, raising CodecError (a ValueError, but not shared.codecs.CodecError) on bad input.

Contract: `decode_many(data, max_nbytes=...) -> {name: np.ndarray}` and `decode_frame(data) -> np.ndarray`.
Values equal shared.codecs.decode's bit for bit, in the same dtype, except bfloat16 (numpy has none), which
comes back as the float32 holding exactly the same value. Bounded as shared.codecs is: a frame's declared size
is checked against `max_nbytes` (shared by a bundle's tensors) before anything is decompressed, and zstd's
output never exceeds what the declared dtype and shape hold. `parse_many(data, max_nbytes=...) -> {name: Frame}`
checks every frame's header without decompressing any, so a receiver can match names, dtypes and shapes
against what it expects first; `decode_many` is parse_many then decode of each frame.

    from tether.client.codecs_np import decode_many
    from tether.client.onnx_drafter import ArrayDelta
    delta = ArrayDelta(start, tokens, decode_many(payload))
"""

from __future__ import annotations

import math
import struct
import threading
from dataclasses import dataclass

import numpy as np
import zstandard

DEFAULT_MAX_NBYTES = 1 << 31
FORMAT_VERSION = 1
TENSOR_MAGIC = b"TTEN"
BUNDLE_MAGIC = b"TTBN"
MAX_NDIM = 16
MAX_NAME_BYTES = 1024

_HEAD = struct.Struct("<4sBBBBB")  # magic, version, codec, dtype id, wire dtype id, ndim
_DIM = struct.Struct("<I")
_LENGTHS = struct.Struct("<II")  # payload, scales
_BUNDLE_HEAD = struct.Struct("<4sBI")  # magic, version, count
_NAME_LEN = struct.Struct("<H")
_FRAME_LEN = struct.Struct("<I")

RAW, FP16_SHUFFLE_ZSTD, INT8_ZSTD = 0, 1, 2
# Wire dtype ids (shared.codecs._DTYPES): name, little-endian numpy dtype of the bytes, itemsize.
# bfloat16's bytes are read as uint16 and widened to float32 by _bf16_to_f32.
_DTYPES: dict[int, tuple[str, str]] = {
    1: ("float32", "<f4"),
    2: ("float16", "<f2"),
    3: ("bfloat16", "<u2"),
    4: ("float64", "<f8"),
    5: ("uint8", "u1"),
    6: ("int8", "i1"),
    7: ("int16", "<i2"),
    8: ("int32", "<i4"),
    9: ("int64", "<i8"),
    10: ("bool", "u1"),
}
_NUMPY = dict(_DTYPES.values())  # dtype name -> numpy dtype of its bytes
_FLOATS = {"float16", "bfloat16", "float32", "float64"}


class CodecError(ValueError):
    """Bytes that are not a valid frame or bundle."""


def _bf16_to_f32(u16: np.ndarray) -> np.ndarray:
    return (u16.astype(np.uint32) << 16).view(np.float32)


def _f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """Round finite fp32 to the nearest bfloat16 (ties to even, as torch's cast), widened back to fp32."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return (((u + np.uint32(0x7FFF) + ((u >> 16) & 1)) >> 16) << 16).view(np.float32)


def _to_dtype(x: np.ndarray, name: str) -> np.ndarray:
    """Cast decoded fp32/fp64 values to the tensor's dtype the way torch's .to(dtype) rounds."""
    if name == "bfloat16":
        return _f32_to_bf16(x)
    return x.astype(np.dtype(name))


_local = threading.local()  # zstd decompression contexts are not thread-safe


def _decompress(payload: bytes, expected: int) -> bytes:
    """Exactly one zstd frame that yields exactly `expected` bytes, never allocating more."""
    dctx = _local.__dict__.get("dctx")
    if dctx is None:
        dctx = _local.dctx = zstandard.ZstdDecompressor()
    try:
        declared = zstandard.frame_content_size(payload)
        if declared >= 0 and declared != expected:
            raise CodecError(f"zstd frame declares {declared} bytes, the shape implies {expected}")
        out = dctx.decompress(payload, max_output_size=max(expected, 1), allow_extra_data=False)
    except zstandard.ZstdError as e:
        raise CodecError(f"bad zstd payload (the shape implies {expected} bytes): {e}") from None
    if len(out) != expected:
        raise CodecError(f"zstd payload decompresses to {len(out)} bytes, the shape implies {expected}")
    return out


@dataclass(frozen=True)
class Frame:
    """One frame's checked header and its still-compressed sections."""

    codec: int
    dtype: str  # the original dtype, e.g. "bfloat16"
    wire: str  # what the payload holds
    shape: tuple[int, ...]
    payload: bytes
    scales: bytes

    @property
    def raw_nbytes(self) -> int:
        """The tensor's size in its original dtype (what bundles count against max_nbytes)."""
        return math.prod(self.shape) * (2 if self.dtype == "bfloat16" else np.dtype(self.dtype).itemsize)


def decode_frame(data: bytes | bytearray | memoryview, *, max_nbytes: int = DEFAULT_MAX_NBYTES) -> np.ndarray:
    """One encoded tensor frame (exactly: trailing bytes are an error) -> a numpy array."""
    return decode(parse_frame(data, max_nbytes=max_nbytes))


def parse_frame(data: bytes | bytearray | memoryview, *, max_nbytes: int = DEFAULT_MAX_NBYTES) -> Frame:
    """A frame's header, checked against itself and `max_nbytes`; nothing is decompressed."""
    data = memoryview(data).cast("B")
    if len(data) < _HEAD.size:
        raise CodecError(f"truncated header: {len(data)} bytes, need at least {_HEAD.size}")
    magic, version, codec, dtype_id, wire_id, ndim = _HEAD.unpack_from(data)
    if magic != TENSOR_MAGIC:
        raise CodecError(f"bad magic {bytes(magic)!r}: not an encoded tensor (expected {TENSOR_MAGIC!r})")
    if version != FORMAT_VERSION:
        raise CodecError(f"unsupported format version {version} (this build reads {FORMAT_VERSION})")
    if codec not in (RAW, FP16_SHUFFLE_ZSTD, INT8_ZSTD):
        raise CodecError(f"unknown codec id {codec}")
    if dtype_id not in _DTYPES or wire_id not in _DTYPES:
        raise CodecError(f"unknown dtype id {dtype_id if dtype_id not in _DTYPES else wire_id}")
    if ndim > MAX_NDIM:
        raise CodecError(f"ndim {ndim} exceeds the limit of {MAX_NDIM}")
    fixed = _HEAD.size + _DIM.size * ndim + _LENGTHS.size
    if len(data) < fixed:
        raise CodecError(f"truncated header: {len(data)} bytes, a {ndim}-dim frame needs {fixed}")
    shape = tuple(_DIM.unpack_from(data, _HEAD.size + _DIM.size * i)[0] for i in range(ndim))
    n_payload, n_scales = _LENGTHS.unpack_from(data, fixed - _LENGTHS.size)
    if len(data) != fixed + n_payload + n_scales:
        raise CodecError(f"frame is {len(data)} bytes, header declares {fixed} + {n_payload} + {n_scales}")
    name, wire = _DTYPES[dtype_id][0], _DTYPES[wire_id][0]
    frame = Frame(codec, name, wire, shape, bytes(data[fixed : fixed + n_payload]), bytes(data[fixed + n_payload :]))
    if frame.raw_nbytes > max_nbytes:
        raise CodecError(f"declared tensor of shape {shape} {name} is {frame.raw_nbytes} bytes > {max_nbytes}")
    allowed = {
        RAW: {name},
        FP16_SHUFFLE_ZSTD: {name} | ({"float16"} if name == "float32" else set()),
        INT8_ZSTD: {"int8"} if name in _FLOATS else set(),
    }[codec]
    if wire not in allowed:
        raise CodecError(f"codec {codec} cannot carry a {name} tensor as {wire}")
    rows = math.prod(shape[:-1]) if shape else 1
    if n_scales != (2 * rows if codec == INT8_ZSTD else 0):
        raise CodecError(f"codec {codec} needs {2 * rows if codec == INT8_ZSTD else 0} bytes of scales, got {n_scales}")
    wire_nbytes = math.prod(shape) * np.dtype(_NUMPY[wire]).itemsize
    if codec == RAW and n_payload != wire_nbytes:
        raise CodecError(f"RAW payload is {n_payload} bytes, shape {shape} {name} needs {wire_nbytes}")
    return frame


def decode(frame: Frame) -> np.ndarray:
    """A parsed frame's tensor; zstd's output is bounded by the frame's shape. Raises CodecError."""
    codec, name, wire, shape, scales = frame.codec, frame.dtype, frame.wire, frame.shape, frame.scales
    wire_np = _NUMPY[wire]
    rows = math.prod(shape[:-1]) if shape else 1
    wire_nbytes = math.prod(shape) * np.dtype(wire_np).itemsize
    raw = frame.payload if codec == RAW else _decompress(frame.payload, wire_nbytes)
    if codec == INT8_ZSTD:
        work = np.float64 if name == "float64" else np.float32
        s = np.frombuffer(scales, dtype="<f2").astype(work)  # [rows]
        if not (np.isfinite(s) & (s >= 0)).all():
            raise CodecError("INT8_ZSTD scales must be finite and non-negative")
        q = np.frombuffer(raw, dtype=np.int8).reshape(rows, shape[-1] if shape else 1)  # [rows, D]
        return _to_dtype(q * s[:, None], name).reshape(shape)
    u = np.frombuffer(raw, dtype=np.uint8)
    if codec == FP16_SHUFFLE_ZSTD and np.dtype(wire_np).itemsize > 1:  # byte planes back to whole elements
        u = np.ascontiguousarray(u.reshape(np.dtype(wire_np).itemsize, -1).T).reshape(-1)
    x = u.view(wire_np).reshape(shape)
    if wire == "bool":
        if x.size and int(x.max()) > 1:
            raise CodecError("bool tensor holds bytes other than 0 and 1")
        return x.astype(bool)
    if wire == "bfloat16":
        return _bf16_to_f32(x)
    x = x.astype(np.dtype(wire))  # native byte order, and a writable copy
    return x.astype(np.float32) if name == "float32" and wire == "float16" else x


def decode_many(data: bytes | bytearray | memoryview, *, max_nbytes: int = DEFAULT_MAX_NBYTES) -> dict[str, np.ndarray]:
    """A bundle from shared.codecs.encode_many -> {name: array}. `max_nbytes` bounds the bundle as a whole."""
    return {name: decode(frame) for name, frame in parse_many(data, max_nbytes=max_nbytes).items()}


def parse_many(data: bytes | bytearray | memoryview, *, max_nbytes: int = DEFAULT_MAX_NBYTES) -> dict[str, Frame]:
    """A bundle's frames, checked but not decompressed; their declared sizes together at most `max_nbytes`."""
    data = memoryview(data).cast("B")
    if len(data) < _BUNDLE_HEAD.size:
        raise CodecError(f"truncated bundle header: {len(data)} bytes, need {_BUNDLE_HEAD.size}")
    magic, version, count = _BUNDLE_HEAD.unpack_from(data)
    if magic != BUNDLE_MAGIC:
        raise CodecError(f"bad magic {bytes(magic)!r}: not a tensor bundle (expected {BUNDLE_MAGIC!r})")
    if version != FORMAT_VERSION:
        raise CodecError(f"unsupported bundle format version {version} (this build reads {FORMAT_VERSION})")
    out: dict[str, Frame] = {}
    pos, budget = _BUNDLE_HEAD.size, max_nbytes
    for i in range(count):
        if len(data) < pos + _NAME_LEN.size:
            raise CodecError(f"truncated bundle: entry {i} of {count} is missing")
        (n_name,) = _NAME_LEN.unpack_from(data, pos)
        pos += _NAME_LEN.size
        if not 0 < n_name <= MAX_NAME_BYTES or len(data) < pos + n_name + _FRAME_LEN.size:
            raise CodecError(f"bundle entry {i}: bad or truncated name ({n_name} bytes)")
        try:
            name = bytes(data[pos : pos + n_name]).decode("utf-8")
        except UnicodeDecodeError:
            raise CodecError(f"bundle entry {i}: name is not valid utf-8") from None
        if name in out:
            raise CodecError(f"bundle entry {i}: duplicate name {name!r}")
        pos += n_name
        (n_frame,) = _FRAME_LEN.unpack_from(data, pos)
        pos += _FRAME_LEN.size
        if len(data) < pos + n_frame:
            raise CodecError(f"truncated bundle: entry {name!r} declares {n_frame} bytes, {len(data) - pos} remain")
        out[name] = parse_frame(data[pos : pos + n_frame], max_nbytes=budget)
        budget -= out[name].raw_nbytes
        pos += n_frame
    if pos != len(data):
        raise CodecError(f"oversize bundle: {len(data) - pos} trailing bytes after {count} entries")
    return out
