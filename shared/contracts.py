"""The contracts between tether's parts: what a target forward needs of a KV cache, what the verifier, rounds and
engines need of a target, what the verifier, the in-process engine and the edge session need of a drafter, and
what the one drafting loop needs of a drafter's caches.

Purpose: each role has several implementations (caches: tether.shared.kv_cache.KVCache, the paged pool's
PagedCache / SlotView / PagedKernelView, the batch views of tether.server.rounds; targets: Transformer and the
tensor-parallel TPTarget; drafters: MoADrafter / EagleDrafter over DrafterBase, the ONNX drafter, the edge's
DeltaGate around one, tensor parallelism's GatherKV; draft backends: the torch drafters' and the ONNX graphs').
Callers are written against these Protocols, not against one implementation, and never probe an object with
getattr / hasattr / isinstance to learn which one it is: a member every implementation has answers (a cache's
`attend` is None where it has no in-place kernel path, a target's `backend` names its attention backend).

Contract: typing.Protocol classes, checked structurally. Static type checkers check the annotated call sites;
tests/shared/test_contracts.py checks every implementation has every member with a compatible signature, so a
member added here and missing from an implementation fails there. Shapes: B rows, T new tokens, L committed
positions, Hq / Hkv query / KV heads, D head dim, V vocabulary, n verified positions.
Torch-free at import (the edge client imports it without torch): tensor types are annotations only.

Run its check: `TRITON_INTERPRET=1 PYTHONSAFEPATH=1 .venv/bin/python -m pytest -q tests/shared/test_contracts.py`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import numpy as np
    import torch
    from torch import Tensor

    from tether.shared.config import ModelConfig
    from tether.shared.drafter import DraftDelta, TargetStates
    from tether.shared.drafter_config import DrafterConfig
    from tether.shared.logits_processing import LogitsProcessing


# ---- KV caches -------------------------------------------------------------------------------------------------


class ForwardCache(Protocol):
    """What one target forward (Transformer.run and each Block) needs of a cache."""

    # Committed positions: default RoPE positions start here. Batch views answer 0 (their positions are given).
    length: int

    def write(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store new rows k, v [B, T, Hkv, D] as pending; return every visible row [B, L + T, Hkv, D] (the keys the
        attention backend then reads)."""
        ...

    def attend(
        self,
        layer: int,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        depth_k: Tensor | None,
        depth_v: Tensor | None,
        *,
        scale: float,
        tree_mask: Tensor | None,
    ) -> Tensor | None:
        """The cache's own in-place attention: store k, v [B, T, Hkv, D] and return the output [B, T, Hq, D] of q
        [B, T, Hq, D] over its rows and depth [B, T, E, Hkv, D] (a paged kernel reading the pool through block
        tables); None when it has no such path, and the model then calls `write` and its attention backend."""
        ...


def gathering_attend(
    self: ForwardCache,
    layer: int,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    depth_k: Tensor | None,
    depth_v: Tensor | None,
    *,
    scale: float,
    tree_mask: Tensor | None,
) -> None:
    """ForwardCache.attend of a cache with no in-place kernel path (a contiguous KVCache, a pool sequence, the
    gathering views): None, so the model writes the rows and runs its attention backend over the keys `write`
    returns. Such a cache takes it as its member: `attend = gathering_attend`."""
    return None


class SequenceCache(ForwardCache, Protocol):
    """One sequence's cache (batch 1), as a SequenceVerifier owns it: committed rows [0, length), pending rows
    written by a forward until the caller commits them."""

    capacity: int  # positions it may ever hold

    def reserve(self, n: int) -> None:
        """Make room for n rows past `length` now (a paged cache takes its blocks; ValueError past `capacity`)."""
        ...

    def advance(self, n: int) -> None:
        """Commit the first n pending rows (prefill, plain decoding)."""
        ...

    def accept(self, path: Tensor | list[int]) -> None:
        """Commit the pending rows at increasing offsets `path`, moved to consecutive positions (a tree's path)."""
        ...

    def truncate(self, n: int) -> None:
        """Forget positions n and on (a resync)."""
        ...

    def release(self) -> None:
        """Give the memory back (a paged cache returns its blocks); nothing for contiguous memory."""
        ...


# ---- targets ---------------------------------------------------------------------------------------------------


@dataclass
class ForwardOutput:
    """What a target forward returns (Transformer.run and every Target's): a record, here beside the Protocols
    that name it so the model and its contracts need not import each other."""

    logits: Tensor  # [B, T, V] (or [B, 1, V] with last_only)
    k: Tensor | None  # [n_layers, B, T, Hkv, D] each layer's attention keys (after RoPE) for the new positions
    v: Tensor | None  # [n_layers, B, T, Hkv, D]
    hidden: tuple[Tensor, ...]  # the requested hidden states, each [B, T, dim]
    # With return_depth: the depth K/V every block but the last wrote, [B, T, depth_len(n_layers - 1), Hkv, D]
    # each, position-major in layer order (None for a plain target)
    depth: tuple[Tensor, Tensor] | None = None


class Target(Protocol):
    """What the verifier, the rounds, the step runner's callers and the engines need of a target model."""

    cfg: ModelConfig  # a tensor-parallel target's is its shard's (heads and ffn_dim divided by the world size)
    backend: str  # attention backend name: "reference" | "sdpa" | "triton" (tether.shared.attention)
    tp: tuple[int, int]  # (rank, world size); (0, 1) when not tensor-parallel

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype:
        """The weights' dtype: what a KV pool for this target holds."""
        ...

    def run(
        self,
        input_ids: Tensor,
        *,
        cache: ForwardCache | None = None,
        positions: Tensor | None = None,
        tree_mask: Tensor | None = None,
        hidden_layers: Sequence[int] = (),
        return_kv: bool = False,
        last_only: bool = False,
    ) -> ForwardOutput:
        """One forward over new tokens input_ids [B, T]; positions [T] or [B, T]; tree_mask [B, T, T] or, through a
        gathering view, [B, T, L + T]. See tether.shared.model.Transformer.run."""
        ...

    def prefill(self, input_ids: Tensor, cache: SequenceCache, **kw: Any) -> ForwardOutput:
        """`run`, then commit all T rows (cache.advance(T))."""
        ...

    def verify(self, input_ids: Tensor, cache: SequenceCache, **kw: Any) -> ForwardOutput:
        """`run` with the new rows left pending for the caller to commit."""
        ...

    def new_cache(self, batch_size: int = 1, capacity: int | None = None) -> SequenceCache:
        """A contiguous cache of its own (a SequenceVerifier without a pool)."""
        ...


# ---- drafters --------------------------------------------------------------------------------------------------


class DeltaLike(Protocol):
    """A delta as a drafter's begin / commit take it: verified positions [start, start + len(tokens)). Its payload
    is the implementation's: DraftDelta / ArrayDelta carry `tensors`, the edge's WireDelta undecoded bytes."""

    start: int
    tokens: list[int]


class ServerDrafter(Protocol):
    """A drafter's server part, all the verifier, the rounds and the step runner ask of it."""

    dcfg: DrafterConfig

    def server_delta(self, states: TargetStates, start: int, tokens: list[int]) -> DraftDelta:
        """The delta of n verified positions from the target's states (k, v [L, n, Hkv, D], hidden [n, dim]):
        MoA's LSA vectors and TLI K/V, EAGLE's hidden states; position-wise (POSITION_AXIS)."""
        ...


class Drafter(Protocol):
    """The client side's drafting loop (tether.shared.draft_loop's docstring), as the in-process engine, the edge
    session and its rounds drive it: the torch drafters, the ONNX one, and the edge's DeltaGate around one.
    q_ids / q_probs are torch tensors or numpy arrays [k, min(support, V)] by implementation; draft_tree gives a
    DraftTree (torch) or a TreeDraft of plain lists (ONNX)."""

    # The delta is positional only: the edge's gate names it `wire` (its undecoded form).
    def begin(self, delta: DeltaLike, /, capacity: int | None = None) -> None:
        """Start from the prompt's delta (start 0), caches sized `capacity` positions."""
        ...

    def commit(self, delta: DeltaLike, /, keep_drafts: bool = False) -> bool:
        """Adopt the verified states of a round's root and accepted drafts; whether rows drafted after them stayed."""
        ...

    def draft(
        self,
        root: int,
        k: int,
        *,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        support: int = 8,
        stop: Callable[[], bool] | None = None,
        generator: Any = None,
        min_p: float = 0.0,
        processing: LogitsProcessing | None = None,
        logits_seen: Callable[[np.ndarray], None] | None = None,
    ) -> tuple[list[int], Any, Any]:
        """A chain of up to k tokens after `root`: (tokens, q_ids, q_probs), the q's None when greedy."""
        ...

    def draft_tree(
        self, root: int, *, depth: int, top_k: int, total_tokens: int, processing: LogitsProcessing | None = None
    ) -> Any:
        """An EAGLE-2 dynamic tree after `root` of at most `total_tokens` nodes; its rows are dropped again."""
        ...

    def feed(self, tokens: list[int], processing: LogitsProcessing | None = None) -> int | None:
        """Step over tokens already decided as drafted rows; the argmax after the last (None for none)."""
        ...

    def discard_drafts(self) -> None:
        """Drop the rows of drafts never answered (a lost round)."""
        ...

    def verified_length(self) -> int:
        """Verified positions the caches hold (where the next delta starts)."""
        ...


class DraftBackend(Protocol):
    """What the one drafting loop (tether.shared.draft_loop.DraftLoop) needs of a drafter's caches and forward: the
    torch drafters' (tether.shared.drafter_runtime.TorchDraftBackend) and the ONNX graphs'
    (tether.client.onnx_backends). The caches hold rows [0, rows()): the verified positions [0, verified_length()),
    then drafted ones. Logits come back as numpy float32 arrays, whatever the backend computes them on."""

    vocab_size: int  # V

    def begin(self, capacity: int | None) -> None:
        """Fresh, empty caches for `capacity` positions (None: the model's max_seq_len)."""
        ...

    def commit(self, delta: DeltaLike, keep: bool) -> None:
        """Take the verified states of positions [delta.start, delta.start + n) (start == verified_length()). Without
        `keep` the rows held after them are dropped and the next step follows them; with it they stay as drafted
        and the next step follows them (the loop asks only when rows past the delta are held)."""
        ...

    def step(self, token: int) -> np.ndarray:
        """Feed one token at the next row; the logits [V] for the token after it."""
        ...

    def feed(self, tokens: list[int]) -> np.ndarray:
        """Feed known tokens at the next rows (in one causal call where the drafter can); logits [V] after the last."""
        ...

    def tree_step(
        self, tokens: list[int], positions: list[int], mask: np.ndarray, parent_rows: list[int | None]
    ) -> np.ndarray:
        """Feed F tree nodes as new rows at once: `mask` [F, rows() + F] bool says which rows each sees, `parent_rows`
        each node's parent's row offset after the tree's first row (None for the root's children); logits [F, V]."""
        ...

    def rows(self) -> int:
        """Rows held: the verified positions and the drafted ones after them."""
        ...

    def verified_length(self) -> int:
        """Verified positions held (where the next delta starts)."""
        ...

    def drop(self, rows: int) -> None:
        """Keep the first `rows` rows (>= verified_length()), forget the drafted ones after them."""
        ...

    def sampler(self, generator: Any) -> Callable[[np.ndarray], int]:
        """How a sampled draft draws from its proposal q [w] (fp32, sums to 1): an index into q, from the random
        stream `generator` gives (a torch.Generator for torch, a numpy Generator or an int seed for ONNX)."""
        ...


class SpeculativeDrafter(Drafter, ServerDrafter, Protocol):
    """Both halves in one process: what tether.server.engine.SpeculativeEngine drives (MoADrafter, EagleDrafter)."""
