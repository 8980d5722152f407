"""Int8 storage with per-row scales: a plain transform of a finished state dict, and back (gpt-fast style).

Contract:
- `quantize_state(tensors)`: every 2-D floating matrix NAME (linear layers, the embedding / unembedding) becomes
  NAME as int8 [rows, cols] and NAME + SCALE_SUFFIX as fp32 [rows]: symmetric, round to nearest, one scale per output
  row (scale = max |row| / 127). A zero row has scale 0 and dequantizes to exact zeros; a NaN or Inf is refused.
  1-D tensors (norms, biases) and non-floating tensors are kept as they are.
- `dequantize_state(tensors, dtype)`: the inverse, into `dtype`; each value is within half a step (scale / 2) of
  the original.
- `check_layout(layout)`: the names, dtypes and shapes of a stored int8 checkpoint (from the safetensors headers,
  before any tensor is read) checked; a malformed one raises StorageError with a `StorageFault` reason.
- A file in this format says so in its safetensors metadata: STORAGE_KEY = INT8_ROWS, and DTYPE_KEY = the dtype
  the weights had before quantization (the dtype a load without an explicit one restores).

Why fp32 scales: a bf16 scale has an 8-bit mantissa, which would add up to 0.4% relative error to every value of
its row on top of the rounding; fp32 costs 4 bytes a row (under 0.5% of an int8 row of 384 and more).
Tests: tests/shared/test_int8_storage.py.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping

import torch

STORAGE_KEY = "tether_storage"  # safetensors metadata key naming the storage format
INT8_ROWS = "int8_rows"
DTYPE_KEY = "tether_dtype"  # the dtype the weights had before quantization ("bfloat16", "float32", ...)
SCALE_SUFFIX = ".scale"  # an int8 matrix's row scales, stored beside it
QMAX = 127  # symmetric: -127..127, so 0 stays exactly 0 and the range is the same on both sides

# safetensors header dtype names of the tensors this format may hold.
HEADER_DTYPES = {"I8": torch.int8, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


class StorageFault(enum.Enum):
    MISSING_SCALE = "missing_scale"  # an int8 matrix without its row scales
    ORPHAN_SCALE = "orphan_scale"  # row scales without an int8 matrix
    SCALE_SHAPE = "scale_shape"  # scales not one per row of their matrix
    DTYPE = "dtype"  # a matrix not int8, or scales not fp32, or an unexpected dtype
    SHAPE = "shape"  # a tensor's shape is not the model's
    NAME = "name"  # a tensor the model lacks, or one it needs missing
    NOT_FINITE = "not_finite"  # NaN or Inf in a matrix to quantize


class StorageError(ValueError):
    """A checkpoint that cannot be stored or loaded as int8 rows; `reason` says why (branch on it, not the text)."""

    def __init__(self, reason: StorageFault, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def is_quantized_matrix(t: torch.Tensor) -> bool:
    return t.dim() == 2 and t.is_floating_point()


def quantize_rows(w: torch.Tensor, name: str = "tensor") -> tuple[torch.Tensor, torch.Tensor]:
    """w [R, C] floating -> (int8 [R, C], fp32 scales [R])."""
    w = w.detach().to("cpu", torch.float32)
    if not torch.isfinite(w).all():
        raise StorageError(StorageFault.NOT_FINITE, f"{name} holds NaN or Inf: it cannot be stored as int8")
    scale = w.abs().amax(dim=1) / QMAX  # [R]
    q = torch.round(w / torch.where(scale > 0, scale, 1.0)[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return q.contiguous(), scale.contiguous()


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 [R, C] and fp32 scales [R] -> [R, C] in `dtype` (computed in fp32, rounded once)."""
    return (q.to(torch.float32) * scale.to(torch.float32)[:, None]).to(dtype)


def quantize_state(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if is_quantized_matrix(t):
            out[name], out[name + SCALE_SUFFIX] = quantize_rows(t, name)
        else:
            out[name] = t.detach().to("cpu").contiguous()
    return out


def dequantize_state(tensors: Mapping[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Stored int8 tensors -> plain ones in `dtype` (1-D floating tensors are cast to `dtype` too)."""
    check_layout({name: (t.dtype, tuple(t.shape)) for name, t in tensors.items()})
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name.endswith(SCALE_SUFFIX):
            continue
        if t.dtype == torch.int8:
            out[name] = dequantize_rows(t, tensors[name + SCALE_SUFFIX], dtype)
        else:
            out[name] = t.to(dtype) if t.is_floating_point() else t
    return out


def check_layout(layout: Mapping[str, tuple[torch.dtype, tuple[int, ...]]]) -> None:
    """{stored name: (dtype, shape)} of an int8-rows checkpoint: every int8 tensor a matrix with fp32 scales, one
    per row; every scale belonging to an int8 matrix; no other matrix left floating."""
    for name, (dtype, shape) in layout.items():
        if name.endswith(SCALE_SUFFIX):
            matrix = name[: -len(SCALE_SUFFIX)]
            if matrix not in layout or layout[matrix][0] != torch.int8:
                raise StorageError(StorageFault.ORPHAN_SCALE, f"{name}: row scales without an int8 matrix {matrix}")
            if dtype != torch.float32:
                raise StorageError(StorageFault.DTYPE, f"{name}: row scales must be float32, not {dtype}")
            rows = layout[matrix][1][0]
            if shape != (rows,):
                raise StorageError(StorageFault.SCALE_SHAPE, f"{name}: shape {list(shape)}, expected [{rows}]")
        elif dtype == torch.int8:
            if len(shape) != 2:
                raise StorageError(StorageFault.SHAPE, f"{name}: an int8 tensor must be a matrix, not {list(shape)}")
            if name + SCALE_SUFFIX not in layout:
                raise StorageError(StorageFault.MISSING_SCALE, f"{name}: int8 matrix without {name}{SCALE_SUFFIX}")
        elif len(shape) == 2:
            raise StorageError(StorageFault.DTYPE, f"{name}: a matrix stored as {dtype} in an int8 checkpoint")


def stored_shapes(model_shapes: Mapping[str, tuple[int, ...]], int8: bool) -> dict[str, tuple[int, ...]]:
    """{name: shape} a checkpoint of a model with `model_shapes` stores: the scales added when `int8`."""
    out = dict(model_shapes)
    if int8:
        out.update({n + SCALE_SUFFIX: (s[0],) for n, s in model_shapes.items() if len(s) == 2})
    return out
