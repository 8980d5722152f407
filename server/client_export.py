"""The client part as ONNX: exported once per drafter fingerprint and precision, kept on disk, streamed as files.

Purpose: an edge client that drafts with onnxruntime should need no torch, so the server, which has it, turns the
client part into the drafting graphs (tether.server.onnx_export) and FetchWeights streams them in place of the
tensors (ClientPartFormat in tether.v1; docs/ARCHITECTURE.md section 3).

Contract:
- `ClientExporter(cfg, dcfg, weights, drafter_fingerprint, root=None)`: `weights` is the client part as the server
  streams it (tether.shared.weights, the tokenizer entry included); `root` a directory the exports are kept in
  across restarts (None: a temporary one, removed by `close()`).
- `exporter.part(precision)` -> ExportedPart (blocks; exports when needed); `await exporter.part_async(precision)`
  does the same from the event loop without blocking it. Exports run on the exporter's own thread, one at a time;
  callers asking for the same precision at once share one export; a failed export raises ExportError for every
  caller waiting on it and is tried again at the next call.
- ExportedPart: `files` {entry name: bytes or an mmap of the file} and `manifest` [TensorEntry], the entries in
  tether.shared.weights.onnx_entries order, each uint8 [nbytes] with its sha256 (what iter_chunks streams).
- On disk: root/<drafter fingerprint>-v<EXPORT_VERSION>/<precision>/ holds onnx_drafter.json and per graph
  <graph>.onnx (the structure, its matrices as external references) and <graph>.safetensors (the matrices, in the
  precision: tether.shared.weights.encode_weights). Every name is the server's own; a directory is written beside
  its final name and renamed into place, so a restart, a crash or a second server on the same root finds whole
  exports only. fp16 and int8 are derived from the fp32 export without exporting again.
The graphs are exported from the client part's tensors as served (bf16 on a GPU server), widened to fp32:
exactly the modules a torch client builds from the same stream (tether.shared.weights.build_client_part), so the
fp32 graphs draft what that client drafts.

    exporter = ClientExporter(target.cfg, drafter.dcfg, service.weights, service.drafter_fingerprint, root)
    part = await exporter.part_async("int8")

Tests: tests/server/test_client_export.py, tests/client/test_onnx_pairing.py.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import json
import logging
import mmap
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import load_file, save_file

from tether.server.onnx_export import export_client_onnx, split_weights
from tether.shared.config import ModelConfig
from tether.shared.drafter_config import DrafterConfig
from tether.shared.ids import is_sha256
from tether.shared.weights import (
    ONNX_MANIFEST,
    ONNX_PRECISIONS,
    TOKENIZER_TENSOR,
    TensorEntry,
    build_client_part,
    encode_weights,
    onnx_entries,
    onnx_graphs,
    tensor_bytes,
)
from tether.v1 import tether_pb2 as pb

# The ONNX formats of FetchWeights, by the precision of their weights.
FORMATS = {pb.CLIENT_PART_ONNX_FP32: "fp32", pb.CLIENT_PART_ONNX_FP16: "fp16", pb.CLIENT_PART_ONNX_INT8: "int8"}
EXPORT_VERSION = 4  # raise when the exported files change for the same drafter: older exports are then ignored
_HASH_BLOCK = 1 << 20
# torch.onnx keeps global state while it exports (and onnx_export patches one of its functions): one at a time
# in this process, whichever exporter asks.
_TORCH_EXPORT = threading.Lock()
log = logging.getLogger("tether.server")


class ExportError(RuntimeError):
    """The ONNX client part could not be exported or read back."""


@dataclass(frozen=True)
class ExportedPart:
    precision: str
    files: Mapping[str, Any]  # entry name -> bytes or mmap
    manifest: tuple[TensorEntry, ...]

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.manifest)


def _sha256(data) -> str:
    h = hashlib.sha256()
    view = memoryview(data)
    for pos in range(0, len(view), _HASH_BLOCK):
        h.update(view[pos : pos + _HASH_BLOCK])
    return h.hexdigest()


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


class ClientExporter:
    def __init__(
        self,
        cfg: ModelConfig,
        dcfg: DrafterConfig,
        weights: Mapping[str, Any],
        drafter_fingerprint: str,
        root: str | os.PathLike | None = None,
    ):
        if not is_sha256(drafter_fingerprint):
            raise ValueError("the drafter fingerprint names a directory: it must be 64 lowercase hex digits")
        self.cfg, self.dcfg, self.weights = cfg, dcfg, weights
        self._root = None if root is None else Path(root).expanduser().absolute()
        self._name = f"{drafter_fingerprint}-v{EXPORT_VERSION}"
        self._tmp: tempfile.TemporaryDirectory | None = None  # made at the first export when no root is given
        self.exports = 0  # graphs exported by torch in this process (the rest came from disk or were derived)
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tether-export")
        self._lock = threading.Lock()
        self._futures: dict[str, concurrent.futures.Future] = {}
        self._maps: list[mmap.mmap] = []
        self._opened: dict[str, ExportedPart] = {}  # touched by the export thread only

    # ---- callers ------------------------------------------------------------------------------------------

    def _future(self, precision: str) -> concurrent.futures.Future:
        if precision not in ONNX_PRECISIONS:
            raise ValueError(f"unknown precision {precision!r}")
        with self._lock:
            work = self._futures.get(precision)
            if work is None or (work.done() and (work.cancelled() or work.exception() is not None)):
                work = self._futures[precision] = self._executor.submit(self._part, precision)
            return work

    def part(self, precision: str) -> ExportedPart:
        return self._future(precision).result()

    async def part_async(self, precision: str) -> ExportedPart:
        # Shielded: a caller that goes away must not cancel an export other callers wait for.
        return await asyncio.shield(asyncio.wrap_future(self._future(precision)))

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        for m in self._maps:
            m.close()
        self._maps.clear()
        if self._tmp is not None:
            self._tmp.cleanup()

    # ---- the export thread --------------------------------------------------------------------------------

    def _part(self, precision: str) -> ExportedPart:
        if precision not in self._opened:
            try:
                self._opened[precision] = self._open_or_make(precision)
            except Exception as e:
                log.exception("ONNX export failed", extra={"event": "onnx_export_failed", "precision": precision})
                raise ExportError(f"exporting the {precision} ONNX client part failed: {type(e).__name__}: {e}") from e
        return self._opened[precision]

    @property
    def dir(self) -> Path:
        """This drafter's exports (the temporary root, when there is one, is made on first use)."""
        if self._root is None and self._tmp is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="tether-onnx-")
        return (self._root or Path(self._tmp.name)) / self._name

    def _open_or_make(self, precision: str) -> ExportedPart:
        final = self.dir / precision
        if not final.is_dir():
            self._make(precision, final)
        try:
            return self._open(precision, final)
        except (OSError, ValueError, KeyError) as e:
            # A damaged export (a file removed or changed by hand) is made again, once.
            log.warning("ONNX client part %s unreadable (%s); exporting again", final, e)
            shutil.rmtree(final, ignore_errors=True)
        self._make(precision, final)
        return self._open(precision, final)

    def _make(self, precision: str, final: Path) -> None:
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{precision}-"))
        try:
            t0 = time.perf_counter()
            if precision == "fp32":
                self._export_fp32(tmp)
            else:
                self._derive(self._part("fp32"), precision, tmp)
            try:
                os.rename(tmp, final)
            except OSError:
                if not final.is_dir():
                    raise
                # Another process sharing the directory finished first: its export is as good as ours.
            log.info(
                "ONNX client part %s ready in %.1f s",
                final,
                time.perf_counter() - t0,
                extra={"event": "onnx_export", "precision": precision},
            )
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def _export_fp32(self, out: Path) -> None:
        tensors = {k: v for k, v in self.weights.items() if k != TOKENIZER_TENSOR}
        _, drafter = build_client_part(self.cfg, self.dcfg, tensors)
        with _TORCH_EXPORT:
            manifest = export_client_onnx(drafter, out)
        self.exports += 1
        for name in onnx_graphs(self.dcfg.kind):
            g = manifest["graphs"][name]
            graph, arrays = split_weights((out / g["file"]).read_bytes(), f"{name}.safetensors")
            (out / g["file"]).write_bytes(graph)
            self._write_weights(g, graph, arrays, "fp32", out)
        _write_json(out / ONNX_MANIFEST, manifest)

    def _derive(self, fp32: ExportedPart, precision: str, out: Path) -> None:
        manifest = json.loads(bytes(fp32.files[ONNX_MANIFEST]))
        for name in onnx_graphs(self.dcfg.kind):
            g = manifest["graphs"][name]
            graph = bytes(fp32.files[g["file"]])
            arrays = load_file(str(self.dir / "fp32" / g["weights"]["file"]))
            (out / g["file"]).write_bytes(graph)
            self._write_weights(g, graph, arrays, precision, out)
        _write_json(out / ONNX_MANIFEST, manifest)

    @staticmethod
    def _write_weights(g: dict, graph: bytes, arrays: Mapping[str, np.ndarray], precision: str, out: Path) -> None:
        """Write a graph's matrices in `precision` beside it, and describe both in its manifest entry."""
        weights = out / (g["file"].removesuffix(".onnx") + ".safetensors")
        save_file(encode_weights(arrays, precision), str(weights))
        g["sha256"] = hashlib.sha256(graph).hexdigest()
        g["weights"] = {
            "file": weights.name,
            "precision": precision,
            "sha256": _sha256(weights.read_bytes()),
            "tensors": {k: list(a.shape) for k, a in arrays.items()},
        }

    def _open(self, precision: str, final: Path) -> ExportedPart:
        files: dict[str, Any] = {TOKENIZER_TENSOR: tensor_bytes(self.weights[TOKENIZER_TENSOR])}
        for name in onnx_entries(self.dcfg.kind):
            if name == TOKENIZER_TENSOR:
                continue
            with open(final / name, "rb") as f:  # the map keeps its own handle
                if os.fstat(f.fileno()).st_size == 0:
                    raise ValueError(f"{final / name} is empty")
                m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            self._maps.append(m)
            files[name] = m
        digests = {name: _sha256(data) for name, data in files.items()}
        for g in json.loads(bytes(files[ONNX_MANIFEST]))["graphs"].values():
            w = g["weights"]
            if (digests[g["file"]], digests[w["file"]], w["precision"]) != (g["sha256"], w["sha256"], precision):
                raise ValueError(f"{final}: the files are not the ones its {ONNX_MANIFEST} describes")
        manifest = tuple(
            TensorEntry(name, "uint8", (len(files[name]),), len(files[name]), digests[name])
            for name in onnx_entries(self.dcfg.kind)
        )
        return ExportedPart(precision, files, manifest)
