"""Wire codecs: bit-exact lossless round trips, the INT8 error bound, framing, and every malformed input."""

import math
import struct
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import zstandard

from tether.shared.codecs import (
    Codec,
    CodecError,
    EncodedTensor,
    compression_ratio,
    decode,
    decode_many,
    encode,
    encode_many,
)

LOSSLESS = (Codec.RAW, Codec.FP16_SHUFFLE_ZSTD)
FLOATS = (torch.float16, torch.bfloat16, torch.float32)
SHAPES = [(3, 7, 2, 12), (1,), (0, 5), (5, 0), ()]
DTYPE_IDS = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3, torch.int8: 6}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def awkward(shape, dtype, seed=0) -> torch.Tensor:
    """Random values with NaN, +-Inf, -0.0 and the dtype's extremes sprinkled in."""
    g = torch.Generator().manual_seed(seed)
    t = (torch.randn(shape, generator=g) * 3).to(dtype)
    flat = t.view(-1)
    info = torch.finfo(dtype)
    specials = [math.nan, math.inf, -math.inf, -0.0, 0.0, info.max, -info.max, info.tiny, info.smallest_normal / 4]
    for i, v in enumerate(specials[: flat.numel()]):
        flat[(i * 7) % flat.numel()] = v
    return t


def header(codec, dtype_id, wire_id, shape, payload, scales=b"", magic=b"TTEN", version=1) -> bytes:
    """A frame built straight from the documented layout, independent of the module."""
    head = struct.pack("<4sBBBBB", magic, version, codec, dtype_id, wire_id, len(shape))
    dims = b"".join(struct.pack("<I", d) for d in shape)
    return head + dims + struct.pack("<II", len(payload), len(scales)) + payload + scales


@pytest.mark.parametrize("codec", LOSSLESS)
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape", SHAPES)
def test_lossless_round_trip_is_bit_exact(codec, dtype, shape):
    t = awkward(shape, dtype)
    e = EncodedTensor.from_bytes(encode(t, codec).to_bytes())
    out = decode(e)
    assert out.dtype == dtype and out.shape == t.shape
    assert torch.equal(bits(out), bits(t))
    assert e.raw_nbytes == t.numel() * t.element_size()
    assert e.nbytes == len(e.to_bytes())


def test_fp32_stays_32_bit_unless_allowed():
    t = awkward((4, 33), torch.float32)
    kept = encode(t, Codec.FP16_SHUFFLE_ZSTD)
    assert kept.wire_dtype == "float32" and torch.equal(bits(decode(kept)), bits(t))
    x = torch.randn(4, 33)
    halved = EncodedTensor.from_bytes(encode(x, Codec.FP16_SHUFFLE_ZSTD, fp32_as_fp16=True).to_bytes())
    assert halved.wire_dtype == "float16" and halved.dtype == "float32"
    out = decode(halved)
    assert out.dtype == torch.float32 and torch.equal(out, x.half().float())
    with pytest.raises(CodecError, match="overflows fp16"):
        encode(torch.tensor([1.0, 7e4]), Codec.FP16_SHUFFLE_ZSTD, fp32_as_fp16=True)


def test_other_dtypes_round_trip():
    for t in (torch.arange(-50, 50, dtype=torch.int64), torch.tensor([True, False, True]), torch.randn(9).double()):
        for codec in LOSSLESS:
            assert torch.equal(decode(EncodedTensor.from_bytes(encode(t, codec).to_bytes())), t)


def test_noncontiguous_input():
    t = torch.randn(6, 8).bfloat16().t()[1:]  # [7, 6] strided view
    assert torch.equal(decode(encode(t, Codec.FP16_SHUFFLE_ZSTD)), t)


@pytest.mark.parametrize("dtype", FLOATS)
def test_int8_error_bound(dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(40, 3, 96, generator=g)
    x[::7, :, 5] *= 300  # outliers: their rows get coarse scales, the others stay fine
    x[3, 1] = 0  # an all-zero row
    x[4, 2] = torch.randn(96, generator=g) * 1e-7  # tiny row: its scale is an fp16 subnormal
    x = x.to(dtype)
    e = EncodedTensor.from_bytes(encode(x, Codec.INT8_ZSTD).to_bytes())
    out = decode(e)
    assert out.dtype == dtype and out.shape == x.shape
    xf, of = x.float(), out.float()
    scale = xf.abs().amax(-1, keepdim=True) / 127  # [40, 3, 1]
    # Rounding the scale up to an fp16 costs at most 2^-10 relative (2^-25 absolute below fp16's normal
    # range); the cast back to a 16-bit dtype adds half an ulp of the output.
    out_ulp = 0.0 if dtype == torch.float32 else torch.finfo(dtype).eps / 2
    bound = scale / 2 * (1 + 2**-10) + 2**-25 + of.abs() * out_ulp
    assert ((of - xf).abs() <= bound).all()
    assert torch.equal(out[3, 1], torch.zeros(96, dtype=dtype))
    assert (of - xf).abs()[4, 2].max() < 1e-7


def test_int8_edge_shapes_and_refusals():
    for shape in SHAPES:
        t = torch.randn(shape)
        out = decode(EncodedTensor.from_bytes(encode(t, Codec.INT8_ZSTD).to_bytes()))
        atol = t.abs().max().item() / 254 + 1e-6 if t.numel() else 0.0
        assert out.shape == t.shape and torch.allclose(out, t, atol=atol)
    with pytest.raises(CodecError, match="finite"):
        encode(torch.tensor([1.0, math.nan]), Codec.INT8_ZSTD)
    with pytest.raises(CodecError, match="fp16 scale range"):
        encode(torch.tensor([1e8]), Codec.INT8_ZSTD)
    with pytest.raises(CodecError, match="floating"):
        encode(torch.arange(4), Codec.INT8_ZSTD)


def test_bundle_round_trip():
    g = torch.Generator().manual_seed(2)
    delta = {
        "lsa": torch.randn(4, 192, generator=g).bfloat16(),  # [n, dim]
        "tli_k": torch.randn(1, 4, 2, 32, generator=g).bfloat16(),  # [N, n, Hkv, D]
        "tli_v": torch.randn(1, 4, 2, 32, generator=g).bfloat16(),
        "tokens": torch.tensor([5, 6, 7, 8]),
        "empty": torch.empty(0, 3),
    }
    out = decode_many(encode_many(delta, Codec.FP16_SHUFFLE_ZSTD))
    assert list(out) == list(delta)
    assert all(torch.equal(bits(out[k]), bits(v)) for k, v in delta.items())
    lossy = decode_many(encode_many({k: v for k, v in delta.items() if v.is_floating_point()}, Codec.INT8_ZSTD))
    assert all(lossy[k].dtype == v.dtype and lossy[k].shape == v.shape for k, v in lossy.items())
    assert decode_many(encode_many({}, Codec.RAW)) == {}


def test_encoding_and_decoding_from_many_threads():
    g = torch.Generator().manual_seed(5)
    jobs = [(torch.randn(64, 2, 32, generator=g).bfloat16() * i, Codec(i % 3)) for i in range(16)]
    frames = [encode(t, c).to_bytes() for t, c in jobs]
    expected = [decode(EncodedTensor.from_bytes(f)) for f in frames]
    with ThreadPoolExecutor(8) as pool:
        threaded_frames = list(pool.map(lambda job: encode(*job).to_bytes(), jobs * 4))
        outs = list(pool.map(lambda f: decode(EncodedTensor.from_bytes(f)), frames * 4))
    assert threaded_frames == frames * 4  # zstd is deterministic, so any cross-thread mix-up shows
    assert all(torch.equal(bits(out), bits(want)) for out, want in zip(outs, expected * 4, strict=True))


# ---- malformed input ------------------------------------------------------------------------------------


def good_frame(codec=Codec.FP16_SHUFFLE_ZSTD) -> bytes:
    # Seeded: the frames become test ids, which must be the same in every process (pytest-xdist compares them).
    return encode(torch.randn(3, 5, generator=torch.Generator().manual_seed(0)).half(), codec).to_bytes()


def patched(data: bytes, offset: int, value: int) -> bytes:
    return data[:offset] + bytes([value]) + data[offset + 1 :]


@pytest.mark.parametrize(
    "data, message",
    [
        (b"NOPE" + good_frame()[4:], "bad magic"),
        (good_frame()[:6], "truncated header"),
        (good_frame()[:20], "truncated header"),  # cut inside the shape
        (good_frame()[:-1], "truncated frame"),
        (good_frame() + b"\0", "oversize frame"),
        (patched(good_frame(), 4, 9), "format version"),
        (patched(good_frame(), 5, 7), "unknown codec"),
        (patched(good_frame(), 6, 200), "unknown dtype"),
        (patched(good_frame(), 7, 0), "unknown wire dtype"),
        (patched(good_frame(), 7, 3), "cannot carry"),  # fp16 tensor claiming a bf16 payload
        (patched(good_frame(), 8, 17), "ndim"),
        (patched(good_frame(Codec.RAW), 9, 4), "RAW payload"),  # shape [4, 5] against [3, 5] bytes
        (patched(good_frame(Codec.INT8_ZSTD), 9, 4), "scales"),  # 4 rows declared, 3 scales sent
        (header(Codec.FP16_SHUFFLE_ZSTD, 2, 2, (1 << 20, 1 << 20), b""), "bytes >"),  # over max_nbytes
        (header(Codec.INT8_ZSTD, 6, 6, (4,), b""), "cannot carry"),  # INT8 of an integer tensor
    ],
)
def test_malformed_frames_are_refused(data, message):
    with pytest.raises(CodecError, match=message):
        EncodedTensor.from_bytes(data)


@pytest.mark.parametrize("codec", [Codec.FP16_SHUFFLE_ZSTD, Codec.INT8_ZSTD])
@pytest.mark.parametrize("rows", [2, 4])
def test_shape_that_disagrees_with_the_payload(codec, rows):
    e = encode(torch.randn(3, 5).half(), codec)
    scales, wire = (bytes(2 * rows), 6) if codec == Codec.INT8_ZSTD else (b"", 2)
    bad = EncodedTensor.from_bytes(header(codec, 2, wire, (rows, 5), e.payload, scales))
    with pytest.raises(CodecError, match="implies"):
        decode(bad)


@pytest.mark.parametrize("content_size", [True, False])
def test_zstd_bomb_is_refused(content_size):
    # 64 MiB of zeros squeezed into a few KB, declared as an 8-byte tensor: with or without the size in
    # the zstd frame header, decode must stop at the 8 bytes the shape allows.
    cctx = zstandard.ZstdCompressor(level=3, write_content_size=content_size)
    bomb = cctx.compress(bytes(64 << 20))
    assert len(bomb) < 1 << 16
    e = EncodedTensor.from_bytes(header(Codec.FP16_SHUFFLE_ZSTD, 2, 2, (4,), bomb))
    with pytest.raises(CodecError, match="implies 8"):
        decode(e)


def test_corrupt_or_concatenated_zstd_payload():
    e = encode(torch.randn(64, 32).half(), Codec.FP16_SHUFFLE_ZSTD)
    mid = len(e.payload) // 2
    flipped = e.payload[:mid] + bytes([e.payload[mid] ^ 0xFF]) + e.payload[mid + 1 :]
    for payload in (flipped, e.payload[:-3], e.payload + e.payload, b"not zstd at all"):
        with pytest.raises(CodecError):
            decode(EncodedTensor(Codec.FP16_SHUFFLE_ZSTD, "float16", (64, 32), payload))


def test_hand_built_encoded_tensors_are_checked():
    with pytest.raises(CodecError, match="bad shape"):
        EncodedTensor(Codec.FP16_SHUFFLE_ZSTD, "float16", (1 << 32, 0), b"")
    with pytest.raises(CodecError, match="unknown codec"):
        EncodedTensor(7, "float16", (1,), b"")
    with pytest.raises(CodecError, match="unsupported dtype"):
        EncodedTensor(Codec.RAW, "complex64", (1,), b"")
    with pytest.raises(CodecError, match="level"):
        encode(torch.ones(2), Codec.FP16_SHUFFLE_ZSTD, level=99)


def test_bad_scales_and_bools():
    e = encode(torch.randn(2, 4), Codec.INT8_ZSTD)
    nan_scales = struct.pack("<2e", 1.0, math.nan)
    with pytest.raises(CodecError, match="scales"):
        decode(EncodedTensor(Codec.INT8_ZSTD, "float32", (2, 4), e.payload, nan_scales, "int8"))
    with pytest.raises(CodecError, match="bool"):
        decode(EncodedTensor.from_bytes(header(Codec.RAW, 10, 10, (2,), b"\x01\x02")))


def test_malformed_bundles_are_refused():
    good = encode_many({"a": torch.ones(3), "b": torch.zeros(2)}, Codec.FP16_SHUFFLE_ZSTD)
    frame = encode(torch.ones(2), Codec.RAW).to_bytes()
    entry = struct.pack("<H", 1) + b"a" + struct.pack("<I", len(frame)) + frame
    cases = [
        (b"XXXX" + good[4:], "bad magic"),
        (good[:5], "truncated bundle header"),
        (good[:-1], "truncated"),
        (good + b"\0", "trailing"),
        (patched(good, 4, 2), "version"),
        (struct.pack("<4sBI", b"TTBN", 1, 2) + entry + entry, "duplicate"),
        (struct.pack("<4sBI", b"TTBN", 1, 5) + entry, "missing"),
        (struct.pack("<4sBI", b"TTBN", 1, 1) + struct.pack("<H", 2) + b"\xff\xfe" + entry[3:], "utf-8"),
        (struct.pack("<4sBI", b"TTBN", 1, 1) + struct.pack("<H", 0) + entry[3:], "name"),
    ]
    for data, message in cases:
        with pytest.raises(CodecError, match=message):
            decode_many(data)
    with pytest.raises(CodecError, match="bytes >"):  # the budget covers the bundle, not each tensor
        decode_many(encode_many({"a": torch.ones(100), "b": torch.ones(100)}, Codec.RAW), max_nbytes=600)


# ---- what each codec buys -------------------------------------------------------------------------------


def plain_zstd_size(t: torch.Tensor) -> int:
    return len(zstandard.ZstdCompressor(level=3).compress(bits(t).numpy().tobytes()))


def test_shuffle_beats_plain_zstd_on_smooth_data():
    # Slowly varying values share their sign, exponent and top mantissa bits with their neighbours while
    # the low mantissa bits change every element. Interleaved, each repetitive high byte sits next to a
    # changing low byte, so zstd finds few long matches; as byte planes the high plane becomes long runs.
    pos = torch.arange(16384, dtype=torch.float32)
    smooth = (torch.sin(pos / 500) * 4).bfloat16()
    assert len(encode(smooth, Codec.FP16_SHUFFLE_ZSTD).payload) < 0.6 * plain_zstd_size(smooth)
    g = torch.Generator().manual_seed(3)
    ramp = torch.linspace(1, 2, 16384) + torch.randn(16384, generator=g) * 1e-3  # fp32: 4 planes
    assert len(encode(ramp, Codec.FP16_SHUFFLE_ZSTD).payload) < 0.75 * plain_zstd_size(ramp)
    assert compression_ratio(smooth, Codec.FP16_SHUFFLE_ZSTD) > smooth.numel() * 2 / plain_zstd_size(smooth)


def test_int8_beats_fp16_on_random_normal_data():
    x = torch.randn(512, 128, generator=torch.Generator().manual_seed(4)).half()
    ratio = compression_ratio(x, Codec.INT8_ZSTD) / compression_ratio(x, Codec.FP16_SHUFFLE_ZSTD)
    assert ratio > 1.8, ratio
    assert compression_ratio(x, Codec.RAW) < 1  # the frame header is pure overhead
