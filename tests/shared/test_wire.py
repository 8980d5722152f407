"""The numpy core (tether.shared.wire) reads exactly what the torch wrapper (tether.shared.codecs) writes, and
writes what it reads: one implementation of the format, bit for bit, with and without torch."""

import math
import random

import numpy as np
import pytest
import torch

from tether.shared import codecs
from tether.shared import wire as core
from tether.shared.codecs import Codec, encode_many

FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
SHAPES = [(3, 7, 2, 12), (1,), (0, 5), ()]


def as_numpy(t: torch.Tensor) -> np.ndarray:
    """What core.decode_many returns for a torch tensor: the same dtype, bf16 widened to fp32."""
    return t.float().numpy() if t.dtype == torch.bfloat16 else t.numpy()


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def values(shape, dtype, finite: bool, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    t = (torch.randn(shape, generator=g, dtype=torch.float64) * 3).to(dtype)
    if not finite and t.numel() >= 5:
        flat = t.view(-1)
        flat[:5] = torch.tensor([math.nan, math.inf, -math.inf, -0.0, torch.finfo(dtype).max], dtype=dtype)
    return t


@pytest.mark.parametrize("codec", list(Codec))
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_floats_decode_bit_exactly_like_torch(codec, dtype, shape):
    t = values(shape, dtype, finite=codec not in (Codec.RAW, Codec.FP16_SHUFFLE_ZSTD))
    wire = encode_many({"x": t}, codec)
    got = core.decode_many(wire)["x"]
    assert same_bits(got, as_numpy(codecs.decode_many(wire)["x"]))


def test_fp32_sent_as_fp16_comes_back_fp32():
    t = values((4, 6), torch.float32, finite=False)
    wire = encode_many({"x": t}, Codec.FP16_SHUFFLE_ZSTD, fp32_as_fp16=False)
    assert same_bits(core.decode_many(wire)["x"], t.numpy())
    wire = encode_many({"x": values((4, 6), torch.float32, finite=True)}, Codec.FP16_SHUFFLE_ZSTD, fp32_as_fp16=True)
    got = core.decode_many(wire)["x"]
    assert got.dtype == np.float32 and same_bits(got, codecs.decode_many(wire)["x"].numpy())


@pytest.mark.parametrize("codec", [Codec.RAW, Codec.FP16_SHUFFLE_ZSTD])
def test_integers_and_bools(codec):
    g = torch.Generator().manual_seed(1)
    tensors = {
        str(dt): torch.randint(-100 if dt.is_signed else 0, 100, (5, 3), generator=g).to(dt)
        for dt in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)
    }
    tensors["bool"] = torch.rand(7, generator=g) > 0.5
    got = core.decode_many(encode_many(tensors, codec))
    assert list(got) == list(tensors)
    for name, t in tensors.items():
        assert same_bits(got[name], t.numpy()), name


def test_a_kv_delta_bundle():
    g = torch.Generator().manual_seed(2)
    delta = {
        "lsa": torch.randn(5, 48, generator=g).bfloat16(),
        "tli_k": torch.randn(2, 5, 2, 12, generator=g).bfloat16(),
        "tli_v": torch.randn(2, 5, 2, 12, generator=g).bfloat16(),
    }
    for codec in Codec:
        wire = encode_many(delta, codec)
        want = codecs.decode_many(wire)
        got = core.decode_many(wire)
        assert all(same_bits(got[k], as_numpy(want[k])) for k in delta)


def outcome(decode, data):
    try:
        out = decode(data)
    except codecs.CodecError:
        return "error"
    except core.CodecError:
        return "error"
    return {k: as_numpy(v) if isinstance(v, torch.Tensor) else v for k, v in out.items()}


def test_corrupt_bundles_get_the_same_verdict():
    """Every truncation and many single-byte changes: both decoders refuse, or both decode the same values."""
    g = torch.Generator().manual_seed(3)
    bundles = [
        encode_many({"a": torch.randn(2, 3, generator=g), "bb": torch.arange(4)}, Codec.RAW),
        encode_many({"k": torch.randn(3, 4, generator=g).half()}, Codec.FP16_SHUFFLE_ZSTD),
        encode_many({"v": torch.randn(2, 5, generator=g).bfloat16()}, Codec.INT8_ZSTD),
        encode_many({"q": torch.randn(3, 20, generator=g).bfloat16()}, Codec.INT3_HADAMARD),
        encode_many({"m": torch.tensor([True, False])}, Codec.RAW),
    ]
    rng = random.Random(0)
    cases = []
    for wire in bundles:
        cases += [wire[:n] for n in range(len(wire))] + [wire + b"\0"]
        for _ in range(150):
            i = rng.randrange(len(wire))
            cases.append(wire[:i] + bytes([rng.choice([0, 1, 2, 255, wire[i] ^ 1])]) + wire[i + 1 :])
    for data in cases:
        want, got = outcome(codecs.decode_many, data), outcome(core.decode_many, data)
        if want == "error" or got == "error":
            assert want == got, data
        else:
            assert list(got) == list(want) and all(same_bits(got[k], want[k]) for k in want), data


def test_size_limit_counts_the_original_dtype():
    wire = encode_many({"a": torch.zeros(10, dtype=torch.bfloat16), "b": torch.zeros(10)}, Codec.RAW)
    assert set(core.decode_many(wire, max_nbytes=60)) == {"a", "b"}  # 20 + 40 bytes
    with pytest.raises(core.CodecError, match="bytes >"):
        core.decode_many(wire, max_nbytes=59)


@pytest.mark.parametrize("codec", list(Codec))
def test_numpy_arrays_encode_to_the_same_bytes_as_tensors(codec):
    """The client writes with numpy what the server writes with torch: the same frames, byte for byte, bfloat16
    given as its bits."""
    g = torch.Generator().manual_seed(3)
    tensors = {"lsa": torch.randn(5, 48, generator=g).bfloat16(), "h": torch.randn(3, 8, generator=g),
               "f16": torch.randn(2, 6, generator=g).half()}  # fmt: skip
    arrays = {"lsa": (tensors["lsa"].view(torch.int16).numpy().view(np.uint16), "bfloat16"),
              "h": tensors["h"].numpy(), "f16": tensors["f16"].numpy()}  # fmt: skip
    assert core.encode_many(arrays, codec) == encode_many(tensors, codec)
    back = codecs.decode_many(core.encode_many(arrays, codec))
    assert back["lsa"].dtype == torch.bfloat16 and back["h"].dtype == torch.float32


def test_numpy_encoding_refuses_what_it_cannot_carry():
    with pytest.raises(core.CodecError, match="unsupported dtype"):
        core.encode_array(np.zeros(3, dtype=np.uint16), Codec.RAW)  # bits without saying they are bfloat16
    with pytest.raises(core.CodecError, match="cannot be given"):
        core.encode_array(np.zeros(3, dtype=np.float32), Codec.RAW, dtype="int32")
    with pytest.raises(core.CodecError, match="floating"):
        core.encode_array(np.arange(4, dtype=np.int32), Codec.INT8_ZSTD)


def test_the_core_imports_without_torch():
    import subprocess
    import sys

    code = 'import sys; sys.modules["torch"] = None\nimport tether.shared.wire as w\nprint(w.Codec.RAW.name)'
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "RAW"
