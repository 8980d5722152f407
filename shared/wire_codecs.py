"""The codecs of the tensor wire format: how an array becomes a frame's payload and scales, and back, on numpy and
zstandard alone. tether.shared.wire frames what these produce (header, shape, lengths, bundles) and is the API both
ends call; this module is the arithmetic under it. Codecs (the id travels in every frame; append, never renumber):
- RAW (0): the tensor's little-endian bytes as they are.
- FP16_SHUFFLE_ZSTD (1): lossless; byte planes (every element's byte 0, then every byte 1, ...) then zstd. fp32 may
  travel as fp16 (`fp32_as_fp16`, lossy, refused when a value would overflow).
- INT8_ZSTD (2): symmetric int8, one fp16 scale per row along the last axis (max|row| / 127 rounded up to an fp16,
  so |x - decode(x)| <= scale / 2 before the cast back), then zstd of the int8 bytes.
- INT4_HADAMARD (3), INT3_HADAMARD (4), INT2_HADAMARD (5): grouped low-bit quantisation. Each row along the last
  axis (length d) is cut into groups of g = min(64, the power of two >= d) values (the last one zero-padded), each
  group rotated by R = diag(signs) H / sqrt(g) (H the Sylvester Hadamard matrix, signs the fixed +-1 sequence of
  `rotation`), then quantised with b bits mid-rise: scale s = min(max|z|, CLIP[b] rms(z)) / (2^(b-1) - 1/2) rounded
  up to an fp16, symbol clip(floor(z / s), -2^(b-1), 2^(b-1) - 1) + 2^(b-1) in [0, 2^b), decoded as (symbol -
  2^(b-1) + 1/2) s, then rotated back by R^T. So each rotated value decodes to the nearest of its group's 2^b
  levels: within s / 2 of it unless |z| > 2^(b-1) s (the few tail values CLIP gives up for a finer step). The
  rotation is why these beat plain grouping on K and LSA vectors: a few outlier channels set max|x| of every group
  they touch, and the rotation spreads them (measured on the default model's deltas, 4 bits: K's relative error
  0.147 -> 0.097, LSA's 0.162 -> 0.097; V, already Gaussian-like, unchanged). The symbols are bit-packed,
  little-endian within a chunk of c = 8 / gcd(b, 8) symbols (4 bits: two per byte, the first in the low nibble; 3
  bits: eight in three bytes), symbols padded with zeros to whole chunks, and sent without zstd: rotated symbols are
  near-uniform, and zstd on them came out 1% larger than the packed bytes (bench/wire_bytes.py, "entropy"); its
  frame would add 13 bytes more. Wire dtype "uint8"; scales: one fp16 per group.

Contract: `encode_payload(a, codec, name, level, fp32_as_fp16) -> (wire dtype, payload, scales)`;
`decode_payload(codec, dtype, wire dtype, shape, payload, scales) -> array` (bfloat16 as uint16 bits), bounded:
a zstd payload must decompress to exactly the size the shape implies, a packed one must be exactly its size.
`allowed_wire_dtypes`, `scales_nbytes` and `exact_payload_nbytes` are the rules tether.shared.wire checks every
frame against before it decodes a byte. Raises CodecError. Thread-safe (zstd contexts are per thread).
"""

from __future__ import annotations

import functools
import math
import threading
from enum import IntEnum

import numpy as np
import zstandard

# Wire ids are part of the format: append, never renumber. Each dtype's bytes as a little-endian numpy dtype
# (bfloat16's are uint16 bit patterns; bool's are bytes 0 and 1).
DTYPES: dict[int, str] = {
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
DTYPE_IDS = {name: i for i, name in DTYPES.items()}
NP_DTYPES: dict[str, str] = {
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
FLOATS = frozenset({"float16", "bfloat16", "float32", "float64"})
DTYPE_NAMES = tuple(NP_DTYPES)  # every dtype the format carries, by name (torch's names for them)


class CodecError(ValueError):
    """A tensor that cannot be encoded, or bytes that are not a valid frame."""


class Codec(IntEnum):
    RAW = 0
    FP16_SHUFFLE_ZSTD = 1
    INT8_ZSTD = 2
    INT4_HADAMARD = 3
    INT3_HADAMARD = 4
    INT2_HADAMARD = 5


GROUP = 64  # the largest group of the grouped codecs
GROUPED_BITS = {Codec.INT4_HADAMARD: 4, Codec.INT3_HADAMARD: 3, Codec.INT2_HADAMARD: 2}
# The outermost level sits at min(max|z|, CLIP * rms(z)): CLIP / (2^(b-1) - 1/2) rms is about the step that
# minimises a Gaussian's squared error with 2^b uniform levels (1.0, 0.59 and 0.34 of its sigma for 2, 3 and 4
# bits), and rotated groups are close to Gaussian. On the default model's deltas it cut the relative error from
# 0.49 to 0.33 (2 bits) and from 0.21 to 0.18 (3 bits); at 4 bits max|z| is about there anyway.
CLIP = {2: 1.5, 3: 2.0, 4: 2.5}


def itemsize(name: str) -> int:
    return np.dtype(NP_DTYPES[name]).itemsize


def rows_of(shape: tuple[int, ...]) -> tuple[int, int]:
    """(rows, row length): vectors along the last axis (a 0-dim tensor is one row of one value)."""
    return (math.prod(shape[:-1]), shape[-1]) if shape else (1, 1)


def group_size(d: int) -> int:
    """The grouped codecs' group for rows of d values: the power of two >= d, at most GROUP."""
    return min(GROUP, 1 << max(d - 1, 0).bit_length())


def _chunk(bits: int) -> tuple[int, int]:
    """Symbols per packing chunk and its bytes: 4 bits (2, 1), 3 bits (8, 3), 2 bits (4, 1)."""
    c = 8 // math.gcd(bits, 8)
    return c, bits * c // 8


def _grouped_layout(shape: tuple[int, ...]) -> tuple[int, int, int]:
    """(rows, groups per row, group size) of a tensor under the grouped codecs."""
    rows, d = rows_of(shape)
    g = group_size(d)
    return rows, -(-d // g), g


def allowed_wire_dtypes(codec: Codec, dtype: str) -> set[str]:
    """What a frame of `codec` may hold for a tensor of `dtype`."""
    if codec == Codec.RAW:
        return {dtype}
    if codec == Codec.FP16_SHUFFLE_ZSTD:
        return {dtype} | ({"float16"} if dtype == "float32" else set())
    if dtype not in FLOATS:
        return set()
    return {"int8"} if codec == Codec.INT8_ZSTD else {"uint8"}


def scales_nbytes(codec: Codec, shape: tuple[int, ...]) -> int:
    """The scales section's exact size: fp16 per row (INT8) or per group (grouped codecs), else none."""
    if codec == Codec.INT8_ZSTD:
        return 2 * rows_of(shape)[0]
    if codec in GROUPED_BITS:
        rows, groups, _ = _grouped_layout(shape)
        return 2 * rows * groups
    return 0


def exact_payload_nbytes(codec: Codec, wire: str, shape: tuple[int, ...]) -> int | None:
    """The payload's exact size where the codec fixes it (RAW, grouped), None for a zstd frame."""
    if codec == Codec.RAW:
        return math.prod(shape) * itemsize(wire)
    if codec in GROUPED_BITS:
        rows, groups, g = _grouped_layout(shape)
        c, nbytes = _chunk(GROUPED_BITS[codec])
        return -(-(rows * groups * g) // c) * nbytes
    return None


# ---- bytes <-> arrays ------------------------------------------------------------------------------------


# Both directions copy one byte column per plane: numpy's generic transpose of a [n, 2] uint8 array walks
# memory with a 1-byte inner stride and runs about 10x slower than these k strided copies.


def shuffle(u8: np.ndarray, size: int) -> bytes:
    """[n * size] -> byte planes: byte 0 of every element, then byte 1, ..."""
    if size == 1:
        return u8.tobytes()
    elements = u8.reshape(-1, size)  # [n, size]
    planes = np.empty((size, elements.shape[0]), dtype=np.uint8)  # [size, n]
    for i in range(size):
        planes[i] = elements[:, i]
    return planes.tobytes()


def unshuffle(buf: bytes, size: int) -> np.ndarray:
    """Byte planes -> a writable uint8 [n * size] of whole elements."""
    planes = np.frombuffer(buf, dtype=np.uint8).reshape(size, -1)  # [size, n]
    elements = np.empty((planes.shape[1], size), dtype=np.uint8)  # [n, size]
    for i in range(size):
        elements[:, i] = planes[i]
    return elements.reshape(-1)


def le_bytes(a: np.ndarray, name: str) -> np.ndarray:
    """An array's elements as little-endian bytes of `name`'s layout: uint8 [numel * itemsize]."""
    if name == "bool":
        a = a.view(np.uint8) if a.dtype == np.bool_ else a
    return np.ascontiguousarray(a, dtype=NP_DTYPES[name]).reshape(-1).view(np.uint8)


def from_le_bytes(u8: np.ndarray | bytes, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """Inverse of le_bytes: a writable native-order array (bfloat16: uint16 bits; bool: checked 0 / 1 bytes)."""
    a = np.frombuffer(u8, dtype=NP_DTYPES[name])
    if name == "bool":
        if a.size and int(a.max()) > 1:
            raise CodecError("bool tensor holds bytes other than 0 and 1")
        return a.view(np.bool_).reshape(shape).copy()
    return a.astype(np.dtype(NP_DTYPES[name]).newbyteorder("="), copy=True).reshape(shape)


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) -> the float32 values they are, exactly."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), rounded to nearest even as torch rounds (NaN stays NaN)."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(x), np.uint16(0x7FC0), rounded).astype(np.uint16)


def float_values(a: np.ndarray, name: str) -> np.ndarray:
    """A float tensor's values as a float32 (float64 stays float64) array."""
    if name == "bfloat16":
        return bf16_to_f32(a)
    return a.astype(np.float64 if name == "float64" else np.float32, copy=False)


def _as_dtype(x: np.ndarray, name: str) -> np.ndarray:
    """Decoded float values back in the tensor's own dtype (bfloat16 as its bits)."""
    if name == "bfloat16":
        return f32_to_bf16(x)
    return x.astype(np.dtype(NP_DTYPES[name]).newbyteorder("="))


def name_of(dtype: np.dtype) -> str:
    name = "bool" if dtype == np.bool_ else dtype.name
    if name not in NP_DTYPES or name == "bfloat16":
        raise CodecError(f"unsupported dtype {dtype} (supported: {', '.join(NP_DTYPES)}; bfloat16 as uint16 bits)")
    return name


# ---- zstd -----------------------------------------------------------------------------------------------

_local = threading.local()  # zstd contexts are not thread-safe; one set per thread
LEVEL_MIN = -(1 << 17)  # zstd's fastest negative level


def compressor(level: int) -> zstandard.ZstdCompressor:
    """This thread's compressor for `level` (already checked)."""
    cache = _local.__dict__.setdefault("compressors", {})
    if level not in cache:
        # The checksum (4 bytes a frame) turns a corrupted payload into an error instead of wrong K/V.
        cache[level] = zstandard.ZstdCompressor(level=level, write_checksum=True, write_content_size=True)
    return cache[level]


def decompress(payload: bytes, expected: int) -> bytes:
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


def check_level(level: int) -> None:
    if not isinstance(level, int) or not LEVEL_MIN <= level <= zstandard.MAX_COMPRESSION_LEVEL:
        raise CodecError(
            f"zstd level {level!r} out of range (fast negative levels up to {zstandard.MAX_COMPRESSION_LEVEL})"
        )


# ---- quantisers -----------------------------------------------------------------------------------------
# They work in numpy: a per-round delta is a few hundred values, where torch's per-op dispatch cost would
# dominate. `<f2` / `i1` name the wire byte order explicitly, so no byte swapping is needed on any host.


def _fp16_scales_up(amax: np.ndarray, levels: float, codec: str) -> np.ndarray:
    """amax [n] -> little-endian fp16 scales [n], amax / levels rounded UP to an fp16: no value quantises past the
    outermost level, and the fp16 the decoder multiplies by is exactly the one the encoder divided by."""
    if not np.isfinite(amax).all():  # max propagates NaN and Inf, so one look at amax covers every value
        raise CodecError(f"{codec} needs finite values; use FP16_SHUFFLE_ZSTD for tensors with NaN or Inf")
    exact = amax / levels
    with np.errstate(over="ignore"):  # an overflow to inf is reported below, with the offending value
        s = exact.astype("<f2")
    # Positive fp16 bit patterns are ordered, so +1 on the bits is the next representable value up.
    s = (s.view("<u2") + (s.astype(amax.dtype) < exact)).astype("<u2").view("<f2")
    if np.isinf(s).any():
        raise CodecError(f"{codec}: max |value| = {float(amax.max()):g} exceeds the fp16 scale range")
    return s


def _int8_quantise(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x [rows, D] float32/64 -> q [rows, D] int8 and scales [rows] little-endian fp16; an all-zero row gets
    scale 0 and quantises to 0."""
    amax = np.abs(x).max(axis=1) if x.shape[1] else np.zeros(x.shape[0], dtype=x.dtype)  # [rows]
    s = _fp16_scales_up(amax, 127, "INT8_ZSTD")
    sw = s.astype(x.dtype)
    safe = np.where(sw > 0, sw, 1)
    q = np.clip(np.rint(x / safe[:, None]), -127, 127).astype(np.int8)  # rint: round half to even, like torch
    return q, s


@functools.cache
def rotation(g: int, dtype: str) -> np.ndarray:
    """The grouped codecs' orthogonal R [g, g] = diag(signs) H / sqrt(g); signs[i] is the top bit of
    (i + 1) * 0x9E3779B97F4A7C15 mod 2^64 (Fibonacci hashing), -1 when set. Part of the format: never change it."""
    h = np.ones((1, 1))
    while h.shape[0] < g:
        h = np.block([[h, h], [h, -h]])
    signs = np.array([-1.0 if ((i + 1) * 0x9E3779B97F4A7C15) & (1 << 63) else 1.0 for i in range(g)])
    r = (signs[:, None] * h / math.sqrt(g)).astype(dtype)
    r.setflags(write=False)
    return r


def _grouped(x: np.ndarray, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """x [rows, d] -> the rotated groups z [rows * groups, g] and the rotation."""
    rows, groups, g = _grouped_layout(shape)
    if groups * g != x.shape[1]:
        x = np.pad(x, ((0, 0), (0, groups * g - x.shape[1])))
    r = rotation(g, x.dtype.name)
    return x.reshape(rows * groups, g) @ r, r


def _pack(sym: np.ndarray, bits: int) -> bytes:
    """Symbols [n] uint8 < 2^bits -> little-endian bit-packed chunks (zero symbols pad the last chunk)."""
    c, nbytes = _chunk(bits)
    if len(sym) % c:
        sym = np.concatenate([sym, np.zeros(-len(sym) % c, dtype=np.uint8)])
    sym = sym.reshape(-1, c)  # [chunks, c]
    if nbytes == 1:  # 2 and 4 bits: a chunk is one byte, built in uint8
        out = sym[:, 0].copy()
        for j in range(1, c):
            out |= sym[:, j] << (bits * j)
        return out.tobytes()
    word = sym[:, 0].astype("<u4")
    for j in range(1, c):
        word |= sym[:, j].astype("<u4") << (bits * j)
    return np.ascontiguousarray(word.view(np.uint8).reshape(-1, 4)[:, :nbytes]).tobytes()


def _unpack(payload: bytes, bits: int, n: int) -> np.ndarray:
    """Inverse of _pack: the first n symbols, uint8 [n]; `payload` is exactly the packed size of n symbols."""
    c, nbytes = _chunk(bits)
    packed = np.frombuffer(payload, dtype=np.uint8)
    if nbytes == 1:
        word = packed
    else:
        word4 = np.zeros((len(packed) // nbytes, 4), dtype=np.uint8)
        word4[:, :nbytes] = packed.reshape(-1, nbytes)
        word = word4.view("<u4")[:, 0]  # [chunks]
    sym = np.empty((len(word), c), dtype=np.uint8)  # [chunks, c]
    mask = (1 << bits) - 1
    for j in range(c):
        sym[:, j] = (word >> (bits * j)) & mask
    return sym.reshape(-1)[:n]


def _grouped_quantise(x: np.ndarray, shape: tuple[int, ...], codec: Codec) -> tuple[bytes, bytes]:
    """x [rows, d] float32/64 -> (packed symbols, fp16 scales, one per group); see the module docstring."""
    bits = GROUPED_BITS[codec]
    half = 1 << (bits - 1)
    z, _ = _grouped(x, shape)  # [rows * groups, g]
    if z.shape[0]:
        amax = np.abs(z).max(axis=1)  # NaN and Inf show here (and are refused below)
        with np.errstate(over="ignore", invalid="ignore"):
            amax = np.minimum(amax, CLIP[bits] * np.sqrt(np.einsum("ij,ij->i", z, z) / z.shape[1]))
    else:
        amax = np.zeros(0, dtype=z.dtype)
    s = _fp16_scales_up(amax, half - 0.5, codec.name)
    sw = s.astype(z.dtype)
    safe = np.where(sw > 0, sw, 1)
    q = np.clip(np.floor(z / safe[:, None]), -half, half - 1) + half  # [rows * groups, g], in [0, 2^bits)
    return _pack(q.astype(np.uint8).reshape(-1), bits), s.tobytes()


def _grouped_dequantise(payload: bytes, scales: bytes, shape: tuple[int, ...], codec: Codec, work) -> np.ndarray:
    """Inverse of _grouped_quantise: the values [rows, d] in `work` (float32 or float64)."""
    bits = GROUPED_BITS[codec]
    rows, groups, g = _grouped_layout(shape)
    s = np.frombuffer(scales, dtype="<f2").astype(work)  # [rows * groups]
    if not (np.isfinite(s) & (s >= 0)).all():
        raise CodecError(f"{codec.name} scales must be finite and non-negative")
    q = _unpack(payload, bits, rows * groups * g).reshape(rows * groups, g)
    z = (q.astype(work) - ((1 << (bits - 1)) - 0.5)) * s[:, None]  # [rows * groups, g]
    x = (z @ rotation(g, np.dtype(work).name).T).reshape(rows, groups * g)
    return x[:, : rows_of(shape)[1]]


# ---- payloads ----------------------------------------------------------------------------------------------


def encode_payload(a: np.ndarray, codec: Codec, name: str, level: int, fp32_as_fp16: bool) -> tuple[str, bytes, bytes]:
    """(wire dtype, payload, scales) of array `a` holding a `name` tensor (checked by the caller) under `codec`."""
    shape = tuple(int(d) for d in a.shape)
    if codec == Codec.RAW:
        return name, le_bytes(a, name).tobytes(), b""
    if codec == Codec.FP16_SHUFFLE_ZSTD:
        check_level(level)
        wire = name
        if fp32_as_fp16 and name == "float32":
            with np.errstate(over="ignore"):
                half = a.astype(np.float16)
            if (np.isinf(half) & np.isfinite(a)).any():
                raise CodecError("fp32_as_fp16: a finite value overflows fp16 (|x| > 65504); send it as fp32")
            a, wire = half, "float16"
        return wire, compressor(level).compress(shuffle(le_bytes(a, wire), itemsize(wire))), b""
    if name not in FLOATS:
        raise CodecError(f"{codec.name} quantises floating tensors, not {name}")
    x = float_values(a, name).reshape(rows_of(shape))  # [rows, D]
    if codec == Codec.INT8_ZSTD:
        check_level(level)
        q, s = _int8_quantise(x)
        return "int8", compressor(level).compress(q.tobytes()), s.tobytes()
    payload, scales = _grouped_quantise(x, shape, codec)
    return "uint8", payload, scales


def decode_payload(
    codec: Codec, dtype: str, wire: str, shape: tuple[int, ...], payload: bytes, scales: bytes
) -> np.ndarray:
    """The array a checked frame's fields encode (bfloat16 as uint16 bits), in its dtype and shape."""
    if codec == Codec.RAW:
        return from_le_bytes(payload, dtype, shape)
    if codec == Codec.FP16_SHUFFLE_ZSTD:
        raw = decompress(payload, math.prod(shape) * itemsize(wire))
        a = from_le_bytes(unshuffle(raw, itemsize(wire)), wire, shape)
        return a.astype(np.float32) if wire != dtype else a
    work = np.float64 if dtype == "float64" else np.float32
    if codec == Codec.INT8_ZSTD:
        raw = decompress(payload, math.prod(shape))
        s = np.frombuffer(scales, dtype="<f2").astype(work)  # [rows]
        if not (np.isfinite(s) & (s >= 0)).all():
            raise CodecError("INT8_ZSTD scales must be finite and non-negative")
        q = np.frombuffer(raw, dtype=np.int8).reshape(rows_of(shape))  # [rows, D]
        return _as_dtype((q * s[:, None]).reshape(shape), dtype)
    return _as_dtype(_grouped_dequantise(payload, scales, shape, codec, work).reshape(shape), dtype)
