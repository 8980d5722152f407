"""Checkpoints in the Hugging Face layout: config.json + model.safetensors (+ tokenizer.json beside them).

Contract:
- `save_model(model, dir)` writes tensors under Hugging Face Llama names (model.layers.N.self_attn.q_proj...),
  so a plain (moda off, pre-norm) checkpoint of ours loads in transformers' LlamaForCausalLM unchanged.
  A MoDA checkpoint says `"model_type": "tether_moda"` and carries our extra fields; it loads only here.
- `read_config(dir)` and `load_weights(model, dir)` read ours, and Llama-, Mistral- and Qwen2-style checkpoints
  written by transformers (single or sharded safetensors): the model is built from the config on the meta device
  and given the stored tensors (Transformer.from_pretrained does both: this module never imports the model, which
  imports it). Unsupported features (sliding windows, MLP bias, other RoPE scalings) are refused with a clear
  error rather than loaded wrong.
- `save_model(..., storage="int8", max_shard_mb=10)`: int8 rows (shared/int8_storage.py), in shards of at most
  10 MB named by model.safetensors.index.json; `load_weights` recognises the format from the safetensors metadata,
  checks names, dtypes and shapes from the headers before reading a tensor, and dequantizes. `convert_checkpoint`
  rewrites a loaded checkpoint so (`tether-server quantize`).
- `fingerprint(dir)`: sha256 over config.json and every stored tensor (int8 and scales as stored), the identity
  clients pair against.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tether.shared.config import ModelConfig
from tether.shared.int8_storage import (
    DTYPE_KEY,
    HEADER_DTYPES,
    INT8_ROWS,
    SCALE_SUFFIX,
    STORAGE_KEY,
    StorageError,
    StorageFault,
    check_layout,
    dequantize_state,
    quantize_state,
    stored_shapes,
)

MODEL_TYPE = "tether_moda"
STORAGES = ("plain", "int8")  # how save_model stores the weights
INDEX = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")
_HEADER_BYTES = 4096  # a shard's header budget beyond its tensors' entries (the metadata, the JSON framing)
_HEADER_BYTES_PER_TENSOR = 128  # a tensor's header entry beyond its name: dtype, shape, offsets
HF_PLAIN_TYPES = ("llama", "mistral", "qwen2")

# Our parameter names <-> Hugging Face's ({i} is a layer index). Post-norm blocks reuse the two norm slots.
_NAMES = [
    ("embed_tokens.", "model.embed_tokens."),
    ("embed_norm.", "model.embed_norm."),
    ("layers.{i}.attn.", "model.layers.{i}.self_attn."),
    ("layers.{i}.ffn.", "model.layers.{i}.mlp."),
    ("layers.{i}.attn_norm.", "model.layers.{i}.input_layernorm."),
    ("layers.{i}.ffn_norm.", "model.layers.{i}.post_attention_layernorm."),
    ("layers.{i}.ffn_kv_proj.", "model.layers.{i}.ffn_kv_proj."),
    ("norm.", "model.norm."),
    ("lm_head.", "lm_head."),
]


def _rename(name: str, forward: bool) -> str:
    for ours, theirs in _NAMES:
        src, dst = (ours, theirs) if forward else (theirs, ours)
        pattern = "^" + re.escape(src).replace(r"\{i\}", r"(\d+)")
        new, n = re.subn(pattern, dst.replace("{i}", r"\1"), name)
        if n:
            return new
    raise KeyError(f"unknown tensor name {name!r}")


def to_hf_name(name: str) -> str:
    return _rename(name, forward=True)


def from_hf_name(name: str) -> str:
    return _rename(name, forward=False)


def _rope_settings(hf: dict) -> tuple[float, tuple | None]:
    params = hf.get("rope_parameters") or {}
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    scaling = hf.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
    if scaling:
        scaling = {k: v for k, v in scaling.items() if k != "rope_theta"}
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind not in ("default", "llama3"):
            raise ValueError(f"RoPE scaling {kind!r} is not supported (supported: default, llama3)")
        return theta, tuple(sorted(scaling.items()))
    return theta, None


def config_from_hf(hf: dict) -> ModelConfig:
    """Map a config.json (ours or a Hugging Face Llama/Mistral/Qwen2 one) to a ModelConfig."""
    kind = hf.get("model_type")
    if kind == MODEL_TYPE:
        return ModelConfig.from_dict(hf["tether"])
    if kind not in HF_PLAIN_TYPES:
        raise ValueError(f"model_type {kind!r} is not supported (supported: {MODEL_TYPE}, {', '.join(HF_PLAIN_TYPES)})")
    if hf.get("mlp_bias"):
        raise ValueError("checkpoints with mlp_bias=True are not supported")
    if hf.get("use_sliding_window") or (kind == "mistral" and hf.get("sliding_window")):
        raise ValueError("sliding-window attention is not supported")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"activation {hf.get('hidden_act')!r} is not supported (SwiGLU with silu only)")
    theta, scaling = _rope_settings(hf)
    heads = hf["num_attention_heads"]
    bias = bool(hf.get("attention_bias", False))
    return ModelConfig(
        vocab_size=hf["vocab_size"],
        dim=hf["hidden_size"],
        n_layers=hf["num_hidden_layers"],
        n_heads=heads,
        n_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        ffn_dim=hf["intermediate_size"],
        norm_position="pre",
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        moda=False,
        moda_ffn_kv=False,
        tied_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=bias or kind == "qwen2",
        o_bias=bias and kind != "qwen2",
        max_seq_len=hf.get("max_position_embeddings", 2048),
    )


def config_to_hf(cfg: ModelConfig) -> dict:
    """config.json content: Llama-compatible keys always; our own block for everything Llama lacks."""
    plain_llama = not cfg.moda and cfg.norm_position == "pre" and cfg.qkv_bias == cfg.o_bias
    out = {
        "architectures": ["LlamaForCausalLM"] if plain_llama else ["TetherMoDAForCausalLM"],
        "model_type": "llama" if plain_llama else MODEL_TYPE,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.ffn_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": dict(cfg.rope_scaling) if cfg.rope_scaling else None,
        "tie_word_embeddings": cfg.tied_embeddings,
        "attention_bias": cfg.qkv_bias,
        "max_position_embeddings": cfg.max_seq_len,
        "tether": cfg.to_dict(),
    }
    return out


def save_model(
    model: torch.nn.Module,
    path: str | Path,
    *,
    dtype: torch.dtype | None = None,
    storage: str = "plain",
    max_shard_mb: float | None = None,
) -> None:
    """config.json + the weights: `storage` "plain" (as they are, or cast to `dtype`) or "int8" (int8 rows,
    shared/int8_storage.py); in one model.safetensors, or with `max_shard_mb` in files of at most that many MB
    (10**6 bytes) named by model.safetensors.index.json. Weight files already in `path` are replaced."""
    if storage not in STORAGES:
        raise ValueError(f"unknown storage {storage!r} (one of {', '.join(STORAGES)})")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, t in model.state_dict().items():
        t = t.detach().to("cpu")
        tensors[to_hf_name(name)] = (t.to(dtype) if dtype is not None and t.is_floating_point() else t).contiguous()
    metadata = {"format": "pt"}
    if storage == "int8":
        source = dtype or next(t.dtype for t in tensors.values() if t.is_floating_point())
        metadata |= {STORAGE_KEY: INT8_ROWS, DTYPE_KEY: str(source).removeprefix("torch.")}
        tensors = quantize_state(tensors)
    for stale in [path / "model.safetensors", path / INDEX, *path.glob("model-*-of-*.safetensors")]:
        stale.unlink(missing_ok=True)
    if max_shard_mb is None:
        save_file(tensors, str(path / "model.safetensors"), metadata=metadata)
    else:
        _save_shards(tensors, path, metadata, int(max_shard_mb * 1e6))
    (path / "config.json").write_text(json.dumps(config_to_hf(model.cfg), indent=2, sort_keys=True) + "\n")


def _save_shards(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str], max_bytes: int) -> None:
    """The Hugging Face sharded layout; each file's header is budgeted so the whole file stays within max_bytes."""
    groups: list[list[str]] = [[]]
    used = 0
    for name, t in tensors.items():
        size = t.numel() * t.element_size() + len(name) + _HEADER_BYTES_PER_TENSOR
        if size + _HEADER_BYTES > max_bytes:
            raise ValueError(f"{name} ({size} bytes) does not fit in a shard of {max_bytes} bytes")
        if groups[-1] and used + size + _HEADER_BYTES > max_bytes:
            groups.append([])
            used = 0
        groups[-1].append(name)
        used += size
    weight_map = {}
    for i, names in enumerate(groups, 1):
        file = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        save_file({n: tensors[n] for n in names}, str(path / file), metadata=metadata)
        weight_map |= dict.fromkeys(names, file)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total, **metadata}, "weight_map": weight_map}
    (path / INDEX).write_text(json.dumps(index, indent=2) + "\n")


@dataclass(frozen=True)
class ConvertConfig:
    model: str = ""  # the checkpoint directory to read (any storage load_weights reads)
    out: str = ""  # the directory to write (config.json, weights, tokenizer files)
    storage: str = "int8"  # plain: the weights as they are; int8: int8 with one fp32 scale per output row
    max_shard_mb: float = 10.0  # the largest weight file, in MB (10**6 bytes); 0: one model.safetensors


def convert_checkpoint(model: torch.nn.Module, cfg: ConvertConfig) -> None:
    """The checkpoint cfg.model, loaded as `model` (Transformer.from_pretrained), rewritten in cfg.out in another
    storage (and sharding); its tokenizer files are copied beside it."""
    src, out = Path(cfg.model), Path(cfg.out)
    if not cfg.out or src.resolve() == out.resolve():
        raise ValueError(f"--out must name a directory other than --model ({src})")
    save_model(model, out, storage=cfg.storage, max_shard_mb=cfg.max_shard_mb or None)
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copyfile(src / name, out / name)


def _safetensor_files(path: Path) -> list[Path]:
    single = path / "model.safetensors"
    if single.exists():
        return [single]
    index = path / INDEX
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / s for s in shards]
    raise FileNotFoundError(f"{path} holds neither model.safetensors nor {INDEX}")


def _stored_layout(files: list[Path]) -> tuple[dict[str, tuple[Path, str, tuple[int, ...]]], dict[str, str]]:
    """{stored name: (file, header dtype, shape)} and the first file's metadata, from the headers alone."""
    layout, metadata = {}, None
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as sf:
            meta = sf.metadata() or {}
            if metadata is not None and meta.get(STORAGE_KEY) != metadata.get(STORAGE_KEY):
                raise StorageError(StorageFault.DTYPE, f"{f.name} is stored unlike the other shards")
            metadata = meta if metadata is None else metadata
            for name in sf.keys():
                if name.endswith("rotary_emb.inv_freq"):
                    continue  # older transformers saved this buffer; we derive it from the config
                part = sf.get_slice(name)
                layout[name] = (f, part.get_dtype(), tuple(part.get_shape()))
    return layout, metadata or {}


def _check_stored(path: Path, layout: dict, model_shapes: dict[str, tuple[int, ...]], int8: bool) -> None:
    """Names, dtypes and shapes of the stored tensors against the model's, before any tensor is read."""
    if int8:
        dtypes = {n: (HEADER_DTYPES.get(d), s) for n, (_, d, s) in layout.items()}
        check_layout({n: (d if d is not None else torch.float64, s) for n, (d, s) in dtypes.items()})
    expected = stored_shapes(model_shapes, int8)
    stored = {}
    for name, (_, _, shape) in layout.items():
        base = name.removesuffix(SCALE_SUFFIX) if int8 else name
        ours = from_hf_name(base) + (name[len(base) :] if int8 else "")
        stored[ours] = shape
    missing, unexpected = set(expected) - set(stored), set(stored) - set(expected)
    if missing or unexpected:
        raise StorageError(
            StorageFault.NAME,
            f"checkpoint {path} does not match its config: missing {sorted(missing)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]}",
        )
    for name, shape in stored.items():
        if shape != expected[name]:
            raise StorageError(
                StorageFault.SHAPE, f"{path}: {name} has shape {list(shape)}, the config says {list(expected[name])}"
            )


def read_config(path: str | Path) -> ModelConfig:
    """The ModelConfig of a checkpoint folder (its config.json: ours, or a supported Hugging Face one)."""
    cfg_file = Path(path) / "config.json"
    if not cfg_file.exists():
        raise FileNotFoundError(f"{path} is not a model directory: no config.json")
    return config_from_hf(json.loads(cfg_file.read_text()))


def load_weights(model: torch.nn.Module, path: str | Path, dtype: torch.dtype | None = None) -> None:
    """Assign a checkpoint's weights to `model`, built from read_config(path) on the meta device: names, dtypes and
    shapes checked from the headers before any tensor is read, an int8 checkpoint dequantized into `dtype` (default:
    the dtype it was saved from). Buffers are left to the model to rebuild."""
    path, cfg = Path(path), model.cfg
    layout, metadata = _stored_layout(_safetensor_files(path))
    storage = metadata.get(STORAGE_KEY)
    if storage not in (None, INT8_ROWS):
        raise StorageError(StorageFault.DTYPE, f"{path}: unknown storage {storage!r} (known: {INT8_ROWS})")
    int8 = storage == INT8_ROWS
    if cfg.tied_embeddings:
        layout = {n: v for n, v in layout.items() if not n.startswith("lm_head.weight")}
    _check_stored(path, layout, {n: tuple(t.shape) for n, t in model.state_dict().items()}, int8)
    stored = {}
    for f in sorted({f for f, _, _ in layout.values()}):
        with safe_open(str(f), framework="pt", device="cpu") as sf:
            stored |= {name: sf.get_tensor(name) for name, (file, _, _) in layout.items() if file == f}
    if int8:
        saved_dtype = getattr(torch, metadata.get(DTYPE_KEY, "float32"), None)
        if not isinstance(saved_dtype, torch.dtype):
            raise StorageError(StorageFault.DTYPE, f"{path}: unknown {DTYPE_KEY} {metadata.get(DTYPE_KEY)!r}")
        stored = dequantize_state(stored, dtype or saved_dtype)
    state = {from_hf_name(name): t for name, t in stored.items()}
    model.load_state_dict(state, assign=True)


def fingerprint(path: str | Path) -> str:
    """sha256 over config.json and every tensor's name, dtype, shape and bytes, in name order."""
    path = Path(path)
    h = hashlib.sha256()
    h.update((path / "config.json").read_bytes())
    for f in _safetensor_files(path):
        with safe_open(str(f), framework="pt", device="cpu") as sf:
            for name in sorted(sf.keys()):
                t = sf.get_tensor(name)
                h.update(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
                h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
