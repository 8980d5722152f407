"""The wire format of tensors, on numpy alone: the framing both ends use, over the codecs of
tether.shared.wire_codecs (RAW, lossless FP16_SHUFFLE_ZSTD, INT8_ZSTD, and the grouped INT4/INT3/INT2_HADAMARD:
that module's docstring says what each sends and guarantees).

The KV deltas after each verification round and the weight chunks travel as frames of this format; the edge
client reads and writes them without torch, and the server wraps these functions for torch tensors
(tether.shared.codecs). The codec id travels in every frame, so a receiver never guesses.

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
  (the wire dtype is what the payload holds: int8 for INT8_ZSTD, uint8 (packed symbols) for the grouped codecs,
  fp16 for fp32 sent as fp16, else the dtype). `from_bytes` checks every field and raises CodecError on any
  inconsistency: a RAW or grouped payload and every scales section must be exactly the size the shape implies,
  and decoding bounds zstd's output by that size, so a small payload cannot balloon into a large allocation.
  Both refuse a declared tensor larger than `max_nbytes` (default DEFAULT_MAX_NBYTES).
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
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import zstandard

from tether.shared.wire_codecs import (
    DTYPE_IDS,
    DTYPE_NAMES,
    DTYPES,
    LEVEL_MIN,
    NP_DTYPES,
    Codec,
    CodecError,
    allowed_wire_dtypes,
    bf16_to_f32,
    compressor,
    decode_payload,
    encode_payload,
    exact_payload_nbytes,
    f32_to_bf16,
    itemsize,
    name_of,
    rows_of,
    scales_nbytes,
)

__all__ = [
    "DEFAULT_MAX_NBYTES",
    "DTYPE_NAMES",
    "Codec",
    "CodecError",
    "EncodedTensor",
    "bf16_to_f32",
    "decode_array",
    "decode_many",
    "encode_array",
    "encode_bf16_bundle",
    "encode_many",
    "f32_to_bf16",
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
            if getattr(self, field_name) not in NP_DTYPES:
                raise CodecError(
                    f"unsupported {field_name} {getattr(self, field_name)!r} (known: {', '.join(NP_DTYPES)})"
                )
        shape = tuple(self.shape)
        if len(shape) > MAX_NDIM or not all(isinstance(d, int) and 0 <= d <= _U32_MAX for d in shape):
            raise CodecError(f"bad shape {shape!r}: at most {MAX_NDIM} dims, each in [0, 2^32)")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "payload", bytes(self.payload))
        object.__setattr__(self, "scales", bytes(self.scales))
        if max(len(self.payload), len(self.scales)) > _U32_MAX:
            raise CodecError("a frame section exceeds 4 GiB; send the tensor in chunks")

        allowed = allowed_wire_dtypes(codec, self.dtype)
        if self.wire_dtype not in allowed:
            raise CodecError(f"codec {codec.name} cannot carry a {self.dtype} tensor as {self.wire_dtype}")
        exact = exact_payload_nbytes(codec, self.wire_dtype, shape)
        if exact is not None and len(self.payload) != exact:
            raise CodecError(
                f"{codec.name} payload is {len(self.payload)} bytes, shape {shape} {self.dtype} needs {exact}"
            )
        expected_scales = scales_nbytes(codec, shape)
        if len(self.scales) != expected_scales:
            raise CodecError(f"{codec.name} needs {expected_scales} bytes of scales, got {len(self.scales)}")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def rows(self) -> int:
        """Vectors along the last axis, one INT8 scale each (a 0-dim tensor is one row of one value)."""
        return rows_of(self.shape)[0]

    @property
    def raw_nbytes(self) -> int:
        """The tensor's size in its original dtype."""
        return self.numel * itemsize(self.dtype)

    @property
    def wire_nbytes(self) -> int:
        """The payload's size once decompressed."""
        return self.numel * itemsize(self.wire_dtype)

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
            if i not in DTYPES:
                raise CodecError(f"unknown {what} id {i} (known: {', '.join(map(str, DTYPES))})")
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
        dtype = DTYPES[dtype_id]
        declared = math.prod(shape) * itemsize(dtype)
        if declared > max_nbytes:
            raise CodecError(f"declared tensor of shape {shape} {dtype} is {declared} bytes > {max_nbytes}")
        return cls(
            codec=Codec(codec_id),
            dtype=dtype,
            shape=shape,
            payload=bytes(data[fixed : fixed + n_payload]),
            scales=bytes(data[fixed + n_payload :]),
            wire_dtype=DTYPES[wire_id],
        )


def _pack_frame(codec: int, dtype: str, wire: str, shape: tuple[int, ...], payload: bytes, scales: bytes) -> bytes:
    head = _HEAD.pack(TENSOR_MAGIC, FORMAT_VERSION, int(codec), DTYPE_IDS[dtype], DTYPE_IDS[wire], len(shape))
    dims = struct.pack(f"<{len(shape)}I", *shape)
    return b"".join([head, dims, _LENGTHS.pack(len(payload), len(scales)), payload, scales])


def _encode(
    a: np.ndarray, codec: Codec, dtype: str | None, level: int, fp32_as_fp16: bool
) -> tuple[Codec, str, str, tuple[int, ...], bytes, bytes]:
    """A frame's fields (codec, dtype, wire dtype, shape, payload, scales): what encode_array wraps in a checked
    EncodedTensor and encode_many packs straight into bytes (a delta's few small frames, every round)."""
    codec = Codec(codec)
    name = name_of(a.dtype) if dtype is None else dtype
    if name not in NP_DTYPES:
        raise CodecError(f"unsupported dtype {name} (supported: {', '.join(NP_DTYPES)})")
    if np.dtype(NP_DTYPES[name]).kind != a.dtype.kind and not (name == "bool" and a.dtype == np.bool_):
        raise CodecError(f"a {name} tensor cannot be given as a {a.dtype} array")
    shape = tuple(int(d) for d in a.shape)
    if len(shape) > MAX_NDIM:
        raise CodecError(f"ndim {len(shape)} exceeds the limit of {MAX_NDIM}")
    if any(d > _U32_MAX for d in shape):
        raise CodecError(f"bad shape {shape!r}: each dim must be below 2^32; send the tensor in chunks")
    wire, payload, scales = encode_payload(a, codec, name, level, fp32_as_fp16)
    return codec, name, wire, shape, payload, scales


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
    return decode_payload(e.codec, e.dtype, e.wire_dtype, e.shape, e.payload, e.scales)


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
_BF16 = DTYPE_IDS["bfloat16"]
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
        if type(level) is not int or not LEVEL_MIN <= level <= zstandard.MAX_COMPRESSION_LEVEL:
            return _encode_bf16_general(arrays, codec, level)
        compress = compressor(level).compress
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
