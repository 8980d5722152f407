"""Loading a target for serving: the device, the dtype, the one place the attention backend is decided, the fused
transform, and the drafter paired with it.

Contract: `pick_device("")` is cuda when present, else cpu (a named device this machine lacks: CommandError);
`attention_backend(device, requested)` is the backend name ("auto": the Triton MoDA kernels on CUDA, registered here,
the PyTorch reference elsewhere); `load(dir, device, dtype, attention, fused=)` the target and its tokenizer;
`load_models(cfg)` a ServeConfig's target, tokenizer, drafter (None for "none", checked against the target's
fingerprint) and that fingerprint; it reads the config's `ModelChoice` fields only (tether.server.serve_config
takes its defaults and dtype names from here). `default_model_dir(name)` is deploy/models/NAME.

    target, tokenizer = load("deploy/models/target", pick_device(""))
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Protocol

import torch

from tether.shared.attention import register_backend
from tether.shared.checkpoint import fingerprint
from tether.shared.cli_support import TARGET_FILES, check_model_dir, require_device
from tether.shared.drafter_loading import load_drafter
from tether.shared.model import Transformer
from tether.shared.tokenizer import Tokenizer

log = logging.getLogger("tether.server")


def default_model_dir(name: str = "target") -> Path:
    """deploy/models/NAME of the source checkout (editable install), else of the current directory."""
    beside_source = Path(__file__).resolve().parent.parent / "deploy" / "models" / name
    return beside_source if beside_source.exists() else Path("deploy/models") / name


def pick_device(requested: str) -> str:
    """`requested` when this machine has it (a CommandError otherwise); "" is cuda when present, else cpu."""
    if requested:
        require_device(requested)
        return requested
    return "cuda" if torch.cuda.is_available() else "cpu"


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def attention_backend(device: str, requested: str = "auto") -> str:
    """The attention backend for a model on `device`: "auto" is the Triton MoDA kernels on CUDA (registered
    here: the server is the only place that imports them) and the PyTorch reference elsewhere. "triton" on the
    CPU runs the kernels in Triton's interpreter (TRITON_INTERPRET=1): slow, for tests."""
    name = ("triton" if device.startswith("cuda") else "reference") if requested == "auto" else requested
    if name == "triton":
        from tether.kernels.moda import moda_backend
        from tether.kernels.utils import interpreting

        if not device.startswith("cuda") and not interpreting():
            raise ValueError(
                "--attention triton needs a CUDA device (or TRITON_INTERPRET=1, for tests): use "
                "--attention auto or reference"
            )

        register_backend("triton", moda_backend)
    return name


def load(
    model_dir: str | Path, device: str, dtype: str = "", attention: str = "auto", *, fused: bool | None = None
) -> tuple[Transformer, Tokenizer]:
    """The model and its tokenizer; dtype "" = bfloat16 on CUDA, float32 elsewhere; attention as in
    `attention_backend`; `fused` (default: on the "triton" backend) applies tether.server.fuse's transform (not
    for a tensor-parallel shard, which re-slices each projection itself)."""
    check_model_dir("model", str(model_dir), TARGET_FILES)
    model_dir = Path(model_dir)
    if dtype and dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r} (choose from {', '.join(DTYPES)})")
    dtype = DTYPES[dtype] if dtype else torch.bfloat16 if device.startswith("cuda") else torch.float32
    model = Transformer.from_pretrained(model_dir, device=device, dtype=dtype)
    model.backend = attention_backend(device, attention)
    if model.backend == "triton" if fused is None else fused:
        from tether.server.fuse import fuse  # imports the kernels: only where they run

        fuse(model)
    return model, Tokenizer.from_pretrained(model_dir)


class ModelChoice(Protocol):
    """What load_models reads of a ServeConfig: which models, and how to load them."""

    @property
    def model(self) -> str: ...  # the target's folder

    @property
    def drafter(self) -> str: ...  # the drafter's folder, or "none"

    @property
    def dtype(self) -> str: ...  # a DTYPES name, or "" for the device's default

    @property
    def attention(self) -> str: ...  # as attention_backend takes it

    @property
    def tp(self) -> int: ...  # tensor-parallel ranks: a shard is not fused here


def load_target(cfg: ModelChoice, device: str) -> tuple[Transformer, Tokenizer]:
    """The target and its tokenizer as `cfg` chooses them: what rank 0 and every tensor-parallel follower load."""
    return load(cfg.model, device, cfg.dtype, cfg.attention, fused=None if cfg.tp == 1 else False)


def load_models(cfg: ModelChoice, device: str):
    t0 = time.perf_counter()
    target, tokenizer = load_target(cfg, device)
    model_fp = fingerprint(cfg.model)
    drafter = None
    if cfg.drafter != "none":
        drafter = load_drafter(cfg.drafter, target, target_fingerprint=model_fp)
    log.info("models loaded in %.1f s", time.perf_counter() - t0, extra={"event": "models_loaded"})
    return target, tokenizer, drafter, model_fp
