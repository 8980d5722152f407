"""Int8 storage with per-row scales (shared/int8_storage.py) and the checkpoints written and read with it."""

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tiny_models import tiny_target

from tether.server.cli import main as server_main
from tether.shared import checkpoint
from tether.shared.checkpoint import fingerprint, save_model, to_hf_name
from tether.shared.int8_storage import (
    SCALE_SUFFIX,
    StorageError,
    StorageFault,
    dequantize_rows,
    dequantize_state,
    quantize_rows,
    quantize_state,
)
from tether.shared.model import Transformer
from tether.shared.weights import client_part_tensors


def test_round_trip_within_half_a_step_per_row():
    torch.manual_seed(0)
    w = torch.randn(7, 33) * torch.logspace(-3, 2, 7)[:, None]  # rows of very different ranges
    q, scale = quantize_rows(w)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (7,)
    err = (dequantize_rows(q, scale, torch.float32) - w).abs()
    assert (err <= scale[:, None] / 2 * (1 + 1e-6)).all()
    assert q.abs().amax(dim=1).tolist() == [127] * 7  # each row's largest value uses the full range


def test_zero_row_is_exact_and_non_finite_is_refused():
    w = torch.randn(3, 5)
    w[1] = 0
    q, scale = quantize_rows(w)
    assert scale[1] == 0 and (dequantize_rows(q, scale, torch.float32)[1] == 0).all()
    for bad in (float("nan"), float("inf")):
        w[2, 3] = bad
        with pytest.raises(StorageError) as e:
            quantize_rows(w, "m.weight")
        assert e.value.reason is StorageFault.NOT_FINITE


def test_state_keeps_vectors_and_quantizes_matrices():
    state = {"a.weight": torch.randn(4, 6, dtype=torch.bfloat16), "n.weight": torch.randn(6, dtype=torch.bfloat16)}
    stored = quantize_state(state)
    assert set(stored) == {"a.weight", "a.weight" + SCALE_SUFFIX, "n.weight"}
    assert torch.equal(stored["n.weight"], state["n.weight"])
    back = dequantize_state(stored, torch.bfloat16)
    assert back["a.weight"].dtype == torch.bfloat16 and torch.equal(back["n.weight"], state["n.weight"])


@pytest.fixture
def int8_dir(tmp_path: Path) -> tuple[torch.nn.Module, Path]:
    model = tiny_target()
    out = tmp_path / "int8"
    save_model(model, out, dtype=torch.bfloat16, storage="int8", max_shard_mb=0.05)
    return model, out


def test_loaded_int8_is_the_dequantized_model(int8_dir):
    model, out = int8_dir
    loaded = Transformer.from_pretrained(out)
    stored = {}
    for f in out.glob("model-*.safetensors"):
        stored |= load_file(str(f))
    expected = dequantize_state(stored, torch.bfloat16)
    state = loaded.state_dict()
    for name, t in state.items():
        if name == "inv_freq":
            continue
        assert t.dtype == torch.bfloat16 and torch.equal(t, expected[to_hf_name(name)]), name
    # the client part the server streams is built from these dequantized weights
    part = client_part_tensors(loaded, None)
    assert torch.equal(part["target.model.embed_tokens.weight"], state["embed_tokens.weight"])
    # and it is close to the original
    for name, t in model.state_dict().items():
        if t.dim() == 2:
            step = t.abs().amax(dim=1, keepdim=True) / 127
            assert ((state[name].float() - t).abs() <= step / 2 + t.abs() / 128).all(), name
    assert fingerprint(out) == fingerprint(out) and len(fingerprint(out)) == 64


def test_shards_within_the_limit_and_the_index_complete(int8_dir):
    _, out = int8_dir
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(out.glob("model-*-of-*.safetensors"))
    assert len(files) > 1 and not (out / "model.safetensors").exists()
    assert all(f.stat().st_size <= 50_000 for f in files)
    names = set()
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            names |= set(sf.keys())
            assert all(index["weight_map"][n] == f.name for n in sf.keys())
    assert names == set(index["weight_map"])


class HeadersOnly:
    """safe_open that fails on reading a tensor: the checks must come from the headers."""

    def __init__(self, *args, **kwargs) -> None:
        self.inner = safe_open(*args, **kwargs)

    def __enter__(self):
        self.sf = self.inner.__enter__()
        return self

    def __exit__(self, *exc):
        return self.inner.__exit__(*exc)

    def metadata(self):
        return self.sf.metadata()

    def keys(self):
        return self.sf.keys()

    def get_slice(self, name):
        return self.sf.get_slice(name)

    def get_tensor(self, name):
        raise AssertionError("a tensor was read before the layout was checked")


def _rewrite(out: Path, change) -> None:
    """One shard's tensors changed by `change(tensors)`, the metadata kept."""
    for f in out.glob("model-*.safetensors"):
        with safe_open(str(f), framework="pt") as sf:
            meta = sf.metadata()
        tensors = load_file(str(f))
        if change(tensors):
            save_file(tensors, str(f), metadata=meta)
            return
    raise AssertionError("no shard changed")


def _drop_scale(t: dict) -> bool:
    names = [n for n in t if n.endswith(SCALE_SUFFIX)]
    return bool(names) and t.pop(names[0]) is not None


def _short_scale(t: dict) -> bool:
    names = [n for n in t if n.endswith(SCALE_SUFFIX)]
    return bool(names) and t.update({names[0]: t[names[0]][:-1].clone()}) is None


def _float_scale(t: dict) -> bool:
    names = [n for n in t if n.endswith(SCALE_SUFFIX)]
    return bool(names) and t.update({names[0]: t[names[0]].to(torch.bfloat16)}) is None


@pytest.mark.parametrize(
    ("change", "reason"),
    [(_drop_scale, StorageFault.MISSING_SCALE), (_short_scale, StorageFault.SCALE_SHAPE),
     (_float_scale, StorageFault.DTYPE)],
)  # fmt: skip
def test_malformed_file_refused_before_reading(int8_dir, monkeypatch, change, reason):
    _, out = int8_dir
    _rewrite(out, change)
    monkeypatch.setattr(checkpoint, "safe_open", HeadersOnly)
    with pytest.raises(StorageError) as e:
        Transformer.from_pretrained(out)
    assert e.value.reason is reason and "\n" not in str(e.value)


def test_quantize_command(tmp_path: Path, capsys):
    src = tmp_path / "src"
    save_model(tiny_target(), src, dtype=torch.bfloat16)
    (src / "tokenizer.json").write_text("{}")
    out = tmp_path / "out"
    assert server_main(["quantize", "--model", str(src), "--out", str(out), "--max-shard-mb", "0.05"]) == 0
    assert (out / "tokenizer.json").read_text() == "{}"
    assert (out / "model.safetensors.index.json").exists()
    q = Transformer.from_pretrained(out)
    assert set(q.state_dict()) == set(Transformer.from_pretrained(src).state_dict())
    assert server_main(["quantize", "--model", str(src), "--out", str(src)]) == 2
    assert "--out" in capsys.readouterr().err
