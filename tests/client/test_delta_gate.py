"""KV deltas from the server are checked against the session before a byte is decompressed.

A 65 KB delta declaring a 2 GiB tensor once took the client to 4.7 GB RSS, then a KeyError: 'lsa'. The gate
refuses it (and deltas with wrong names, shapes, dtypes, positions or tokens, or values that are not finite)
with the session's error, never calls zstd, allocates nothing of the declared size, and leaves the drafter as
it was. The numpy codec (the torch-free client's) parses headers first and is bounded the same way.
"""

import struct
import tracemalloc

import numpy as np
import pytest
import torch
import zstandard

from tether.client.delta_gate import DeltaGate, DeltaLayout, WireDelta, frames_problem
from tether.client.errors import Problem, ServerDataError
from tether.shared import codecs, wire_codecs
from tether.shared import wire as core
from tether.shared.codecs import Codec, EncodedTensor, encode_many
from tether.shared.config import PRESETS
from tether.shared.drafter import DrafterConfig

CFG = PRESETS["tiny"]  # dim 48, 2 KV heads of 12
DCFG = DrafterConfig(kind="moa", tli=1, n_heads=4, n_kv_heads=2, head_dim=12)
LAYOUT = DeltaLayout.for_config(CFG, DCFG)
PROMPT = [5, 6, 7]


class Refused(Exception):
    pass


class Recorder:
    """A drafter that records what it is handed."""

    def __init__(self):
        self.calls = []
        self.n = 0

    def begin(self, delta, capacity=None):
        self.calls.append(("begin", delta))
        self.n = delta.start + delta.n

    def commit(self, delta, keep_drafts=False):
        self.calls.append(("commit", delta))
        self.n = delta.start + delta.n
        return False

    def verified_length(self):
        return self.n

    def draft(self, root, k, **kwargs):
        return [root] * k, None, None


def gate(sequence=PROMPT, drafts=()):
    inner = Recorder()
    g = DeltaGate(
        inner,
        LAYOUT,
        coverable=lambda start: list(sequence[start:]) + list(drafts),
        refuse=lambda message: Refused(message),
    )
    return g, inner


def honest(n: int, dtype=torch.bfloat16) -> dict[str, torch.Tensor]:
    torch.manual_seed(n)
    return {name: torch.randn(shape).to(dtype) for name, shape in LAYOUT.shapes(n).items()}


def bundle(frames: dict[str, EncodedTensor]) -> bytes:
    """encode_many's format around frames built by hand (encode_many would need the tensor itself)."""
    parts = [struct.pack("<4sBI", b"TTBN", 1, len(frames))]
    for name, e in frames.items():
        frame = e.to_bytes()
        parts += [struct.pack("<H", len(name)), name.encode(), struct.pack("<I", len(frame)), frame]
    return b"".join(parts)


@pytest.fixture(scope="module")
def bomb() -> bytes:
    """About 65 KB of zstd that inflates to 2 GiB of zeros (streamed: the test never holds the 2 GiB)."""
    c = zstandard.ZstdCompressor(level=3, write_content_size=False).compressobj()
    zeros = bytes(1 << 20)
    return b"".join([c.compress(zeros) for _ in range(2048)] + [c.flush()])


def no_decompression(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("decompressed before the checks")

    monkeypatch.setattr(wire_codecs, "decompress", refuse)  # the one decoder, under both wrappers


@pytest.mark.parametrize("names", [{"x": (1 << 30,)}, {"lsa": (3, 1 << 29)}], ids=["unknown_name", "lsa_of_3GiB"])
def test_a_zstd_bomb_is_refused_before_decompression_and_allocates_nothing(bomb, monkeypatch, names):
    no_decompression(monkeypatch)
    frames = {name: EncodedTensor(Codec.FP16_SHUFFLE_ZSTD, "float16", shape, bomb) for name, shape in names.items()}
    wire = WireDelta(0, PROMPT, bundle(frames))
    g, inner = gate()
    tracemalloc.start()
    try:
        with pytest.raises(Refused):
            g.begin(wire)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20  # the payload is copied once (65 KB); nothing of the declared size
    assert inner.calls == []


def test_the_numpy_codec_parses_before_it_decompresses_and_is_bounded(bomb, monkeypatch):
    no_decompression(monkeypatch)
    rest = {k: codecs.encode(t, Codec.RAW) for k, t in honest(3).items() if k != "lsa"}
    wire = bundle({"lsa": EncodedTensor(Codec.FP16_SHUFFLE_ZSTD, "float16", (3, 1 << 28), bomb)} | rest)  # 1.5 GiB
    with pytest.raises(core.CodecError, match="bytes >"):
        core.decode_many(wire, max_nbytes=LAYOUT.max_bytes(3))
    frames = core.parse_many(wire)  # the default bound admits it, but only the headers are read
    assert "shape" in frames_problem({k: (f.dtype, f.shape) for k, f in frames.items()}, LAYOUT, 3)


def test_an_honest_delta_is_decoded_for_the_drafter():
    tensors = honest(3)
    g, inner = gate()
    g.begin(WireDelta(0, PROMPT, encode_many(tensors, Codec.FP16_SHUFFLE_ZSTD)))
    ((kind, delta),) = inner.calls
    assert kind == "begin" and delta.start == 0 and delta.tokens == PROMPT
    # Decoded torch-free: numpy arrays, bfloat16 widened exactly to float32.
    assert all(isinstance(delta.tensors[k], np.ndarray) for k in tensors)
    assert all(torch.equal(torch.from_numpy(delta.tensors[k]), tensors[k].float()) for k in tensors)


@pytest.mark.parametrize("codec", [Codec.INT4_HADAMARD, Codec.INT3_HADAMARD, Codec.INT2_HADAMARD])
def test_a_grouped_delta_is_decoded_and_a_lying_one_refused_before_decoding(codec, monkeypatch):
    tensors = honest(3)
    g, inner = gate()
    g.begin(WireDelta(0, PROMPT, encode_many(tensors, codec)))
    ((kind, delta),) = inner.calls
    for k, t in tensors.items():
        assert delta.tensors[k].shape == t.shape and np.isfinite(delta.tensors[k]).all()
        x = t.float().numpy()
        assert np.linalg.norm(delta.tensors[k] - x) / np.linalg.norm(x) < 0.6
    monkeypatch.setattr(core, "decode_payload", lambda *a: pytest.fail("decoded before the checks"))
    short = codecs.encode(tensors["lsa"][:, : CFG.dim // 2], codec)  # a frame true to itself, not to the layout
    rest = {k: codecs.encode(t, codec) for k, t in tensors.items() if k != "lsa"}
    g, inner = gate()
    with pytest.raises(Refused, match="shape"):
        g.begin(WireDelta(0, PROMPT, bundle({"lsa": short} | rest)))
    assert inner.calls == []


def test_a_round_delta_covers_at_most_the_root_and_the_drafts_sent():
    g, inner = gate(sequence=PROMPT + [9], drafts=[10, 11])  # root 9 at position 3, drafts 10, 11
    g.begin(WireDelta(0, PROMPT, encode_many(honest(3), Codec.RAW)))
    with pytest.raises(Refused, match="not the client's"):
        g.commit(WireDelta(3, [9, 10, 11, 12], encode_many(honest(4), Codec.RAW)))  # one position too many
    with pytest.raises(Refused, match="not the client's"):
        g.commit(WireDelta(3, [9, 99], encode_many(honest(2), Codec.RAW)))  # a token the client never sent
    with pytest.raises(Refused, match="starts at position 2"):
        g.commit(WireDelta(2, [7, 9], encode_many(honest(2), Codec.RAW)))
    with pytest.raises(Refused, match="not the client's"):
        g.commit(WireDelta(3, [], encode_many({}, Codec.RAW)))
    g.commit(WireDelta(3, [9, 10], encode_many(honest(2), Codec.RAW)))
    assert [c[0] for c in inner.calls] == ["begin", "commit"] and inner.n == 5


def bad_tensors() -> dict[str, dict[str, torch.Tensor]]:
    good = honest(3)
    return {
        "missing": {k: v for k, v in good.items() if k != "tli_v"},
        "renamed": {"hidden" if k == "lsa" else k: v for k, v in good.items()},
        "extra": good | {"more": torch.zeros(3, 4)},
        "positions": good | {"lsa": torch.zeros(4, CFG.dim)},
        "width": good | {"tli_k": torch.zeros(1, 3, 2, 13)},
        "layers": good | {"tli_k": torch.zeros(2, 3, 2, 12)},
        "dtype": good | {"lsa": torch.zeros(3, CFG.dim, dtype=torch.float64)},
        "integers": good | {"lsa": torch.zeros(3, CFG.dim, dtype=torch.int32)},
        "nan": good | {"lsa": torch.full((3, CFG.dim), float("nan"))},
        "inf": good | {"tli_v": torch.full((1, 3, 2, 12), float("inf"))},
    }


@pytest.mark.parametrize("case", list(bad_tensors()))
def test_wrong_names_shapes_dtypes_or_values_are_refused(case):
    g, inner = gate()
    with pytest.raises(Refused):
        g.begin(WireDelta(0, PROMPT, encode_many(bad_tensors()[case], Codec.RAW)))
    assert inner.calls == [] and not g.begun


def test_a_payload_that_is_no_bundle_is_refused():
    g, _ = gate()
    for payload in (b"", b"TTBN", b"\x00" * 64, encode_many(honest(3), Codec.RAW)[:-1]):
        with pytest.raises(Refused):
            g.begin(WireDelta(0, PROMPT, payload))


def test_eagle_takes_hidden_states_only():
    layout = DeltaLayout.for_config(CFG, DrafterConfig(kind="eagle"))
    assert layout.shapes(3) == {"hidden": (3, CFG.dim)}
    assert frames_problem({"hidden": ("bfloat16", (3, CFG.dim))}, layout, 3) is None
    assert frames_problem({"lsa": ("bfloat16", (3, CFG.dim))}, layout, 3) is not None


def test_a_root_outside_the_vocabulary_is_a_server_data_error():
    g, _ = gate()
    with pytest.raises(ServerDataError) as e:
        g.draft(CFG.vocab_size, 2)
    assert e.value.problem == Problem.TOKEN
    assert g.draft(1, 2)[0] == [1, 1]


def test_the_gate_passes_other_attributes_through():
    g, inner = gate()
    assert g.verified_length() == 0 and g.inner is inner
    assert np.isscalar(g.layout.max_bytes(1))


def test_the_gate_checks_and_decodes_without_torch():
    """The edge client's delta path imports no torch: the gate, the drafter config and the wire codecs."""
    import subprocess
    import sys

    blocked = 'import sys; sys.modules["torch"] = None\n'
    code = blocked + "import tether.client.delta_gate, tether.shared.drafter_config, tether.shared.wire"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
