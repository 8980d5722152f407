"""The wire format of tensors, on numpy alone: the one implementation of the codecs both ends use.

The KV deltas after each verification round and the weight chunks travel as frames of this format; the edge
client reads and writes them without torch, and the server wraps these functions for torch tensors
(tether.shared.codecs). Codecs (the id travels in every payload, so a receiver never guesses):
- RAW (0): the tensor's bytes as they are, uncompressed. For debugging and for measuring the others.
- FP16_SHUFFLE_ZSTD (1): lossless. The tensor keeps its dtype (fp16 stays fp16, bf16 stays bf16; fp32
  becomes fp16 only with `fp32_as_fp16=True`, which is lossy and refused when a value would overflow).
  The bytes are shuffled into planes (every element's byte 0, then every byte 1, ...) and zstd-compressed.
  Neighbouring values often share sign and exponent, so the high-byte plane is repetitive while the low
  mantissa plane is close to noise; interleaved, the noise breaks up the repeats zstd would match. On
  smooth data that halves the size against plain zstd; on the shipped model's bf16 K/V, LSA vectors and
  weights it gains 1-5% (bench/delta_codecs.py). Integer and bool tensors pass through it losslessly too.
- INT8_ZSTD (2): lossy. Symmetric int8 with one fp16 scale per vector along the last axis (per
  (token, head) row of D values for K/V, per token for hidden states), then zstd of the int8 bytes.
  scale = max|row| / 127, rounded up to the next fp16, so |x - decode(x)| <= scale / 2 in fp32 before
  the cast back to the original dtype (which adds at most half an ulp of that dtype), and an all-zero
  row decodes to zeros. Needs finite inputs with max|row| <= 127 * 65504 (the fp16 scale range).

Arrays: a tensor of dtype name `dtype` ("float32", "bfloat16", "bool", ...) is a numpy array of that dtype,
except bfloat16, which numpy lacks: its uint16 bit patterns. `values(e)` widens bfloat16 to the float32 holding
exactly the same value, for numpy code that computes with it.

Contract:
- `encode_array(a, codec, dtype=None) -> EncodedTensor`; `decode_array(e) -> np.ndarray` (the array as above,
  of the original dtype and shape: lossless codecs round-trip bit-exactly, NaN payloads, Inf and -0.0 included);
  `values(e)`: decode_array with bfloat16 widened.
- `EncodedTensor.to_bytes()` / `EncodedTensor.from_bytes(data)`: a self-describing little-endian frame
      magic b"TTEN" | version u8 | codec u8 | dtype u8 | wire dtype u8 | ndim u8 | shape u32 x ndim
      | payload length u32 | scales length u32 | payload | scales
  (the wire dtype is what the payload holds: int8 for INT8_ZSTD, fp16 for fp32 sent as fp16, else the
  dtype). `from_bytes` checks every field and raises CodecError on any inconsistency; decoding bounds zstd's
  output by the size the shape implies, so a small payload cannot balloon into a large allocation. Both refuse
  a declared tensor larger than `max_nbytes` (default DEFAULT_MAX_NBYTES).
- `encode_many(arrays, codec) -> bytes` (arrays: {name: array or (array, dtype name)}) / `decode_many(data)
  -> {name: values}`: a named bundle
      magic b"TTBN" | version u8 | count u32 | count x (name length u16 | utf-8 name | frame length u32 | frame)
  with the same validation, the `max_nbytes` budget shared by all tensors of the bundle.
  `encode_bf16_bundle(arrays, codec)` (arrays: {name: uint16 bfloat16 bits}) is encode_many of
  {name: (bits, "bfloat16")}, byte for byte and error for error, in a fraction of its time: the server's
  per-round KV delta.
  `parse_many(data, max_nbytes=...) -> dict[str, EncodedTensor]` parses every frame without decompressing any,
  so a receiver can check names, dtypes and shapes against what it expects before it allocates a byte.
- Thread-safe: zstd (de)compressor objects are not, so each thread keeps its own.

    from tether.shared.wire import Codec, decode_many, encode_many
    wire = encode_many({"lsa": lsa, "tli_k": (k_bits, "bfloat16")}, Codec.INT8_ZSTD)
    arrays = decode_many(wire)  # {"lsa": float32 [n, dim], "tli_k": float32 [N, n, Hkv, D]}
"""

from __future__ import annotations

import math
import struct
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from enum import IntEnum

import numpy as np
import zstandard

__all__ = [
    "DEFAULT_MAX_NBYTES",
    "Codec",
    "CodecError",
    "EncodedTensor",
    "decode_array",
    "decode_many",
    "encode_array",
    "encode_bf16_bundle",
    "encode_many",
    "parse_many",
    "values",
]

FORMAT_VERSION = 1
TENSOR_MAGIC = b"TTEN"
BUNDLE_MAGIC = b"TTBN"
MAX_NDIM = 16
MAX_NAME_BYTES = 1024
# Largest decoded tensor (or bundle) a receiver accepts by default: far above any delta or weight chunk,
# far below what would hurt a server.
DEFAULT_MAX_NBYTES = 1 << 31

_HEAD = struct.Struct("<4sBBBBB")  # magic, version, codec, dtype id, wire dtype id, ndim
# 32-bit dims and lengths: a per-round delta is a few KB, so 8-byte fields would be a visible share of it;
# anything near 4 GiB goes in chunks anyway (DEFAULT_MAX_NBYTES is below that).
_DIM = struct.Struct("<I")
_LENGTHS = struct.Struct("<II")  # payload, scales
_U32_MAX = (1 << 32) - 1
_BUNDLE_HEAD = struct.Struct("<4sBI")  # magic, version, count
_NAME_LEN = struct.Struct("<H")
_FRAME_LEN = struct.Struct("<I")

# Wire ids are part of the format: append, never renumber. Each dtype's bytes as a little-endian numpy dtype
# (bfloat16's are uint16 bit patterns; bool's are bytes 0 and 1).
_DTYPES: dict[int, str] = {
    1: "float32",
    2: "float16",
    3: "bfloat16",
    4: "float64",
    5: "uint8",
    6: "int8",
    7: "int16",
    8: "int32",
    9: "int64",
    10: "bool",
}
_DTYPE_IDS = {name: i for i, name in _DTYPES.items()}
_NP: dict[str, str] = {
    "float32": "<f4",
    "float16": "<f2",
    "bfloat16": "<u2",
    "float64": "<f8",
    "uint8": "u1",
    "int8": "i1",
    "int16": "<i2",
    "int32": "<i4",
    "int64": "<i8",
    "bool": "u1",
}
_FLOATS = frozenset({"float16", "bfloat16", "float32", "float64"})
DTYPE_NAMES = tuple(_NP)  # every dtype the format carries, by name (torch's names for them)


class CodecError(ValueError):
    """A tensor that cannot be encoded, or bytes that are not a valid frame."""


class Codec(IntEnum):
    RAW = 0
    FP16_SHUFFLE_ZSTD = 1
    INT8_ZSTD = 2


def _itemsize(name: str) -> int:
    return np.dtype(_NP[name]).itemsize


@dataclass(frozen=True)
class EncodedTensor:
    """One encoded tensor. Valid by construction: every field is checked against the others."""

    codec: Codec
    dtype: str  # the original dtype, which decode returns, e.g. "bfloat16"
    shape: tuple[int, ...]
    payload: bytes
    scales: bytes = b""  # fp16 little-endian, one per row over the last axis; INT8_ZSTD only
    wire_dtype: str = ""  # what the payload holds; "" means the same as dtype

    def __post_init__(self) -> None:
        try:
            codec = Codec(self.codec)
        except ValueError:
            raise CodecError(
                f"unknown codec id {self.codec!r} (known: {', '.join(map(str, map(int, Codec)))})"
            ) from None
        object.__setattr__(self, "codec", codec)
        if not self.wire_dtype:
            object.__setattr__(self, "wire_dtype", self.dtype)
        for field_name in ("dtype", "wire_dtype"):
            if getattr(self, field_name) not in _NP:
                raise CodecError(f"unsupported {field_name} {getattr(self, field_name)!r} (known: {', '.join(_NP)})")
        shape = tuple(self.shape)
        if len(shape) > MAX_NDIM or not all(isinstance(d, int) and 0 <= d <= _U32_MAX for d in shape):
            raise CodecError(f"bad shape {shape!r}: at most {MAX_NDIM} dims, each in [0, 2^32)")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "payload", bytes(self.payload))
        object.__setattr__(self, "scales", bytes(self.scales))
        if max(len(self.payload), len(self.scales)) > _U32_MAX:
            raise CodecError("a frame section exceeds 4 GiB; send the tensor in chunks")

        allowed = {
            Codec.RAW: {self.dtype},
            Codec.FP16_SHUFFLE_ZSTD: {self.dtype} | ({"float16"} if self.dtype == "float32" else set()),
            Codec.INT8_ZSTD: {"int8"} if self.dtype in _FLOATS else set(),
        }[codec]
        if self.wire_dtype not in allowed:
            raise CodecError(f"codec {codec.name} cannot carry a {self.dtype} tensor as {self.wire_dtype}")
        if codec == Codec.RAW and len(self.payload) != self.wire_nbytes:
            raise CodecError(
                f"RAW payload is {len(self.payload)} bytes, shape {shape} {self.dtype} needs {self.wire_nbytes}"
            )
        expected_scales = 2 * self.rows if codec == Codec.INT8_ZSTD else 0
        if len(self.scales) != expected_scales:
            raise CodecError(f"{codec.name} needs {expected_scales} bytes of scales, got {len(self.scales)}")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def rows(self) -> int:
        """Vectors along the last axis, one INT8 scale each (a 0-dim tensor is one row of one value)."""
        return math.prod(self.shape[:-1]) if self.shape else 1

    @property
    def raw_nbytes(self) -> int:
        """The tensor's size in its original dtype."""
        return self.numel * _itemsize(self.dtype)

    @property
    def wire_nbytes(self) -> int:
        """The payload's size once decompressed."""
        return self.numel * _itemsize(self.wire_dtype)

    @property
    def nbytes(self) -> int:
        """Size of `to_bytes()`, without building it."""
        return _HEAD.size + _DIM.size * len(self.shape) + _LENGTHS.size + len(self.payload) + len(self.scales)

    def to_bytes(self) -> bytes:
        return _pack_frame(self.codec, self.dtype, self.wire_dtype, self.shape, self.payload, self.scales)

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview, *, max_nbytes: int = DEFAULT_MAX_NBYTES) -> EncodedTensor:
        """Parse one frame (exactly: trailing bytes are an error). Raises CodecError on anything malformed."""
        data = memoryview(data).cast("B")
        if len(data) < _HEAD.size:
            raise CodecError(f"truncated header: {len(data)} bytes, need at least {_HEAD.size}")
        magic, version, codec_id, dtype_id, wire_id, ndim = _HEAD.unpack_from(data)
        if magic != TENSOR_MAGIC:
            raise CodecError(f"bad magic {bytes(magic)!r}: not an encoded tensor (expected {TENSOR_MAGIC!r})")
        if version != FORMAT_VERSION:
            raise CodecError(f"unsupported format version {version} (this build reads {FORMAT_VERSION})")
        if codec_id not in {int(c) for c in Codec}:
            raise CodecError(f"unknown codec id {codec_id} (known: {', '.join(str(int(c)) for c in Codec)})")
        for what, i in (("dtype", dtype_id), ("wire dtype", wire_id)):
            if i not in _DTYPES:
                raise CodecError(f"unknown {what} id {i} (known: {', '.join(map(str, _DTYPES))})")
        if ndim > MAX_NDIM:
            raise CodecError(f"ndim {ndim} exceeds the limit of {MAX_NDIM}")
        fixed = _HEAD.size + _DIM.size * ndim + _LENGTHS.size
        if len(data) < fixed:
            raise CodecError(f"truncated header: {len(data)} bytes, a {ndim}-dim frame needs {fixed}")
        shape = tuple(_DIM.unpack_from(data, _HEAD.size + _DIM.size * i)[0] for i in range(ndim))
        n_payload, n_scales = _LENGTHS.unpack_from(data, fixed - _LENGTHS.size)
        if len(data) != fixed + n_payload + n_scales:
            state = "truncated" if len(data) < fixed + n_payload + n_scales else "oversize"
            raise CodecError(
                f"{state} frame: {len(data)} bytes, header declares {fixed} + {n_payload} payload + {n_scales} scales"
            )
        dtype = _DTYPES[dtype_id]
        declared = math.prod(shape) * _itemsize(dtype)
        if declared > max_nbytes:
            raise CodecError(f"declared tensor of shape {shape} {dtype} is {declared} bytes > {max_nbytes}")
        return cls(
            codec=Codec(codec_id),
            dtype=dtype,
            shape=shape,
            payload=bytes(data[fixed : fixed + n_payload]),
            scales=bytes(data[fixed + n_payload :]),
            wire_dtype=_DTYPES[wire_id],
        )


# ---- bytes <-> arrays ------------------------------------------------------------------------------------


# Both directions copy one byte column per plane: numpy's generic transpose of a [n, 2] uint8 array walks
# memory with a 1-byte inner stride and runs about 10x slower than these k strided copies.


def _shuffle(u8: np.ndarray, itemsize: int) -> bytes:
    """[n * itemsize] -> byte planes: byte 0 of every element, then byte 1, ..."""
    if itemsize == 1:
        return u8.tobytes()
    elements = u8.reshape(-1, itemsize)  # [n, itemsize]
    planes = np.empty((itemsize, elements.shape[0]), dtype=np.uint8)  # [itemsize, n]
    for i in range(itemsize):
        planes[i] = elements[:, i]
    return planes.tobytes()


def _unshuffle(buf: bytes, itemsize: int) -> np.ndarray:
    """Byte planes -> a writable uint8 [n * itemsize] of whole elements."""
    planes = np.frombuffer(buf, dtype=np.uint8).reshape(itemsize, -1)  # [itemsize, n]
    elements = np.empty((planes.shape[1], itemsize), dtype=np.uint8)  # [n, itemsize]
    for i in range(itemsize):
        elements[:, i] = planes[i]
    return elements.reshape(-1)


# ---- zstd -----------------------------------------------------------------------------------------------

_local = threading.local()  # zstd contexts are not thread-safe; one set per thread


def _compressor(level: int) -> zstandard.ZstdCompressor:
    """This thread's compressor for `level` (already checked)."""
    cache = _local.__dict__.setdefault("compressors", {})
    if level not in cache:
        # The checksum (4 bytes a frame) turns a corrupted payload into an error instead of wrong K/V.
        cache[level] = zstandard.ZstdCompressor(level=level, write_checksum=True, write_content_size=True)
    return cache[level]


def _compress(data: bytes, level: int) -> bytes:
    return _compressor(level).compress(data)


def _decompress(payload: bytes, expected: int) -> bytes:
    """Decompress exactly one frame that must yield exactly `expected` bytes, never allocating more."""
    dctx = _local.__dict__.get("decompressor")
    if dctx is None:
        dctx = _local.decompressor = zstandard.ZstdDecompressor()
    try:
        # decompress() trusts a content size in the frame header over max_output_size, so check it first.
        declared = zstandard.frame_content_size(payload)
        if declared >= 0 and declared != expected:
            raise CodecError(f"zstd frame declares {declared} bytes, the shape implies {expected}")
        # max_output_size=0 would mean "unbounded", hence at least 1.
        out = dctx.decompress(payload, max_output_size=max(expected, 1), allow_extra_data=False)
    except zstandard.ZstdError as e:
        raise CodecError(f"bad zstd payload (the shape implies {expected} bytes): {e}") from None
    if len(out) != expected:
        raise CodecError(f"zstd payload decompresses to {len(out)} bytes, the shape implies {expected}")
    return out


_LEVEL_MIN = -(1 << 17)  # zstd's fastest negative level


def _check_level(level: int) -> None:
    if not isinstance(level, int) or not _LEVEL_MIN <= level <= zstandard.MAX_COMPRESSION_LEVEL:
        raise CodecError(
            f"zstd level {level!r} out of range (fast negative levels up to {zstandard.MAX_COMPRESSION_LEVEL})"
        )


# INT8 works in numpy: a per-round delta is a few hundred values, where torch's per-op dispatch cost would
# dominate. `<f2` / `i1` name the wire byte order explicitly, so no byte swapping is needed on any host.


def _int8_quantise(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x [rows, D] float32/64 -> q [rows, D] int8 and scales [rows] little-endian fp16.

    Scale = max|row| / 127 rounded UP to an fp16, so no value quantises past +-127 and the fp16 the decoder
    multiplies by is exactly the one we divided by; an all-zero row gets scale 0 and quantises to 0."""
    amax = np.abs(x).max(axis=1) if x.shape[1] else np.zeros(x.shape[0], dtype=x.dtype)  # [rows]
    if not np.isfinite(amax).all():  # max propagates NaN and Inf, so one look at amax covers every value
        raise CodecError("INT8_ZSTD needs finite values; use FP16_SHUFFLE_ZSTD for tensors with NaN or Inf")
    exact = amax / 127
    with np.errstate(over="ignore"):  # an overflow to inf is reported below, with the offending value
        s = exact.astype("<f2")
    # Positive fp16 bit patterns are ordered, so +1 on the bits is the next representable value up.
    s = (s.view("<u2") + (s.astype(x.dtype) < exact)).astype("<u2").view("<f2")
    if np.isinf(s).any():
        raise CodecError(f"INT8_ZSTD: max |row| = {float(amax.max()):g} exceeds the fp16 scale range (127 * 65504)")
    sw = s.astype(x.dtype)
    safe = np.where(sw > 0, sw, 1)
    q = np.clip(np.rint(x / safe[:, None]), -127, 127).astype(np.int8)  # rint: round half to even, like torch
    return q, s


def _le_bytes(a: np.ndarray, name: str) -> np.ndarray:
    """An array's elements as little-endian bytes of `name`'s layout: uint8 [numel * itemsize]."""
    if name == "bool":
        a = a.view(np.uint8) if a.dtype == np.bool_ else a
    return np.ascontiguousarray(a, dtype=_NP[name]).reshape(-1).view(np.uint8)


def _from_le_bytes(u8: np.ndarray | bytes, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """Inverse of _le_bytes: a writable native-order array (bfloat16: uint16 bits; bool: checked 0 / 1 bytes)."""
    a = np.frombuffer(u8, dtype=_NP[name])
    if name == "bool":
        if a.size and int(a.max()) > 1:
            raise CodecError("bool tensor holds bytes other than 0 and 1")
        return a.view(np.bool_).reshape(shape).copy()
    return a.astype(np.dtype(_NP[name]).newbyteorder("="), copy=True).reshape(shape)


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) -> the float32 values they are, exactly."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), rounded to nearest even as torch rounds (NaN stays NaN)."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(x), np.uint16(0x7FC0), rounded).astype(np.uint16)


def _float_values(a: np.ndarray, name: str) -> np.ndarray:
    """A float tensor's values as a float32 (float64 stays float64) array."""
    if name == "bfloat16":
        return bf16_to_f32(a)
    return a.astype(np.float64 if name == "float64" else np.float32, copy=False)


def _name_of(dtype: np.dtype) -> str:
    name = "bool" if dtype == np.bool_ else dtype.name
    if name not in _NP or name == "bfloat16":
        raise CodecError(f"unsupported dtype {dtype} (supported: {', '.join(_NP)}; bfloat16 as uint16 bits)")
    return name


def _pack_frame(codec: int, dtype: str, wire: str, shape: tuple[int, ...], payload: bytes, scales: bytes) -> bytes:
    head = _HEAD.pack(TENSOR_MAGIC, FORMAT_VERSION, int(codec), _DTYPE_IDS[dtype], _DTYPE_IDS[wire], len(shape))
    dims = struct.pack(f"<{len(shape)}I", *shape)
    return b"".join([head, dims, _LENGTHS.pack(len(payload), len(scales)), payload, scales])


def _encode(
    a: np.ndarray, codec: Codec, dtype: str | None, level: int, fp32_as_fp16: bool
) -> tuple[Codec, str, str, tuple[int, ...], bytes, bytes]:
    """A frame's fields (codec, dtype, wire dtype, shape, payload, scales): what encode_array wraps in a checked
    EncodedTensor and encode_many packs straight into bytes (a delta's few small frames, every round)."""
    codec = Codec(codec)
    name = _name_of(a.dtype) if dtype is None else dtype
    if name not in _NP:
        raise CodecError(f"unsupported dtype {name} (supported: {', '.join(_NP)})")
    if np.dtype(_NP[name]).kind != a.dtype.kind and not (name == "bool" and a.dtype == np.bool_):
        raise CodecError(f"a {name} tensor cannot be given as a {a.dtype} array")
    shape = tuple(int(d) for d in a.shape)
    if len(shape) > MAX_NDIM:
        raise CodecError(f"ndim {len(shape)} exceeds the limit of {MAX_NDIM}")
    if any(d > _U32_MAX for d in shape):
        raise CodecError(f"bad shape {shape!r}: each dim must be below 2^32; send the tensor in chunks")
    if codec == Codec.RAW:
        return codec, name, name, shape, _le_bytes(a, name).tobytes(), b""
    _check_level(level)
    if codec == Codec.FP16_SHUFFLE_ZSTD:
        wire = name
        if fp32_as_fp16 and name == "float32":
            with np.errstate(over="ignore"):
                half = a.astype(np.float16)
            if (np.isinf(half) & np.isfinite(a)).any():
                raise CodecError("fp32_as_fp16: a finite value overflows fp16 (|x| > 65504); send it as fp32")
            a, wire = half, "float16"
        return codec, name, wire, shape, _compress(_shuffle(_le_bytes(a, wire), _itemsize(wire)), level), b""
    if name not in _FLOATS:
        raise CodecError(f"INT8_ZSTD quantises floating tensors, not {name}")
    rows = math.prod(shape[:-1]) if shape else 1
    x = _float_values(a, name).reshape(rows, shape[-1] if shape else 1)  # [rows, D]
    q, s = _int8_quantise(x)
    return codec, name, "int8", shape, _compress(q.tobytes(), level), s.tobytes()


def encode_array(
    a: np.ndarray, codec: Codec, *, dtype: str | None = None, level: int = 3, fp32_as_fp16: bool = False
) -> EncodedTensor:
    """Encode array `a` of dtype name `dtype` (default: a's own; "bfloat16" takes uint16 bit patterns). `level` is
    zstd's; `fp32_as_fp16` lets FP16_SHUFFLE_ZSTD send float32 as float16 (lossy, decoded back to float32).
    Raises CodecError for unsupported input."""
    codec, name, wire, shape, payload, scales = _encode(a, codec, dtype, level, fp32_as_fp16)
    return EncodedTensor(codec, name, shape, payload, scales, wire_dtype=wire)


def decode_array(e: EncodedTensor) -> np.ndarray:
    """The array `e` encodes (bfloat16 as uint16 bits), in its original dtype and shape. Raises CodecError on a
    bad payload."""
    if e.codec == Codec.RAW:
        return _from_le_bytes(e.payload, e.dtype, e.shape)
    raw = _decompress(e.payload, e.wire_nbytes)
    if e.codec == Codec.FP16_SHUFFLE_ZSTD:
        a = _from_le_bytes(_unshuffle(raw, _itemsize(e.wire_dtype)), e.wire_dtype, e.shape)
        return a.astype(np.float32) if e.wire_dtype != e.dtype else a
    work = np.float64 if e.dtype == "float64" else np.float32
    s = np.frombuffer(e.scales, dtype="<f2").astype(work)  # [rows]
    if not (np.isfinite(s) & (s >= 0)).all():
        raise CodecError("INT8_ZSTD scales must be finite and non-negative")
    q = np.frombuffer(raw, dtype=np.int8).reshape(e.rows, e.shape[-1] if e.shape else 1)  # [rows, D]
    x = (q * s[:, None]).reshape(e.shape)
    if e.dtype == "bfloat16":
        return f32_to_bf16(x)
    return x.astype(np.dtype(_NP[e.dtype]).newbyteorder("="))


def values(e: EncodedTensor) -> np.ndarray:
    """decode_array, with bfloat16 widened to the float32 holding exactly the same values."""
    a = decode_array(e)
    return bf16_to_f32(a) if e.dtype == "bfloat16" else a


# ---- named bundles --------------------------------------------------------------------------------------


def encode_many(
    arrays: Mapping[str, np.ndarray | tuple[np.ndarray, str]],
    codec: Codec,
    *,
    level: int = 3,
    fp32_as_fp16: bool = False,
) -> bytes:
    """A bundle of named arrays (e.g. a KV delta's "lsa", "tli_k", "tli_v"), each its own frame; an entry may be
    (array, dtype name), as bfloat16 bits must."""
    parts = [_BUNDLE_HEAD.pack(BUNDLE_MAGIC, FORMAT_VERSION, len(arrays))]
    for name, entry in arrays.items():
        key = name.encode("utf-8")
        if not key or len(key) > MAX_NAME_BYTES:
            raise CodecError(f"tensor name {name!r} must be 1..{MAX_NAME_BYTES} utf-8 bytes")
        a, dtype = entry if isinstance(entry, tuple) else (entry, None)
        fields = _encode(a, codec, dtype, level, fp32_as_fp16)
        if len(fields[4]) + len(fields[5]) > _U32_MAX:
            raise CodecError(f"tensor {name!r} encodes to over 4 GiB; send it in chunks")
        frame = _pack_frame(*fields)
        parts += [_NAME_LEN.pack(len(key)), key, _FRAME_LEN.pack(len(frame)), frame]
    return b"".join(parts)


# encode_bf16_bundle packs everything of a bundle entry before the payload with one struct: name length, name,
# frame length, then the frame's _HEAD, dims and _LENGTHS. One per (name bytes, ndim), at most
# MAX_NAME_BYTES * (MAX_NDIM + 1) of them, a handful in practice.
_ENTRY_HEADS: dict[tuple[int, int], tuple[struct.Struct, int]] = {}
_BF16 = _DTYPE_IDS["bfloat16"]
_U16 = np.dtype(np.uint16)  # native order: the wire's little-endian bytes on a _FAST_HOST
_FAST_HOST = sys.byteorder == "little"
# Up to this many elements, slicing a bytes object into planes is the quicker shuffle: a byte loop, twice as fast as
# numpy's transpose at 200 elements, even at about 1k, twice as slow at 8k (numpy 2.4).
_SMALL = 1024


def _entry_head(n_key: int, ndim: int) -> tuple[struct.Struct, int]:
    """The struct of an entry's bytes before its payload, and the frame's size without the payload."""
    head = _ENTRY_HEADS.get((n_key, ndim))
    if head is None:
        fmt = f"{_NAME_LEN.format}{n_key}s{_FRAME_LEN.format[1:]}{_HEAD.format[1:]}{ndim}I{_LENGTHS.format[1:]}"
        head = _ENTRY_HEADS[n_key, ndim] = (struct.Struct(fmt), _HEAD.size + _DIM.size * ndim + _LENGTHS.size)
    return head


def encode_bf16_bundle(arrays: Mapping[str, np.ndarray], codec: Codec, *, level: int = 3) -> bytes:
    """encode_many({name: (bits, "bfloat16")}, codec, level=level) for uint16 arrays of bfloat16 bits (any
    strides), the same bytes, at a fraction of the cost: the server encodes a KV delta of a few small tensors every
    round on its batcher's thread. RAW and FP16_SHUFFLE_ZSTD on a little-endian host take the fast path; anything
    else (INT8_ZSTD, a big-endian host, and any input the general path would refuse) goes through encode_many,
    which returns or raises exactly what it would have."""
    if not _FAST_HOST or not (codec == Codec.RAW or codec == Codec.FP16_SHUFFLE_ZSTD):
        return _encode_bf16_general(arrays, codec, level)
    shuffle = codec == Codec.FP16_SHUFFLE_ZSTD
    if shuffle:
        if type(level) is not int or not _LEVEL_MIN <= level <= zstandard.MAX_COMPRESSION_LEVEL:
            return _encode_bf16_general(arrays, codec, level)
        compress = _compressor(level).compress
    codec_id = int(codec)
    parts = [_BUNDLE_HEAD.pack(BUNDLE_MAGIC, FORMAT_VERSION, len(arrays))]
    try:
        for name, a in arrays.items():
            key = name.encode("utf-8")
            n_key = len(key)
            ndim = a.ndim if type(a) is np.ndarray else MAX_NDIM + 1
            # A huge element count goes the general way too, which checks the dims before it copies a byte.
            if not 0 < n_key <= MAX_NAME_BYTES or ndim > MAX_NDIM or a.dtype != _U16 or a.size > _U32_MAX:
                return _encode_bf16_general(arrays, codec, level)
            if shuffle and a.size <= _SMALL:
                # A delta's few hundred values: bytes' own strided slicing beats any numpy call sequence.
                raw = a.tobytes()  # C order, whatever a's strides
                payload = compress(raw[0::2] + raw[1::2])
            elif shuffle:
                # tobytes of the transposed [n, 2] byte view writes the planes in one pass (on numpy 2.4 faster
                # than _shuffle's plane loop at every size measured); ravel copies only a strided slice.
                payload = compress(a.ravel().view(np.uint8).reshape(-1, 2).T.tobytes())  # [2, n]
            else:
                payload = a.tobytes()  # C order, whatever a's strides
            head, frame_fixed = _entry_head(n_key, ndim)
            n = len(payload)
            parts += [
                head.pack(
                    n_key,
                    key,
                    frame_fixed + n,
                    TENSOR_MAGIC,
                    FORMAT_VERSION,
                    codec_id,
                    _BF16,
                    _BF16,
                    ndim,
                    *a.shape,
                    n,
                    0,
                ),
                payload,
            ]
    except struct.error:  # a dim or payload of 4 GiB or more: the general path refuses it in its own words
        return _encode_bf16_general(arrays, codec, level)
    return b"".join(parts)


def _encode_bf16_general(arrays: Mapping[str, np.ndarray], codec: Codec, level: int) -> bytes:
    return encode_many({name: (a, "bfloat16") for name, a in arrays.items()}, codec, level=level)


def decode_many(data: bytes | bytearray | memoryview, *, max_nbytes: int = DEFAULT_MAX_NBYTES) -> dict[str, np.ndarray]:
    """Inverse of encode_many, as `values` (bfloat16 widened). `max_nbytes` bounds the decoded bundle as a whole.
    Raises CodecError."""
    return {name: values(e) for name, e in parse_many(data, max_nbytes=max_nbytes).items()}


def parse_many(
    data: bytes | bytearray | memoryview, *, max_nbytes: int = DEFAULT_MAX_NBYTES
) -> dict[str, EncodedTensor]:
    """A bundle's frames, checked but not decompressed; their declared sizes together at most `max_nbytes`."""
    data = memoryview(data).cast("B")
    if len(data) < _BUNDLE_HEAD.size:
        raise CodecError(f"truncated bundle header: {len(data)} bytes, need {_BUNDLE_HEAD.size}")
    magic, version, count = _BUNDLE_HEAD.unpack_from(data)
    if magic != BUNDLE_MAGIC:
        raise CodecError(f"bad magic {bytes(magic)!r}: not a tensor bundle (expected {BUNDLE_MAGIC!r})")
    if version != FORMAT_VERSION:
        raise CodecError(f"unsupported bundle format version {version} (this build reads {FORMAT_VERSION})")
    out: dict[str, EncodedTensor] = {}
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
        e = EncodedTensor.from_bytes(data[pos : pos + n_frame], max_nbytes=budget)
        budget -= e.raw_nbytes
        out[name] = e
        pos += n_frame
    if pos != len(data):
        raise CodecError(f"oversize bundle: {len(data) - pos} trailing bytes after {count} entries")
    return out
