"""The onnxruntime drafter: an exported drafter's graphs, loaded and checked, under the one drafting loop.

Loads the graphs tether.server.onnx_export writes (MoA with any TLI N, and EAGLE) and drafts over them with
tether.shared.draft_loop.DraftLoop, the loop the torch drafters run too, so it gives their greedy drafts over the
same deltas; the caches and graph calls are tether.client.onnx_backends'. It imports numpy, onnxruntime, safetensors
and the standard library only, never torch, so an edge install can leave torch out.

Contract (tether.shared.contracts.Drafter, as DraftLoop; where the torch drafters differ is marked *):
- `OnnxDrafter.load(dir, threads=1, tree_width=0)` reads onnx_drafter.json, checks each graph's sha256 and returns
  the drafter over the MoA or EAGLE backend (`kind`). `threads` is onnxruntime's intra-op thread count (0: one per
  core); the graphs are so small that one thread drafts about as fast as a pool (measured on 2 cores) and leaves a
  core to the rest of the client. `tree_width` (>= 2): the top_k of the trees the caller will draft, for which a
  session is derived.
- `OnnxDrafter.from_files(description, files, threads=1, tree_width=0)`: the same from a description already read
  and its files by name (the blobs of a part fetched from the server: tether.client.onnx_pairing, which checks the
  description first). A graph whose description has `weights` keeps its matrices outside
  (tether.server.client_export): they are read from that safetensors file, which must hold exactly the tensors
  described, in the dtype and shape of the precision (tether.shared.weights.stored_layout), widened to fp32 and handed
  to onnxruntime by name; an int8 part's Linear products are rewritten to read its int8 rows instead
  (tether.client.onnx_int8). Every session reads external data from an empty folder, so a graph that names a file we
  did not supply fails to load instead of reading one from the working directory. Every session allocates from
  the capped arena and every call runs under the time bound of `limits` (tether.client.onnx_bounds.RunLimits; by
  default what the description implies): a call past either raises DraftingStopped, one line.
- `OnnxDrafter(manifest, sessions, keep=[other])`: a drafter of its own over another's sessions (which run
  concurrently) and weights, with caches of its own (tether.client.edge_api, one per session).
- begin / commit / draft / feed / draft_tree / discard_drafts are the loop's (tether.shared.draft_loop), with:
  * sampled drafts' q_ids / q_probs as numpy arrays, and tokens drawn with a numpy Generator (`generator`:
  np.random.Generator, or an int seed for a new stream every call): the torch drafters' truncated distributions,
  not their random stream. DraftTree.chain wants torch tensors: torch.from_numpy(q_ids).
  * draft_tree returning a tether.shared.draft_trees.TreeDraft of plain lists; `DraftTree.from_lists` builds the
  torch one.

Tests: tests/client/test_onnx_backend.py (parity with torch, a run with torch blocked) and tests/shared/test_wire.py.

    drafter = OnnxDrafter.load("build/onnx-drafter")
    drafter.begin(prompt_delta)
    tokens, _, _ = drafter.draft(root, k=5)
    drafter.commit(delta_for_root_and_accepted)
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
from safetensors import safe_open

from tether.client.onnx_backends import OnnxBackend, OnnxEagleBackend, OnnxMoABackend
from tether.client.onnx_bounds import BoundedSession, RunLimits, bound_session_options
from tether.client.onnx_derived import SessionOptions, derived_graphs
from tether.client.onnx_int8 import int8_matmuls
from tether.shared.draft_loop import DraftLoop
from tether.shared.drafter_config import ArrayDelta as ArrayDelta  # a delta of numpy arrays, decoded torch-free
from tether.shared.weights import SCALE_SUFFIX, decode_weight, stored_layout

FORMAT_VERSION = 1
MANIFEST = "onnx_drafter.json"
SAFETENSORS_DTYPES = {"float32": "F32", "float16": "F16", "int8": "I8"}  # numpy's names -> safetensors'
# onnxruntime reads a graph's external data from this folder (otherwise from the working directory).
EXTERNAL_FOLDER_KEY = "session.model_external_initializers_file_folder_path"


def load_stored(path: str | Path, spec: Mapping[str, Any]) -> dict[str, tuple[np.ndarray, np.ndarray | None]]:
    """A graph's external matrices as stored, {name: (matrix, its int8 row scales or None)}, from the safetensors
    file `path` its description's `weights` names (module docstring); ValueError unless the file holds exactly the
    tensors described."""
    precision, shapes = spec["precision"], spec["tensors"]
    expected = {
        name + suffix: (SAFETENSORS_DTYPES[dtype], shape)
        for name, s in shapes.items()
        for suffix, (dtype, shape) in stored_layout(tuple(s), precision).items()
    }
    try:
        with safe_open(str(path), framework="numpy") as f:
            if set(f.keys()) != expected.keys():
                raise ValueError(f"{Path(path).name} holds other tensors than its graph's description lists")
            for key, (dtype, shape) in expected.items():
                stored = f.get_slice(key)
                if stored.get_dtype() != dtype or tuple(stored.get_shape()) != shape:
                    raise ValueError(f"{key[:80]!r} is {stored.get_dtype()} {stored.get_shape()}, not {dtype} {shape}")
            scaled = precision == "int8"
            return {n: (f.get_tensor(n), f.get_tensor(n + SCALE_SUFFIX) if scaled else None) for n in shapes}
    except ValueError:
        raise
    except Exception as e:  # safetensors raises its own error type on a file it cannot parse
        raise ValueError(f"{Path(path).name} is not a safetensors file: {str(e)[:200]}") from None


def _check_sha256(name: str, data: bytes, want: str) -> None:
    digest = hashlib.sha256(data).hexdigest()
    if digest != want:
        raise ValueError(f"{name}: sha256 {digest[:12]} does not match the manifest's")


def _session(
    name: str,
    graph: bytes,
    weights: Mapping[str, np.ndarray],
    threads: int,
    limits: RunLimits,
    options: SessionOptions | None = None,
) -> tuple[BoundedSession, list]:
    """An onnxruntime session of `graph` with `weights` as its external initializers, under `limits`; returns it
    and the values it was given, which must live as long as it does."""
    options = options or SessionOptions()
    opts = ort.SessionOptions()
    bound_session_options(opts, limits)
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    # Idle pool threads would otherwise busy-wait after every call, taking cores from the rest of the client.
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if not options.prepack:
        opts.add_session_config_entry("session.disable_prepacking", "1")
    for axis, size in options.fixed_dims.items():
        opts.add_free_dimension_override_by_name(axis, size)
    values = [ort.OrtValue.ortvalue_from_numpy(a) for a in weights.values()]
    if weights:
        opts.add_external_initializers(list(weights), values)
    with tempfile.TemporaryDirectory(prefix="tether-onnx-") as empty:
        opts.add_session_config_entry(EXTERNAL_FOLDER_KEY, empty)
        session = ort.InferenceSession(graph, opts, providers=["CPUExecutionProvider"])
    return BoundedSession(session, name, limits), [values, weights]


BACKENDS = {"moa": OnnxMoABackend, "eagle": OnnxEagleBackend}


class OnnxDrafter(DraftLoop):
    """The drafting loop over an exported drafter's graphs (module docstring): a tether.shared.contracts.Drafter."""

    backend: OnnxBackend

    def __init__(
        self, manifest: dict, sessions: Mapping[str, BoundedSession], keep: list | None = None, tree_width: int = 0
    ):
        super().__init__(BACKENDS[manifest["kind"]](manifest, sessions, keep, tree_width))

    @property
    def kind(self) -> str:
        return self.backend.kind

    @property
    def manifest(self) -> dict:
        return self.backend.manifest

    @property
    def sessions(self) -> dict[str, BoundedSession]:
        return self.backend.sessions

    @property
    def tree_width(self) -> int:
        """The T (= R) the `tree` session is fixed at; 0 without one."""
        return self.backend.tree_width

    @classmethod
    def load(
        cls,
        path: str | Path,
        *,
        threads: int = 1,
        check_hashes: bool = True,
        tree_width: int = 0,
        limits: RunLimits | None = None,
    ) -> OnnxDrafter:
        path = Path(path)
        f = path / MANIFEST
        if not f.exists():
            raise FileNotFoundError(f"{path} holds no {MANIFEST}: export one with tether.server.onnx_export")
        manifest = json.loads(f.read_text())
        names = [g["file"] for g in manifest.get("graphs", {}).values()]
        names += [g["weights"]["file"] for g in manifest.get("graphs", {}).values() if "weights" in g]
        return cls.from_files(
            manifest,
            {name: path / name for name in names},
            threads=threads,
            check_hashes=check_hashes,
            tree_width=tree_width,
            limits=limits,
        )

    @classmethod
    def from_files(
        cls,
        manifest: dict,
        files: Mapping[str, Path],
        *,
        threads: int = 1,
        check_hashes: bool = True,
        tree_width: int = 0,
        limits: RunLimits | None = None,
    ) -> OnnxDrafter:
        if manifest.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"format version {manifest.get('format_version')}, this build reads {FORMAT_VERSION}")
        if manifest["kind"] not in BACKENDS:
            raise ValueError(f"unknown drafter kind {manifest['kind']!r}")
        sessions, keep, derived = {}, [], {}
        limits = limits or RunLimits.implied(manifest)
        for name, g in manifest["graphs"].items():
            graph = files[g["file"]].read_bytes()
            if check_hashes:
                _check_sha256(g["file"], graph, g["sha256"])
            weights, w = {}, g.get("weights")
            if w is not None:
                if check_hashes:
                    _check_sha256(w["file"], files[w["file"]].read_bytes(), w["sha256"])
                stored = load_stored(files[w["file"]], w)
                if w["precision"] == "int8":  # its matrix products run in int8 (tether.client.onnx_int8)
                    graph, weights = int8_matmuls(graph, stored)
                else:
                    weights = {n: decode_weight(q, scale) for n, (q, scale) in stored.items()}
            sessions[name], held = _session(name, graph, weights, threads, limits)
            keep.append(held)
            io = [[a.name for a in sessions[name].get_inputs()], [a.name for a in sessions[name].get_outputs()]]
            if io != [g["inputs"], g["outputs"]]:
                raise ValueError(f"graph {name!r} takes and gives {io}, its description says otherwise")
            if name == "step":
                derived = derived_graphs(manifest["kind"], graph, weights, tree_width)
        for name, (graph, weights, options) in derived.items():
            try:
                sessions[name], held = _session(name, graph, weights, threads, limits, options)
            except Exception:  # onnxruntime raises types of its own; without a derived session the step graph serves
                continue
            keep.append(held)
        return cls(manifest, sessions, keep, tree_width)
