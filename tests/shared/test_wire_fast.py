"""encode_bf16_bundle, the server's per-round fast path, writes exactly the bytes encode_many writes for the same
bfloat16 bits, and raises exactly what it raises: every codec and level, awkward shapes and strides."""

import numpy as np
import pytest

from tether.shared import wire
from tether.shared.wire import Codec, CodecError, decode_many, encode_bf16_bundle, encode_many

rng = np.random.default_rng(0)


def bits(*shape: int) -> np.ndarray:
    """Random uint16 bit patterns: every bf16 class (NaN payloads, Inf, -0.0, subnormals) shows up."""
    return rng.integers(0, 1 << 16, size=shape, dtype=np.uint16)


def general(arrays, codec, level=3) -> bytes:
    return encode_many({k: (a, "bfloat16") for k, a in arrays.items()}, codec, level=level)


def finite_bits(*shape: int) -> np.ndarray:
    """Random finite bf16 bits (INT8_ZSTD refuses NaN and Inf)."""
    return (np.asarray(rng.standard_normal(shape), np.float32).view(np.uint32) >> 16).astype(np.uint16)


def awkward() -> dict[str, np.ndarray]:
    big4 = bits(3, 64, 2, 32)  # [N, T, Hkv, D]: position axis 1
    big2 = bits(64, 192)  # [T, dim]: position axis 0
    return {
        "0-d": bits(),
        "empty": bits(0),
        "empty-2d": bits(0, 5),
        "empty-mid": bits(5, 0, 3),
        "one": bits(1),
        "1-d": bits(7),
        "4-d": bits(4, 3, 5, 6),
        "5-d": bits(2, 1, 3, 1, 4),
        "axis0": big2[5:6],  # [1, 192], a contiguous row
        "axis0-rows": big2[10:13],
        "axis0-step": big2[::7],
        "axis0-reversed": big2[::-1][:3],
        "axis1": big4[:, 5:6],  # [3, 1, 2, 32], strided
        "axis1-wide": big4[:, 7:10],
        "column": big2[:, 3],  # 1-D with a stride of 384 bytes
        "last-axis-step": big4[:, 0, :, ::3],
        "transposed": big2[:4, :6].T,
        "broadcast": np.broadcast_to(bits(1, 6), (4, 6)),  # stride 0
        "empty-slice": big4[:, 9:9],
        "taken": np.take(big4, [1, 4, 2], axis=1),
        "naïve ünïcode": bits(2, 3),
        # Past wire._SMALL elements the shuffle takes its other branch.
        "at the threshold": bits(4, wire._SMALL // 4),
        "past the threshold": bits(wire._SMALL + 1),
        "large axis0": big2[10:20],
        "large axis1": big4[:, 5:15],
        "large column": bits(2000, 3)[:, 1],
        "large transposed": big2[:, :40].T,
        "large broadcast": np.broadcast_to(bits(1, 1, 32), (3, 20, 32)),
    }


CASES = awkward()
LOSSLESS = (Codec.RAW, Codec.FP16_SHUFFLE_ZSTD)


@pytest.mark.parametrize("codec", list(Codec))
@pytest.mark.parametrize("name", list(CASES))
def test_each_awkward_array_encodes_to_the_same_bytes(codec, name):
    a = CASES[name]
    if codec not in LOSSLESS:
        a = np.broadcast_to(finite_bits(*a.shape[-1:]), a.shape) if a.shape else finite_bits()
    data = encode_bf16_bundle({name: a}, codec)
    assert data == general({name: a}, codec)
    got = decode_many(data)
    assert list(got) == [name]
    if codec in LOSSLESS:  # the bits come back
        assert got[name].shape == a.shape and got[name].tobytes() == wire.bf16_to_f32(a).tobytes()


@pytest.mark.parametrize("codec", list(Codec))
@pytest.mark.parametrize("level", [3, 1, -7, 19])
def test_a_whole_delta_at_every_level(codec, level):
    big2, big4k, big4v = finite_bits(64, 192), finite_bits(3, 64, 2, 32), finite_bits(3, 64, 2, 32)
    for at in (slice(5, 6), slice(0, 4), slice(63, 64), slice(9, 9)):
        delta = {"lsa": big2[at], "tli_k": big4k[:, at], "tli_v": big4v[:, at]}
        data = encode_bf16_bundle(delta, codec, level=level)
        assert data == general(delta, codec, level)
        got = decode_many(data)
        assert list(got) == list(delta) and all(got[k].shape == a.shape for k, a in delta.items())


@pytest.mark.parametrize("codec", [Codec.RAW, Codec.FP16_SHUFFLE_ZSTD])
def test_many_awkward_arrays_in_one_bundle(codec):
    assert encode_bf16_bundle(CASES, codec) == general(CASES, codec)
    assert encode_bf16_bundle({}, codec) == general({}, codec)
    got = decode_many(encode_bf16_bundle(CASES, codec))
    assert list(got) == list(CASES)
    assert all(got[k].tobytes() == wire.bf16_to_f32(a).tobytes() for k, a in CASES.items())


@pytest.mark.parametrize("codec", list(Codec))
def test_a_big_endian_host_takes_the_general_path(codec, monkeypatch):
    delta = {"lsa": finite_bits(2, 192)[1:], "tli_k": finite_bits(3, 4, 2, 32)[:, 2:3]}
    want = encode_bf16_bundle(delta, codec)
    monkeypatch.setattr(wire, "_FAST_HOST", False)
    assert encode_bf16_bundle(delta, codec) == want == general(delta, codec)


def outcome(encode, *args, **kwargs):
    try:
        return encode(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - the point is the same exception, whatever it is
        return type(e), str(e)


REFUSED = {
    "empty name": ({"": bits(3)}, Codec.FP16_SHUFFLE_ZSTD, 3),
    "long name": ({"x" * (wire.MAX_NAME_BYTES + 1): bits(3)}, Codec.RAW, 3),
    "longest name": ({"é" * (wire.MAX_NAME_BYTES // 2): bits(3)}, Codec.FP16_SHUFFLE_ZSTD, 3),
    "too many dims": ({"x": bits(*[1] * (wire.MAX_NDIM + 1))}, Codec.FP16_SHUFFLE_ZSTD, 3),
    "most dims": ({"x": bits(*[1] * wire.MAX_NDIM)}, Codec.RAW, 3),
    "int16": ({"x": bits(3).view(np.int16)}, Codec.RAW, 3),
    "float32": ({"x": np.zeros(3, np.float32)}, Codec.FP16_SHUFFLE_ZSTD, 3),
    "uint8": ({"x": np.zeros(3, np.uint8)}, Codec.RAW, 3),
    "uint32": ({"x": np.zeros(3, np.uint32)}, Codec.FP16_SHUFFLE_ZSTD, 3),
    "big-endian bits": ({"ok": bits(2), "x": bits(3).astype(">u2")}, Codec.FP16_SHUFFLE_ZSTD, 3),
    "a list": ({"x": [1, 2]}, Codec.RAW, 3),
    "a subclass": ({"x": bits(2, 2).view(np.recarray)}, Codec.FP16_SHUFFLE_ZSTD, 3),
    "dim of 2^32": ({"x": np.broadcast_to(bits(0, 1), (0, 1 << 32))}, Codec.FP16_SHUFFLE_ZSTD, 3),
    # 8 TiB of bits, in no memory: refused on its shape before anything copies them
    "raw huge": ({"x": np.broadcast_to(bits(1), (1 << 42,))}, Codec.RAW, 3),
    "level too high": ({"x": bits(3)}, Codec.FP16_SHUFFLE_ZSTD, 99),
    "level too low": ({"x": bits(3)}, Codec.FP16_SHUFFLE_ZSTD, -(1 << 17) - 1),
    "level a float": ({"x": bits(3)}, Codec.FP16_SHUFFLE_ZSTD, 3.0),
    "level a bool": ({"x": bits(3)}, Codec.FP16_SHUFFLE_ZSTD, True),
    "bad level, raw": ({"x": bits(3)}, Codec.RAW, 99),
    "bad level, nothing": ({}, Codec.FP16_SHUFFLE_ZSTD, 99),
    "unknown codec": ({"x": bits(3)}, 7, 3),
    "int codec": ({"x": bits(3)}, 1, 3),
    "int8 of NaN": ({"x": np.full(3, 0x7FC0, np.uint16)}, Codec.INT8_ZSTD, 3),
    "not a str": ({b"x": bits(3)}, Codec.RAW, 3),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_edge_input_gets_the_general_verdict(case):
    """What the fast path does not take, the general path answers: the same bytes or the same exception."""
    arrays, codec, level = REFUSED[case]
    want = outcome(general, arrays, codec, level)
    assert outcome(encode_bf16_bundle, arrays, codec, level=level) == want
    if case in ("empty name", "long name", "too many dims", "int16", "level too high", "dim of 2^32", "raw huge"):
        assert want[0] is CodecError


def test_the_fast_path_is_taken(monkeypatch):
    """The fast path must not quietly fall back for the server's delta (then it would be no faster)."""
    delta = {"lsa": bits(64, 192)[5:6], "tli_k": bits(3, 64, 2, 32)[:, 5:6], "long": bits(3, 64, 2, 32)[:, 5:15]}

    def refuse(*args, **kwargs):
        raise AssertionError("took the general path")

    monkeypatch.setattr(wire, "_encode_bf16_general", refuse)
    for codec in (Codec.RAW, Codec.FP16_SHUFFLE_ZSTD):
        assert encode_bf16_bundle(delta, codec) == general(delta, codec)
