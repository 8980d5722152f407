"""The edge client's on-disk weight cache: tensors stored by sha256, downloads resumable mid-tensor.

Contract: `WeightCache(root)` keeps finished tensors as root/blobs/<sha256>.bin and downloads in progress as
root/partial/<sha256>.part. `resume_point(manifest)` says where to ask the server to continue (the first
tensor not yet held, and how many of its bytes are); `write(entry, offset, data)` appends a chunk (a chunk
sent again after a reconnect is accepted idempotently) and, once a tensor is complete, checks its sha256
before it becomes a blob; `load(manifest)` returns the tensors (torch, imported then), `blob(entry)` the verified
file of one entry (an ONNX part's files are read from there, without torch), `find(sha256)` the verified file of
that hash if one is held, before any manifest is asked for (the tokenizer, named by ModelInfo.tokenizer_sha256).
Two models sharing a tensor share its blob. Importing this module does not import torch.
File names come from the manifest's sha256 fields, which the server writes: anything but 64 lowercase hex digits
is refused (WeightCacheError, Problem.CACHE_KEY) before any file is touched, and every path is resolved and
checked to lie inside the cache.

    cache = WeightCache("~/.cache/tether/weights")
    while (point := cache.resume_point(manifest)) is not None:
        for name, offset, data in server.fetch(*point):
            cache.write(by_name[name], offset, data)
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import TYPE_CHECKING

from tether.client.errors import Problem, ServerDataError
from tether.shared.ids import is_sha256 as is_sha256_hex
from tether.shared.weights import TensorEntry, tensor_from_bytes

if TYPE_CHECKING:
    from torch import Tensor

_HASH_BLOCK = 1 << 20  # a finished tensor is hashed in blocks, never read whole


class WeightCacheError(ServerDataError):
    """A download the cache refuses: a bad cache key, a chunk that does not fit its tensor, a failed sha256."""


def is_sha256(value: object) -> bool:
    """A cache key: the only form a file name taken from the server may have."""
    return isinstance(value, str) and is_sha256_hex(value)


class WeightCache:
    def __init__(self, root: str | Path):
        self.root = Path(root).expanduser().resolve()
        self.blobs = self.root / "blobs"
        self.partial = self.root / "partial"
        self.blobs.mkdir(parents=True, exist_ok=True)
        self.partial.mkdir(parents=True, exist_ok=True)

    def _file(self, folder: Path, entry: TensorEntry, suffix: str) -> Path:
        if not is_sha256(entry.sha256):
            raise WeightCacheError(
                Problem.CACHE_KEY, f"tensor {entry.name!r}: sha256 {entry.sha256[:80]!r} is not 64 lowercase hex digits"
            )
        path = (folder / f"{entry.sha256}{suffix}").resolve()
        if path.parent != folder.resolve():  # the check above already rules this out; a second fence costs nothing
            raise WeightCacheError(Problem.CACHE_KEY, f"tensor {entry.name!r} would be stored outside {folder}")
        return path

    def _blob(self, entry: TensorEntry) -> Path:
        return self._file(self.blobs, entry, ".bin")

    def _part(self, entry: TensorEntry) -> Path:
        return self._file(self.partial, entry, ".part")

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
            raise WeightCacheError(
                Problem.CHUNK, f"chunk of {entry.name!r} at {offset} leaves a gap after {held} bytes"
            )
        if offset + len(data) > entry.nbytes:
            raise WeightCacheError(Problem.CHUNK, f"chunk of {entry.name!r} runs past its {entry.nbytes} bytes")
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
        h = hashlib.sha256()
        with open(part, "rb") as f:
            while block := f.read(_HASH_BLOCK):
                h.update(block)
        if h.hexdigest() != entry.sha256:
            part.unlink()
            raise WeightCacheError(
                Problem.CHECKSUM, f"tensor {entry.name!r} failed its sha256 check; its download starts over"
            )
        os.replace(part, self._blob(entry))

    def find(self, sha256: str) -> Path | None:
        """The verified file whose bytes have this sha256, if the cache holds one (a blob is only ever a file whose
        hash was checked); a malformed hash is refused like a manifest's."""
        path = self._blob(TensorEntry("lookup by hash", "uint8", (0,), 0, sha256))
        return path if path.is_file() else None

    def blob(self, entry: TensorEntry) -> Path:
        """The file of a downloaded, verified entry."""
        if not self.has(entry):
            raise WeightCacheError(Problem.CHUNK, f"{entry.name[:80]!r} is not downloaded yet")
        return self._blob(entry)

    def load(self, manifest: list[TensorEntry]) -> dict[str, Tensor]:
        return {e.name: tensor_from_bytes(self.blob(e).read_bytes(), e.dtype, e.shape) for e in manifest}
