"""The grouped low-bit codecs (INT4/INT3/INT2_HADAMARD, tether.shared.wire_codecs): their error bound, their exact
sizes, a frozen encoding, and frames that lie about themselves refused before anything is decoded."""

import hashlib
import math

import numpy as np
import pytest

from tether.shared import wire
from tether.shared.wire import Codec, CodecError, EncodedTensor, decode_array, encode_array, encode_many, parse_many
from tether.shared.wire_codecs import GROUPED_BITS, group_size, rotation

GROUPED = list(GROUPED_BITS)


def gaussian(*shape, seed=0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("codec", GROUPED)
@pytest.mark.parametrize("d", [1, 2, 64, 128, 384])
def test_each_rotated_value_decodes_to_its_nearest_level(codec, d):
    """In the rotated domain every value comes back as the nearest of its group's 2^b levels (so within s / 2 of
    itself unless it lies past the outermost level); outlier channels as K has. (Rows of whole groups: of a padded
    group only the row's own values come back.)"""
    bits = GROUPED_BITS[codec]
    x = gaussian(7, d) * np.linspace(0.1, 30, d, dtype=np.float32)
    e = encode_array(x, codec)
    y = decode_array(e)
    assert y.shape == x.shape and y.dtype == np.float32
    g = group_size(d)
    groups = -(-d // g)
    r = rotation(g, "float64")
    z, back = (np.pad(a.astype(np.float64), ((0, 0), (0, groups * g - d))).reshape(-1, g) @ r for a in (x, y))
    s = np.frombuffer(e.scales, dtype="<f2").astype(np.float64)[:, None]  # [7 * groups, 1]
    half = 1 << (bits - 1)
    levels = (np.arange(2 * half) - half + 0.5) * s[:, :, None]  # [7 * groups, 1, 2^b]
    nearest = np.abs(z[:, :, None] - levels).min(axis=2)  # [7 * groups, g]
    tolerance = 1e-4 * s + 1e-6
    assert (np.abs(z - back) <= nearest + tolerance).all()
    inside = np.abs(z) <= half * s
    assert (np.abs(z - back) <= s / 2 + tolerance)[inside].all()


@pytest.mark.parametrize("codec", GROUPED)
@pytest.mark.parametrize("d", [3, 12, 65, 100])
def test_rows_of_any_length(codec, d):
    x = gaussian(9, d)
    y = decode_array(encode_array(x, codec))
    assert y.shape == x.shape and np.linalg.norm(x - y) / np.linalg.norm(x) < 0.45


@pytest.mark.parametrize(
    ("codec", "most"), [(Codec.INT4_HADAMARD, 0.115), (Codec.INT3_HADAMARD, 0.21), (Codec.INT2_HADAMARD, 0.38)]
)
def test_fewer_bits_cost_accuracy_in_order(codec, most):
    x = gaussian(64, 128)
    y = decode_array(encode_array(x, codec))
    assert np.linalg.norm(x - y) / np.linalg.norm(x) < most


@pytest.mark.parametrize("codec", GROUPED)
def test_sizes_are_exact(codec):
    bits = GROUPED_BITS[codec]
    e = encode_array(gaussian(3, 5, 2, 64), codec)  # 30 rows of one group each
    assert len(e.payload) == 30 * 64 * bits // 8 and len(e.scales) == 30 * 2 and e.wire_dtype == "uint8"
    e = encode_array(gaussian(2, 3), codec)  # groups of 4, symbols padded to whole chunks
    chunk, nbytes = {4: (2, 1), 3: (8, 3), 2: (4, 1)}[bits]
    assert len(e.payload) == -(-8 // chunk) * nbytes and len(e.scales) == 4


@pytest.mark.parametrize("codec", GROUPED)
def test_bfloat16_float16_float64_and_zeros(codec):
    x = gaussian(4, 64)
    bits = wire.f32_to_bf16(x)
    y = wire.values(encode_array(bits, codec, dtype="bfloat16"))
    assert np.linalg.norm(x - y) / np.linalg.norm(x) < 0.55
    assert decode_array(encode_array(x.astype(np.float16), codec)).dtype == np.float16
    assert decode_array(encode_array(x.astype(np.float64), codec)).dtype == np.float64
    z = np.zeros((3, 64), dtype=np.float32)
    assert not decode_array(encode_array(z, codec)).any()
    assert decode_array(encode_array(np.zeros((0, 64), dtype=np.float32), codec)).shape == (0, 64)


def test_the_encoding_is_frozen():
    """The rotation's signs and the packing are the format: these bytes must never change. Quarters in [-0.5, 0.5]
    keep every sum exact (the rotation's and the squares' for the clip) whatever order a BLAS adds them in."""
    x = ((np.arange(2 * 96, dtype=np.float32).reshape(2, 96) * 7) % 5 - 2) * np.float32(0.25)
    digest = hashlib.sha256(b"".join(encode_array(x, c).to_bytes() for c in GROUPED)).hexdigest()
    assert digest == FROZEN
    r = rotation(8, "float64")
    assert np.allclose(r @ r.T, np.eye(8)) and np.allclose(np.abs(r), 1 / math.sqrt(8))


FROZEN = "ab833be45f8fcc0e34f35e9806bfb844da51e746e4048c5617ee6bb5bcff7b4c"


@pytest.mark.parametrize("codec", GROUPED)
def test_refuses_what_it_cannot_carry(codec):
    with pytest.raises(CodecError, match="finite"):
        encode_array(np.array([1.0, np.nan], dtype=np.float32), codec)
    with pytest.raises(CodecError, match="floating"):
        encode_array(np.arange(4, dtype=np.int32), codec)
    with pytest.raises(CodecError, match="fp16 scale range"):
        encode_array(np.array([1e9], dtype=np.float32), codec)


def frame(codec, shape=(2, 64)) -> EncodedTensor:
    return encode_array(gaussian(*shape), codec)


LIES = {
    "payload one byte short": lambda e: dict(payload=e.payload[:-1]),
    "payload one byte long": lambda e: dict(payload=e.payload + b"\0"),
    "a scale missing": lambda e: dict(scales=e.scales[:-2]),
    "a shape that needs more": lambda e: dict(shape=(3, 64)),
    "a shape that needs less": lambda e: dict(shape=(2, 32)),
    "int8 in the payload": lambda e: dict(wire_dtype="int8"),
    "an integer tensor": lambda e: dict(dtype="int32"),
}


@pytest.mark.parametrize("codec", GROUPED)
@pytest.mark.parametrize("lie", list(LIES))
def test_hostile_frames_are_refused_before_decoding(codec, lie):
    good = frame(codec)
    fields = dict(codec=codec, dtype=good.dtype, shape=good.shape, payload=good.payload, scales=good.scales)
    fields |= dict(wire_dtype=good.wire_dtype) | LIES[lie](good)
    with pytest.raises(CodecError):
        EncodedTensor(**fields)
    parts = (fields["dtype"], fields["wire_dtype"], fields["shape"], fields["payload"], fields["scales"])
    with pytest.raises(CodecError):
        EncodedTensor.from_bytes(wire._pack_frame(codec, *parts))


@pytest.mark.parametrize("codec", GROUPED)
@pytest.mark.parametrize("scale", [np.nan, np.inf, -1.0])
def test_bad_scales_are_refused(codec, scale):
    good = frame(codec)
    s = np.frombuffer(good.scales, dtype="<f2").copy()
    s[1] = scale
    bad = EncodedTensor(codec, good.dtype, good.shape, good.payload, s.tobytes(), wire_dtype="uint8")
    with pytest.raises(CodecError, match="scales"):
        decode_array(bad)


@pytest.mark.parametrize("codec", GROUPED)
def test_a_huge_declared_shape_is_refused_by_the_budget(codec):
    """A frame may not claim a tensor past max_nbytes; its payload would have to be that size anyway."""
    data = encode_many({"k": gaussian(4, 64)}, codec)
    with pytest.raises(CodecError, match="bytes >"):
        parse_many(data, max_nbytes=4 * 64 * 4 - 1)
    assert parse_many(data, max_nbytes=4 * 64 * 4)["k"].codec == codec


@pytest.mark.parametrize("codec", GROUPED)
def test_any_payload_of_the_right_size_decodes_to_finite_values(codec):
    """The symbols are a dense code: every bit pattern is some value within the group's scale."""
    good = frame(codec)
    rng = np.random.default_rng(5)
    noise = rng.integers(0, 256, len(good.payload), dtype=np.uint8).tobytes()
    y = decode_array(EncodedTensor(codec, "float32", good.shape, noise, good.scales, wire_dtype="uint8"))
    assert np.isfinite(y).all() and y.shape == good.shape
