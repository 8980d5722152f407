"""The edge client's on-disk weight cache: tensors stored by sha256, downloads resumable mid-tensor.

Contract: `WeightCache(root)` keeps finished tensors as root/blobs/<sha256>.bin and downloads in progress as
root/partial/<sha256>.part. `resume_point(manifest)` says where to ask the server to continue (the first
tensor not yet held, and how many of its bytes are); `write(entry, offset, data)` appends a chunk (a chunk
sent again after a reconnect is accepted idempotently) and, once a tensor is complete, checks its sha256
before it becomes a blob; `load(manifest)` returns the tensors. Two models sharing a tensor share its blob.

    cache = WeightCache("~/.cache/tether/weights")
    while (point := cache.resume_point(manifest)) is not None:
        for name, offset, data in server.fetch(*point):
            cache.write(by_name[name], offset, data)
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from torch import Tensor

from tether.shared.weights import TensorEntry, tensor_from_bytes


class WeightCacheError(ValueError):
    pass


class WeightCache:
    def __init__(self, root: str | Path):
        self.root = Path(root).expanduser()
        self.blobs = self.root / "blobs"
        self.partial = self.root / "partial"
        self.blobs.mkdir(parents=True, exist_ok=True)
        self.partial.mkdir(parents=True, exist_ok=True)

    def _blob(self, entry: TensorEntry) -> Path:
        return self.blobs / f"{entry.sha256}.bin"

    def _part(self, entry: TensorEntry) -> Path:
        return self.partial / f"{entry.sha256}.part"

    def has(self, entry: TensorEntry) -> bool:
        return self._blob(entry).exists()

    def held_bytes(self, entry: TensorEntry) -> int:
        if self.has(entry):
            return entry.nbytes
        part = self._part(entry)
        return part.stat().st_size if part.exists() else 0

    def resume_point(self, manifest: list[TensorEntry]) -> tuple[str, int] | None:
        """(tensor, offset) to fetch from next, or None when every tensor is held and verified."""
        for entry in manifest:
            if not self.has(entry):
                return entry.name, self.held_bytes(entry)
        return None

    def write(self, entry: TensorEntry, offset: int, data: bytes) -> None:
        if self.has(entry):
            return
        part = self._part(entry)
        held = part.stat().st_size if part.exists() else 0
        if offset > held:
            raise WeightCacheError(f"chunk of {entry.name!r} at {offset} leaves a gap after {held} bytes")
        if offset + len(data) > entry.nbytes:
            raise WeightCacheError(f"chunk of {entry.name!r} runs past its {entry.nbytes} bytes")
        if offset + len(data) > held:  # a resent chunk that we already hold adds nothing
            with open(part, "r+b" if part.exists() else "wb") as f:
                f.seek(offset)
                f.write(data)
        if (part.stat().st_size if part.exists() else 0) == entry.nbytes:
            self._finish(entry)

    def _finish(self, entry: TensorEntry) -> None:
        part = self._part(entry)
        if not part.exists():  # an empty tensor never got a file
            part.write_bytes(b"")
        digest = hashlib.sha256(part.read_bytes()).hexdigest()
        if digest != entry.sha256:
            part.unlink()
            raise WeightCacheError(f"tensor {entry.name!r} failed its sha256 check; its download starts over")
        os.replace(part, self._blob(entry))

    def load(self, manifest: list[TensorEntry]) -> dict[str, Tensor]:
        missing = [e.name for e in manifest if not self.has(e)]
        if missing:
            raise WeightCacheError(f"{len(missing)} tensors are not downloaded yet, e.g. {missing[0]!r}")
        return {e.name: tensor_from_bytes(self._blob(e).read_bytes(), e.dtype, e.shape) for e in manifest}
