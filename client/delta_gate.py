"""The KV deltas the server sends, checked against what the session allows before a byte is decompressed.

A delta (after a round, after a resync, or for the prompt) fills the drafter's caches with the target's states
of newly verified positions. The server decides its every field, so the client takes one only when:
- it starts at the drafter's verified length (0 for the prompt's first part);
- its tokens are the client's own at those positions, a prefix of what the session could have had verified
  there (the prompt, the root and the drafts just sent, the offline text being resynced): so it covers at
  least one position and at most that many (k + 1 after a round, the piece after a resync, the prompt);
- its bundle (tether.shared.codecs) declares at most that many positions' worth of bytes in all, and names
  exactly the tensors of the drafter's layout, each in a float dtype and with exactly the shape the layout
  gives n positions: MoA "lsa" [n, dim], "tli_k" / "tli_v" [N, n, Hkv, D]; EAGLE "hidden" [n, dim]
  (`server_delta` of tether.shared.moa / tether.shared.eagle);
- its values are finite.
Only then is it decoded, each tensor's decompression bounded by its checked shape, into numpy arrays
(tether.shared.wire, no torch: bfloat16 widened exactly to float32); the drafter gets an ArrayDelta (the torch
drafters convert it as they adopt it).

Contract:
- `DeltaLayout.for_config(cfg, dcfg)`: `layout.shapes(n)` -> {name: shape}, `layout.max_bytes(n)`.
- `frames_problem(frames, layout, n)` -> what is wrong with parsed headers ({name: (dtype, shape)}, from
  tether.shared.wire.parse_many), or None.
- `WireDelta(start, tokens, payload)`: a delta as it arrived, not decoded; `wire_delta(kv)` one from a KVDelta.
- `DeltaGate(drafter, layout, coverable, refuse)`: the drafter as the session drives it. `begin(wire)` and
  `commit(wire)` check, decode and hand an ArrayDelta to the drafter; `coverable(start)` lists the tokens a delta
  starting at `start` may cover; a delta refused raises `refuse(message)` (the session decides whether that is
  a lost round or the end of the generation) and leaves the drafter's caches as they were. `draft` and `draft_tree`
  refuse a root outside the vocabulary (ServerDataError, Problem.TOKEN): only the server hands the client such a
  token.
  Every other attribute is the drafter's.

    gate = DeltaGate(drafter, DeltaLayout.for_config(cfg, dcfg), lambda start: sequence[start:], refuse)
    gate.commit(WireDelta(kv.start, list(kv.tokens), kv.payload))
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from tether.client.errors import Problem, ServerDataError
from tether.shared.config import ModelConfig
from tether.shared.contracts import Drafter
from tether.shared.drafter_config import POSITION_AXIS, ArrayDelta, DrafterConfig
from tether.shared.logits_processing import LogitsProcessing
from tether.shared.wire import CodecError, parse_many, values

DELTA_DTYPES = {"float32": 4, "bfloat16": 2, "float16": 2}  # what a delta's tensors may travel as


@dataclass(frozen=True)
class DeltaLayout:
    """The tensors a drafter's delta carries: name -> shape with the positions axis left out."""

    rows: dict[str, tuple[int, ...]]  # e.g. {"lsa": (dim,), "tli_k": (N, Hkv, D), ...}
    vocab_size: int

    @classmethod
    def for_config(cls, cfg: ModelConfig, dcfg: DrafterConfig) -> DeltaLayout:
        if dcfg.kind == "eagle":
            rows = {"hidden": (cfg.dim,)}
        else:
            kv = (dcfg.tli, cfg.n_kv_heads, cfg.head_dim)
            rows = {"lsa": (cfg.dim,), "tli_k": kv, "tli_v": kv}
        return cls(rows, cfg.vocab_size)

    def shapes(self, n: int) -> dict[str, tuple[int, ...]]:
        """Each tensor's exact shape for n positions (the positions axis where server_delta puts it)."""
        out = {}
        for name, rest in self.rows.items():
            axis = POSITION_AXIS[name]
            out[name] = (*rest[:axis], n, *rest[axis:])
        return out

    def max_bytes(self, n: int) -> int:
        """The most a delta of n positions may declare: every tensor in the widest dtype accepted."""
        return n * max(DELTA_DTYPES.values()) * sum(math.prod(rest) for rest in self.rows.values())


def frames_problem(frames: Mapping[str, tuple[str, tuple[int, ...]]], layout: DeltaLayout, n: int) -> str | None:
    """What is wrong with a delta's parsed headers ({name: (dtype, shape)}) for n positions; None if nothing."""
    want = layout.shapes(n)
    if set(frames) != set(want):
        return f"tensors {sorted(name[:40] for name in frames)[:4]}, the drafter takes {sorted(want)}"
    for name, (dtype, shape) in frames.items():
        if dtype not in DELTA_DTYPES:
            return f"tensor {name!r} is {dtype}, not a float dtype the drafter takes"
        if tuple(shape) != want[name]:
            return f"tensor {name!r} has shape {list(shape)}, {n} positions take {list(want[name])}"
    return None


@dataclass(frozen=True)
class WireDelta:
    """A KV delta as received: positions [start, start + len(tokens)), its bundle not decoded."""

    start: int
    tokens: list[int]
    payload: bytes


def wire_delta(kv) -> WireDelta:
    """A KVDelta message (tether.v1) as it arrived: the gate checks it before decoding it."""
    return WireDelta(start=kv.start, tokens=list(kv.tokens), payload=kv.payload)


class DeltaGate:
    """A drafter that takes WireDelta and refuses what the session does not allow (see the module docstring)."""

    def __init__(
        self,
        drafter: Drafter,
        layout: DeltaLayout,
        coverable: Callable[[int], list[int]],
        refuse: Callable[[str], Exception],
    ):
        self.inner = drafter
        self.layout = layout
        self.coverable = coverable
        self.refuse = refuse
        self.begun = False

    def __getattr__(self, name: str):
        if name == "inner":  # not set yet: no recursion while __init__ runs
            raise AttributeError(name)
        return getattr(self.inner, name)

    def begin(self, wire: WireDelta, capacity: int | None = None) -> None:
        """Start from the prompt's (first) delta, which must start at position 0."""
        self.inner.begin(self._admit(wire, 0), capacity=capacity)
        self.begun = True

    def commit(self, wire: WireDelta, keep_drafts: bool = False) -> bool:
        """The drafter's commit of the admitted delta; whether it kept the rows drafted after it."""
        if not self.begun:
            raise self.refuse("a delta arrived before the prompt's")
        return self.inner.commit(self._admit(wire, self.inner.verified_length()), keep_drafts=keep_drafts)

    def draft(self, root: int, k: int, **kwargs):
        self._check_root(root)
        return self.inner.draft(root, k, **kwargs)

    def draft_tree(self, root: int, **kwargs):
        self._check_root(root)
        return self.inner.draft_tree(root, **kwargs)

    # The rest of the Drafter contract, passed through: nothing in them comes from the server.

    def feed(self, tokens: list[int], processing: LogitsProcessing | None = None) -> int | None:
        return self.inner.feed(tokens, processing=processing)

    def discard_drafts(self) -> None:
        self.inner.discard_drafts()

    def verified_length(self) -> int:
        return self.inner.verified_length()

    def _check_root(self, root: int) -> None:
        if not 0 <= root < self.layout.vocab_size:
            raise ServerDataError(Problem.TOKEN, f"token {root} is outside the vocabulary of {self.layout.vocab_size}")

    def _admit(self, wire: WireDelta, held: int) -> ArrayDelta:
        """The decoded delta, or `refuse` raised; nothing is decompressed before the checks pass."""
        if wire.start != held:
            raise self.refuse(f"it starts at position {wire.start}, the drafter holds {held} verified positions")
        n = len(wire.tokens)
        allowed = self.coverable(held)
        if not 0 < n <= len(allowed) or list(wire.tokens) != allowed[:n]:
            raise self.refuse(
                f"its {n} tokens at position {held} are not the client's (it may cover up to {len(allowed)} of them)"
            )
        try:
            frames = parse_many(wire.payload, max_nbytes=self.layout.max_bytes(n))
        except CodecError as e:
            raise self.refuse(str(e)) from None
        problem = frames_problem({name: (e.dtype, e.shape) for name, e in frames.items()}, self.layout, n)
        if problem:
            raise self.refuse(problem)
        tensors = {}
        for name, e in frames.items():
            try:
                tensors[name] = values(e)
            except CodecError as err:
                raise self.refuse(f"tensor {name!r}: {err}") from None
            if not np.isfinite(tensors[name]).all():
                raise self.refuse(f"tensor {name!r} holds values that are not finite")
        return ArrayDelta(held, list(wire.tokens), tensors)
