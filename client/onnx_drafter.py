"""The onnxruntime drafting backend: the torch drafters' begin / commit / draft / draft_tree, on exported graphs.

Runs the graphs tether.server.onnx_export writes (MoA with any TLI N, and EAGLE) and gives the same greedy
drafts as tether.shared.drafter_runtime.DrafterBase over the same deltas. It imports numpy, onnxruntime,
safetensors and the standard library only, never torch, so an edge install can leave torch out.

Contract (tether.shared.contracts.Drafter, as DrafterBase; the differences are marked *):
- `OnnxDrafter.load(dir, threads=1, tree_width=0)` reads onnx_drafter.json, checks each graph's sha256 and returns
  the MoA or EAGLE runtime. `threads` is onnxruntime's intra-op thread count (0: one per core); the graphs are so
  small that one thread drafts about as fast as a pool (measured on 2 cores) and leaves a core to the rest of the
  client. `tree_width` (>= 2): the top_k of the trees the caller will draft, for which a session is derived.
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
- `begin(delta, capacity=None)` starts from the prompt's delta (start 0); `commit(delta)` adopts the verified
  states of the round's root and accepted drafts and drops the drafted rows after them.
  * `commit(delta, keep_drafts=True)` keeps them instead, when the caller vouches that the rows held at the
  delta's positions are of its tokens (a round drafted ahead and borne out): the next draft goes on after them
  with no re-feed. Returns whether it kept any (the torch drafters never do).
  * A delta is anything with .start, .tokens and .tensors ({"lsa", "tli_k", "tli_v"} or {"hidden"}) whose
  tensors are numpy arrays or torch tensors (converted through their own methods, so torch is not imported
  here): tether.shared.drafter.DraftDelta, or ArrayDelta built from tether.shared.wire.decode_many.
- `draft(root, k, temperature=0.0, top_p=1.0, top_k=0, support=8, generator=None, min_p=0.0, processing=None)` ->
  (tokens, q_ids, q_probs): a chain of k tokens after `root`; greedy returns (tokens, None, None). `processing`
  (tether.shared.logits_processing, of the position after `root`; draft_tree and feed take one too): each position
  processed with the counts of its own context, as DrafterBase does. `discard_drafts()` drops a lost round's rows.
  * When sampling, q_ids / q_probs are numpy arrays, int64 / float32 [k, min(support, V)] (k = 0 included), and
  tokens are drawn with a numpy Generator (`generator`: np.random.Generator or an int seed): the same truncated
  distributions as the torch backend, not the same random stream. DraftTree.chain wants torch tensors:
  torch.from_numpy(q_ids).
- `draft_tree(root, depth=, top_k=, total_tokens=)`: the EAGLE-2 dynamic tree of tether.shared.draft_trees, the
  expansion the torch drafters use too, after the rows the caches hold: the verified positions, and a chain drafted
  after them if there is one (a round drafted ahead, tether.client.rounds), which the tree's nodes then see.
  * It returns a tether.shared.draft_trees.TreeDraft of plain lists; `DraftTree.from_lists` builds the torch one.

Caches are numpy buffers sized `capacity` rows; each graph call takes the committed rows and returns the new
ones (onnx_export's docstring has the graph contract), so rolling back drafted rows is just a shorter length.
Beside the graphs described, the runtime derives sessions from the step graph at load (tether.client.onnx_derived):
one-token draft steps run on `step1` (its token and logit-row axes fixed at 1), the levels of a tree `tree_width`
wide on `tree` (both fixed at that width), and MoA's SA rows of verified tokens (the prompt at begin, an adopted
delta's tokens) come from `sa_rows` (the step graph pruned to them), not from a run of the whole step graph.
Without them (a graph they cannot be derived from) the step graph serves every call.

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
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
from safetensors import safe_open

from tether.client.onnx_bounds import BoundedSession, RunLimits, bound_session_options
from tether.client.onnx_derived import SessionOptions, derived_graphs
from tether.client.onnx_int8 import int8_matmuls
from tether.shared.draft_trees import GrowingTree, TreeDraft, expand_tree
from tether.shared.drafter_config import ArrayDelta as ArrayDelta  # a delta of numpy arrays, decoded torch-free
from tether.shared.logits_processing import LogitsProcessing
from tether.shared.sampling import probabilities_np, proposal, top_k_ids
from tether.shared.weights import SCALE_SUFFIX, decode_weight, stored_layout

FORMAT_VERSION = 1
MANIFEST = "onnx_drafter.json"
SAFETENSORS_DTYPES = {"float32": "F32", "float16": "F16", "int8": "I8"}  # numpy's names -> safetensors'
# onnxruntime reads a graph's external data from this folder (otherwise from the working directory).
EXTERNAL_FOLDER_KEY = "session.model_external_initializers_file_folder_path"


def _f32(x: Any) -> np.ndarray:
    """A delta tensor as fp32 numpy; a torch tensor (bf16 included) goes through its own methods."""
    if hasattr(x, "detach"):
        x = x.detach().cpu().float().numpy()
    return np.ascontiguousarray(x, dtype=np.float32)


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    """In fp32, or fp64 for processed logits (as the torch drafters take them)."""
    x = logits.astype(np.float64 if logits.dtype == np.float64 else np.float32)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _causal_mask(past: int, t: int) -> np.ndarray:
    """[t, past + t] bool: every committed row, then the new rows causally."""
    mask = np.ones((t, past + t), dtype=bool)
    mask[:, past:] = np.tri(t, dtype=bool)
    return mask


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


class OnnxDrafter:
    """Common driver: chain and tree drafting over a subclass's _reset/_adopt/_step/_tree_step/_drop_drafted,
    a tether.shared.contracts.Drafter as DrafterBase is."""

    kind = ""

    def __init__(self, manifest: dict, sessions: Mapping[str, BoundedSession], keep: list | None = None):
        self.manifest = manifest
        sh = manifest["shapes"]
        self.vocab_size, self.dim, self.max_seq_len = sh["vocab_size"], sh["dim"], sh["max_seq_len"]
        self.draft_kv = (sh["draft_kv_heads"], sh["draft_head_dim"])  # (Hs, Ds)
        self.target_kv = (sh["target_kv_heads"], sh["target_head_dim"])  # (Hkv, D)
        self.sessions = dict(sessions)
        self._keep = keep  # the external weights the sessions read
        self.tree_width = 0  # the T (= R) the `tree` session is fixed at, when there is one

    @classmethod
    def load(cls, path: str | Path, *, threads: int = 1, check_hashes: bool = True, tree_width: int = 0,
             limits: RunLimits | None = None) -> OnnxDrafter:  # fmt: skip
        path = Path(path)
        f = path / MANIFEST
        if not f.exists():
            raise FileNotFoundError(f"{path} holds no {MANIFEST}: export one with tether.server.onnx_export")
        manifest = json.loads(f.read_text())
        names = [g["file"] for g in manifest.get("graphs", {}).values()]
        names += [g["weights"]["file"] for g in manifest.get("graphs", {}).values() if "weights" in g]
        return cls.from_files(manifest, {name: path / name for name in names}, threads=threads,
                              check_hashes=check_hashes, tree_width=tree_width, limits=limits)  # fmt: skip

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
        kinds = {"moa": OnnxMoADrafter, "eagle": OnnxEagleDrafter}
        if manifest["kind"] not in kinds:
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
        drafter = kinds[manifest["kind"]](manifest, sessions, keep)
        if "tree" in sessions:
            drafter.tree_width = tree_width
        return drafter

    # ---- the public loop (DrafterBase's, in numpy) ------------------------------------------------------

    def begin(self, delta, capacity: int | None = None) -> None:
        """Start a sequence from the verified prompt (delta.start must be 0)."""
        if delta.start != 0:
            raise ValueError("begin() takes the prompt's delta, which starts at position 0")
        self._reset(capacity or self.max_seq_len)
        self._adopt(delta)

    def commit(self, delta, keep_drafts: bool = False) -> bool:
        """Adopt the verified states of the round's root and accepted drafts; drafts after them are dropped, unless
        `keep_drafts` and the caches hold rows past the delta: then they stay, and the next draft goes on after
        them. The caller vouches that the held rows at the delta's positions are of its tokens (a round drafted
        ahead was borne out); those rows take the verified states. Returns whether drafted rows were kept."""
        keep = keep_drafts and self.held_rows() > delta.start + len(delta.tokens)
        self._adopt(delta, keep)
        return keep

    def draft(self, root: int, k: int, *, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
              support: int = 8, stop: Callable[[], bool] | None = None,
              generator: np.random.Generator | int | None = None, min_p: float = 0.0,
              processing: LogitsProcessing | None = None, logits_seen: Callable[[np.ndarray], None] | None = None,
              ) -> tuple[list[int], np.ndarray | None, np.ndarray | None]:  # fmt: skip
        """A chain of k draft tokens after `root`. Returns the tokens and, when sampling, q_ids (int64) and
        q_probs (fp32), both [k, support]: the truncated distributions the tokens were drawn from. Pass one
        np.random.Generator across rounds for one random stream (an int seed starts a new one every call).
        `stop`, asked after each token but the last: True ends the chain there, shorter; draft(tokens[-1], the rest,
        the same generator) then goes on as if it had not stopped. `logits_seen` gets each position's logits [V]
        as the rule reads them (processed), before its token is chosen (offline logprobs: tether.client.logprobs)."""
        rng = np.random.default_rng(generator) if temperature > 0 else None
        tokens: list[int] = []
        q_ids, q_probs = [], []
        token = root
        for _ in range(k):
            logits = self._step(token)
            if processing is not None:  # this position's context: the root's, then the tokens drafted so far
                logits = processing.after(tokens).apply_np(logits)  # [V] float64
            if logits_seen is not None:
                logits_seen(logits)
            if rng is None:
                token = int(logits.argmax())
            else:
                top, q = proposal(probabilities_np(logits, temperature, top_p, top_k, min_p), support)
                token = int(top[rng.choice(top.size, p=q.astype(np.float64) / q.sum(dtype=np.float64))])
                q_ids.append(top)
                q_probs.append(q)
            tokens.append(token)
            if stop is not None and len(tokens) < k and stop():
                break
        if rng is None:
            return tokens, None, None
        n, width = len(tokens), min(support, self.vocab_size)
        return tokens, np.asarray(q_ids, np.int64).reshape(n, width), np.asarray(q_probs, np.float32).reshape(n, width)

    def feed(self, tokens: list[int], processing: LogitsProcessing | None = None) -> int | None:
        """Step over `tokens`, already decided (a round sent, a prompt's tail), as drafted rows after those held;
        the argmax after the last of them (None for none), processed by `processing`. Nothing is sampled."""
        if not tokens:
            return None
        logits = self._feed(tokens)
        return int((logits if processing is None else processing.apply_np(logits)).argmax())

    def _feed(self, tokens: list[int]) -> np.ndarray:
        """Logits [V] after the last of `tokens`: one step each unless a subclass feeds them in one call."""
        for t in tokens:
            logits = self._step(t)
        return logits

    def discard_drafts(self) -> None:
        """Drop the cache rows of drafts never answered (a lost round), as DrafterBase.discard_drafts."""
        self._drop_drafted(self.verified_length())

    def draft_tree(self, root: int, *, depth: int, top_k: int, total_tokens: int,
                   processing: LogitsProcessing | None = None) -> TreeDraft:  # fmt: skip
        """An EAGLE-2 dynamic draft tree after `root`, the token after the rows held (module docstring): each level
        feeds the frontier nodes as new cache rows (one graph call per level), then the most probable
        `total_tokens` nodes are kept. The rows it fed are dropped again. With `processing` (the position after
        the root's) each node's logits are processed after the tokens on its path before its children are picked."""
        base = self.held_rows()
        rows: dict[int, int] = {}  # grown id -> drafted row offset (position base + offset in the caches)

        def step(frontier: list[int], grown: GrowingTree) -> tuple[np.ndarray, np.ndarray]:
            n_rows, F = len(rows), len(frontier)
            mask = np.zeros((F, base + n_rows + F), dtype=bool)
            mask[:, :base] = True  # every node sees the verified prefix
            for j, node in enumerate(frontier):
                mask[j, [base + rows[a] for a in grown.path_to(node)[:-1]]] = True  # its ancestors' rows
                mask[j, base + n_rows + j] = True
            tokens = [grown.tokens[i] for i in frontier]
            positions = [base + grown.depths[i] for i in frontier]
            parent_rows = [rows.get(grown.parents[i]) for i in frontier]
            logits = self._tree_step(tokens, positions, mask, parent_rows)  # [F, V]
            if processing is not None:
                paths = [processing.after([grown.tokens[a] for a in grown.path_to(node)[1:]]) for node in frontier]
                logits = np.stack([p.apply_np(row) for p, row in zip(paths, logits, strict=True)])  # [F, V] float64
            logp = _log_softmax(logits)
            for j, node in enumerate(frontier):
                rows[node] = n_rows + j
            ids = top_k_ids(logp, top_k)
            return ids, np.take_along_axis(logp, ids, -1)

        tree = expand_tree(root, step, depth=depth, top_k=top_k, total_tokens=total_tokens)
        self._drop_drafted(base)
        return tree

    def _step_session(self, T: int, R: int) -> BoundedSession:
        """The session that runs the step graph for T new tokens and R logit rows: `step1` for one token's logits,
        `tree` for a tree level as wide as it was derived for, where they were (module docstring)."""
        if T == 1 and R == 1:
            return self.sessions.get("step1", self.sessions["step"])
        if T == R == self.tree_width:
            return self.sessions["tree"]
        return self.sessions["step"]

    # ---- subclass contract -------------------------------------------------------------------------------

    def verified_length(self) -> int:
        raise NotImplementedError

    def held_rows(self) -> int:
        """Cache rows held: the verified positions and the drafted ones after them."""
        raise NotImplementedError

    def _reset(self, capacity: int) -> None:
        raise NotImplementedError

    def _adopt(self, delta, keep: bool = False) -> None:
        """Take the verified states of positions [delta.start, delta.start + n); `keep`: rows held after them stay
        as they are (else they are dropped)."""
        raise NotImplementedError

    def _step(self, token: int) -> np.ndarray:
        raise NotImplementedError

    def _tree_step(self, tokens: list[int], positions: list[int], mask: np.ndarray, parent_rows: list) -> np.ndarray:
        raise NotImplementedError

    def _drop_drafted(self, base: int) -> None:
        raise NotImplementedError

    def _check_room(self, end: int) -> None:
        if end > self.capacity:
            raise ValueError(f"drafter cache full: {end} positions needed, capacity {self.capacity}")


def _ids(xs: list[int]) -> np.ndarray:
    return np.asarray([xs], dtype=np.int64)  # [1, T]


class OnnxMoADrafter(OnnxDrafter):
    """MoA: SA cache [cap, Hs, Ds], CA context K/V [cap, Hs, Ds], TLI caches [N, cap, Hkv, D]."""

    kind = "moa"

    def __init__(self, manifest: dict, sessions: Mapping[str, BoundedSession], keep: list | None = None):
        super().__init__(manifest, sessions, keep)
        self.tli = manifest["shapes"]["tli"]
        self.step_inputs = manifest["graphs"]["step"]["inputs"]
        rows = self.sessions.get("sa_rows")
        self.sa_rows_inputs = [a.name for a in rows.get_inputs()] if rows is not None else []

    def verified_length(self) -> int:
        return self.n_ctx

    def held_rows(self) -> int:
        return self.sa_len

    def _reset(self, capacity: int) -> None:
        self.capacity = capacity
        self.sa_k = np.zeros((capacity, *self.draft_kv), dtype=np.float32)
        self.sa_v = np.zeros_like(self.sa_k)
        self.ctx_k = np.zeros_like(self.sa_k)
        self.ctx_v = np.zeros_like(self.sa_k)
        self.tli_k = np.zeros((self.tli, capacity, *self.target_kv), dtype=np.float32)
        self.tli_v = np.zeros_like(self.tli_k)
        self.sa_len = self.tli_len = self.n_ctx = 0

    def _run(self, tokens: list[int], positions: list[int], mask: np.ndarray, logit_rows, *, sa_only=False):
        """The step graph over new tokens at rows [sa_len, sa_len + T); commits their SA rows and, unless
        `sa_only`, their TLI rows. Returns logits [R, V] for `logit_rows`."""
        P, T = self.sa_len, len(tokens)
        self._check_room(P + T)
        # One mask serves SA and TLI, so the TLI layers must see as many committed rows as SA.
        if not sa_only and self.tli and self.tli_len != P:
            raise RuntimeError(f"TLI cache holds {self.tli_len} rows, SA {P}")
        feeds = [
            _ids(tokens),
            _ids(positions),
            mask,
            np.asarray(logit_rows, dtype=np.int64),
            self.sa_k[None, :P],
            self.sa_v[None, :P],
            self.ctx_k[None, : self.n_ctx],
            self.ctx_v[None, : self.n_ctx],
        ]
        for i in range(self.tli):
            feeds += [self.tli_k[i, None, :P], self.tli_v[i, None, :P]]
        session = self._step_session(T, len(logit_rows))
        logits, sa_k, sa_v, *tli = session.run(None, dict(zip(self.step_inputs, feeds, strict=True)))
        self.sa_k[P : P + T], self.sa_v[P : P + T] = sa_k[0], sa_v[0]
        self.sa_len = P + T
        if not sa_only:
            for i in range(self.tli):
                self.tli_k[i, P : P + T], self.tli_v[i, P : P + T] = tli[2 * i][0], tli[2 * i + 1][0]
            self.tli_len = P + T
        return logits[0]

    def _adopt(self, delta, keep: bool = False) -> None:
        """Take the verified states of positions [delta.start, delta.start + n) into the caches."""
        P, n = delta.start, len(delta.tokens)
        held = self.sa_len, self.tli_len
        if self.n_ctx != P:
            raise ValueError(f"delta starts at {P} but {self.n_ctx} positions are verified")
        self._check_room(P + n)
        feed = {"lsa": _f32(delta.tensors["lsa"])[None], "positions": np.arange(P, P + n, dtype=np.int64)[None]}
        ctx_k, ctx_v = self.sessions["context"].run(None, feed)
        self.ctx_k[P : P + n], self.ctx_v[P : P + n] = ctx_k[0], ctx_v[0]
        self.n_ctx = P + n
        if self.tli:
            # The server's exact K/V replace whatever the drafter computed for these positions.
            self.tli_k[:, P : P + n] = _f32(delta.tensors["tli_k"])  # [N, n, Hkv, D]
            self.tli_v[:, P : P + n] = _f32(delta.tensors["tli_v"])
            self.tli_len = P + n
        if keep:
            # The drafted rows after the delta stay. Its positions' SA rows are computed again, as after a plain
            # commit: the step graph drafted them, and sa_rows' sums round otherwise, so verified rows would
            # depend on how they were drafted.
            self.sa_len = P
            self._sa_feed(list(delta.tokens))
            self.sa_len, self.tli_len = held
            return
        # SA depends on tokens alone, so its rows for accepted drafts stay valid; feed what it has not seen.
        self.sa_len = min(self.sa_len, P + n)
        if self.sa_len < P:
            raise ValueError(f"SA holds {self.sa_len} rows, short of the delta's start {P}")
        self._sa_feed(list(delta.tokens[self.sa_len - P :]))

    def _sa_feed(self, tokens: list[int]) -> None:
        """Commit SA rows for verified `tokens` after the rows held: from `sa_rows` where it was derived, else by
        the step graph (its TLI rows dropped, no logits)."""
        S, T = self.sa_len, len(tokens)
        if not T:
            return
        positions = list(range(S, S + T))
        session = self.sessions.get("sa_rows")
        if session is None:
            self._run(tokens, positions, _causal_mask(S, T), [], sa_only=True)
            return
        self._check_room(S + T)
        feeds = {"tokens": _ids(tokens), "positions": _ids(positions)}
        sa_k, sa_v = session.run(None, {name: feeds[name] for name in self.sa_rows_inputs})
        self.sa_k[S : S + T], self.sa_v[S : S + T] = sa_k[0], sa_v[0]
        self.sa_len = S + T

    def _drop_drafted(self, base: int) -> None:
        self.sa_len = self.tli_len = base

    def _step(self, token: int) -> np.ndarray:
        P = self.sa_len
        return self._run([token], [P], np.ones((1, P + 1), dtype=bool), [0])[0]

    def _tree_step(self, tokens: list[int], positions: list[int], mask: np.ndarray, parent_rows: list) -> np.ndarray:
        return self._run(tokens, positions, mask, list(range(len(tokens))))

    def _feed(self, tokens: list[int]) -> np.ndarray:
        """Known tokens in one causal call (SA, CA and TLI see tokens and earlier rows only), not one per token."""
        P, T = self.sa_len, len(tokens)
        return self._run(tokens, list(range(P, P + T)), _causal_mask(P, T), [T - 1])[0]


class OnnxEagleDrafter(OnnxDrafter):
    """EAGLE: one layer's cache [cap, Hs, Ds] and the last exact target feature (tether.shared.eagle)."""

    kind = "eagle"

    def verified_length(self) -> int:
        return self.n_verified

    def held_rows(self) -> int:
        return self.length

    def _reset(self, capacity: int) -> None:
        self.capacity = capacity
        self.k = np.zeros((capacity, *self.draft_kv), dtype=np.float32)
        self.v = np.zeros_like(self.k)
        self.length = 0
        self.last_feat = np.zeros((1, self.dim), dtype=np.float32)  # [1, dim]
        self.prev_feat = self.last_feat
        self.n_verified = 0

    def _run(self, tokens, positions, mask, logit_rows, prev_feat: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The step graph over new tokens with prev_feat [T, dim]; commits their cache rows.
        Returns logits [R, V] and the predicted features [T, dim]."""
        P, T = self.length, len(tokens)
        self._check_room(P + T)
        feed = {
            "tokens": _ids(tokens),
            "positions": _ids(positions),
            "mask": mask,
            "logit_rows": np.asarray(logit_rows, dtype=np.int64),
            "prev_feat": np.ascontiguousarray(prev_feat, dtype=np.float32)[None],
            "k": self.k[None, :P],
            "v": self.v[None, :P],
        }
        logits, feat, k, v = self._step_session(T, len(logit_rows)).run(None, feed)
        self.k[P : P + T], self.v[P : P + T] = k[0], v[0]
        self.length = P + T
        return logits[0], feat[0]

    def _adopt(self, delta, keep: bool = False) -> None:
        P, n = delta.start, len(delta.tokens)
        if self.n_verified != P:
            raise ValueError(f"delta starts at {P} but {self.n_verified} positions are verified")
        feats = _f32(delta.tensors["hidden"])  # [n, dim]
        held, going_on = self.length, self.prev_feat
        # Re-run the layer over the verified tokens with the exact features, so no drafted feature stays in their
        # rows (rows kept after them were drafted over the drafted ones).
        self.length = P
        prev = np.concatenate([self.last_feat, feats[:-1]])
        self._run(list(delta.tokens), list(range(P, P + n)), _causal_mask(P, n), [], prev)
        self.last_feat = feats[-1:]
        self.prev_feat = self.last_feat
        self.n_verified = P + n
        if keep:
            self.length, self.prev_feat = held, going_on  # the chain drafted after them goes on where it stood

    def _drop_drafted(self, base: int) -> None:
        self.length = base

    def _step(self, token: int) -> np.ndarray:
        P = self.length
        if P == self.n_verified:
            self.prev_feat = self.last_feat  # a new round starts from the last exact feature
        logits, feat = self._run([token], [P], np.ones((1, P + 1), dtype=bool), [0], self.prev_feat)
        self.prev_feat = feat
        return logits[0]

    def _tree_step(self, tokens: list[int], positions: list[int], mask: np.ndarray, parent_rows: list) -> np.ndarray:
        if not parent_rows or parent_rows[0] is None:
            self.row_feat: list[np.ndarray] = []  # a new tree: features of drafted rows, by row offset
            # The root follows the verified text, whose last feature is exact, or a drafted chain, whose last step
            # predicted the feature the next token goes with (as _step would use).
            self.root_feat = self.last_feat if self.length == self.n_verified else self.prev_feat
        prev = np.stack([self.root_feat[0] if r is None else self.row_feat[r] for r in parent_rows])
        logits, feat = self._run(tokens, positions, mask, list(range(len(tokens))), prev)
        self.row_feat += list(feat)
        return logits
