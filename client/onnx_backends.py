"""The onnxruntime draft backends: an exported drafter's caches and graph calls, for the one drafting loop.

Purpose: OnnxMoABackend and OnnxEagleBackend are tether.shared.contracts.DraftBackends over the graphs
tether.server.onnx_export writes (MoA with any TLI N, and EAGLE); tether.shared.draft_loop.DraftLoop drafts over
them (tether.client.onnx_drafter.OnnxDrafter loads the graphs and builds one). They give the torch drafters' rows
and logits (tether.shared.drafter_runtime.TorchDraftBackend) over the same deltas. numpy and onnxruntime only,
never torch.

Contract (the Protocol's, and):
- Caches are numpy buffers sized `capacity` rows; each graph call takes the committed rows and returns the new ones
  (onnx_export's docstring has the graph contract), so dropping drafted rows is just a shorter length.
- A delta is anything with .start, .tokens and .tensors ({"lsa", "tli_k", "tli_v"} or {"hidden"}) whose tensors are
  numpy arrays or torch tensors (converted through their own methods, so torch is not imported here):
  tether.shared.drafter.DraftDelta, or ArrayDelta built from tether.shared.wire.decode_many.
- `commit(delta, keep=True)` gives the delta's positions their verified states and leaves the rows after them as
  drafted: MoA recomputes their SA rows (as a plain commit does: the step graph drafted them, and sa_rows' sums
  round otherwise, so verified rows would depend on how they were drafted) and takes the TLI K/V from the delta;
  EAGLE re-runs its layer over them with the exact features and goes on from the feature the kept chain predicted.
- Beside the graphs described, sessions derived from the step graph at load (tether.client.onnx_derived) serve where
  they exist: one-token draft steps run on `step1` (its token and logit-row axes fixed at 1), the levels of a tree
  `tree_width` wide on `tree` (both fixed at that width), and MoA's SA rows of verified tokens (the prompt at begin,
  an adopted delta's tokens) come from `sa_rows` (the step graph pruned to them), not from a run of the whole step
  graph. Without them the step graph serves every call.
- `sampler(generator)` draws with numpy: `generator` a np.random.Generator (one stream across rounds) or an int seed
  (a new stream every call), the same truncated distributions as the torch backend, not the same random stream.

Tests: tests/client/test_onnx_backend.py (parity with torch, a run with torch blocked), tests/client/test_round_shape.py
(the caches after rounds drafted ahead, trees and kept drafts) and tests/client/test_onnx_derived.py.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from tether.client.onnx_bounds import BoundedSession
from tether.shared.contracts import DeltaLike


def _f32(x: Any) -> np.ndarray:
    """A delta tensor as fp32 numpy; a torch tensor (bf16 included) goes through its own methods."""
    if hasattr(x, "detach"):
        x = x.detach().cpu().float().numpy()
    return np.ascontiguousarray(x, dtype=np.float32)


def _causal_mask(past: int, t: int) -> np.ndarray:
    """[t, past + t] bool: every committed row, then the new rows causally."""
    mask = np.ones((t, past + t), dtype=bool)
    mask[:, past:] = np.tri(t, dtype=bool)
    return mask


def _ids(xs: list[int]) -> np.ndarray:
    return np.asarray([xs], dtype=np.int64)  # [1, T]


class OnnxBackend:
    """What both kinds share: the description's shapes, the sessions and which one runs a call, the room check, the
    sampler and a feed of one step per token. Each kind provides the rest of the Protocol over its caches."""

    kind = ""

    def __init__(
        self, manifest: dict, sessions: Mapping[str, BoundedSession], keep: list | None = None, tree_width: int = 0
    ):
        self.manifest = manifest
        sh = manifest["shapes"]
        self.vocab_size, self.dim, self.max_seq_len = sh["vocab_size"], sh["dim"], sh["max_seq_len"]
        self.draft_kv = (sh["draft_kv_heads"], sh["draft_head_dim"])  # (Hs, Ds)
        self.target_kv = (sh["target_kv_heads"], sh["target_head_dim"])  # (Hkv, D)
        self.sessions = dict(sessions)
        self._keep = keep  # the external weights the sessions read
        self.tree_width = tree_width if "tree" in self.sessions else 0  # the T (= R) the `tree` session is fixed at
        self.capacity = 0

    def sampler(self, generator: np.random.Generator | int | None) -> Callable[[np.ndarray], int]:
        rng = np.random.default_rng(generator)
        return lambda q: int(rng.choice(q.size, p=q.astype(np.float64) / q.sum(dtype=np.float64)))

    def feed(self, tokens: list[int]) -> np.ndarray:
        """Logits [V] after the last of `tokens`: one step each (MoA feeds them in one call)."""
        for t in tokens:
            logits = self.step(t)
        return logits

    def _step_session(self, T: int, R: int) -> BoundedSession:
        """The session that runs the step graph for T new tokens and R logit rows: `step1` for one token's logits,
        `tree` for a tree level as wide as it was derived for, where they were (module docstring)."""
        if T == 1 and R == 1:
            return self.sessions.get("step1", self.sessions["step"])
        if T == R == self.tree_width:
            return self.sessions["tree"]
        return self.sessions["step"]

    def _check_room(self, end: int) -> None:
        if end > self.capacity:
            raise ValueError(f"drafter cache full: {end} positions needed, capacity {self.capacity}")


class OnnxMoABackend(OnnxBackend):
    """MoA: SA cache [cap, Hs, Ds], CA context K/V [cap, Hs, Ds], TLI caches [N, cap, Hkv, D]."""

    kind = "moa"

    def __init__(
        self, manifest: dict, sessions: Mapping[str, BoundedSession], keep: list | None = None, tree_width: int = 0
    ):
        super().__init__(manifest, sessions, keep, tree_width)
        self.tli = manifest["shapes"]["tli"]
        self.step_inputs = manifest["graphs"]["step"]["inputs"]
        rows = self.sessions.get("sa_rows")
        self.sa_rows_inputs = [a.name for a in rows.get_inputs()] if rows is not None else []

    def verified_length(self) -> int:
        return self.n_ctx

    def rows(self) -> int:
        return self.sa_len

    def begin(self, capacity: int | None) -> None:
        self.capacity = capacity = capacity or self.max_seq_len
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

    def commit(self, delta: DeltaLike, keep: bool) -> None:
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

    def drop(self, rows: int) -> None:
        self.sa_len = self.tli_len = rows

    def step(self, token: int) -> np.ndarray:
        P = self.sa_len
        return self._run([token], [P], np.ones((1, P + 1), dtype=bool), [0])[0]

    def tree_step(
        self, tokens: list[int], positions: list[int], mask: np.ndarray, parent_rows: list[int | None]
    ) -> np.ndarray:
        return self._run(tokens, positions, mask, list(range(len(tokens))))

    def feed(self, tokens: list[int]) -> np.ndarray:
        """Known tokens in one causal call (SA, CA and TLI see tokens and earlier rows only), not one per token."""
        P, T = self.sa_len, len(tokens)
        return self._run(tokens, list(range(P, P + T)), _causal_mask(P, T), [T - 1])[0]


class OnnxEagleBackend(OnnxBackend):
    """EAGLE: one layer's cache [cap, Hs, Ds] and the last exact target feature (tether.shared.eagle)."""

    kind = "eagle"

    def verified_length(self) -> int:
        return self.n_verified

    def rows(self) -> int:
        return self.length

    def begin(self, capacity: int | None) -> None:
        self.capacity = capacity = capacity or self.max_seq_len
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

    def commit(self, delta: DeltaLike, keep: bool) -> None:
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

    def drop(self, rows: int) -> None:
        self.length = rows

    def step(self, token: int) -> np.ndarray:
        P = self.length
        if P == self.n_verified:
            self.prev_feat = self.last_feat  # a new round starts from the last exact feature
        logits, feat = self._run([token], [P], np.ones((1, P + 1), dtype=bool), [0], self.prev_feat)
        self.prev_feat = feat
        return logits[0]

    def tree_step(
        self, tokens: list[int], positions: list[int], mask: np.ndarray, parent_rows: list[int | None]
    ) -> np.ndarray:
        if not parent_rows or parent_rows[0] is None:
            self.row_feat: list[np.ndarray] = []  # a new tree: features of drafted rows, by row offset
            # The root follows the verified text, whose last feature is exact, or a drafted chain, whose last step
            # predicted the feature the next token goes with (as `step` would use).
            self.root_feat = self.last_feat if self.length == self.n_verified else self.prev_feat
        prev = np.stack([self.root_feat[0] if r is None else self.row_feat[r] for r in parent_rows])
        logits, feat = self._run(tokens, positions, mask, list(range(len(tokens))), prev)
        self.row_feat += list(feat)
        return logits
