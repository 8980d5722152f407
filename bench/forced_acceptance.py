"""Replayed acceptance (bench only): every verdict's accepted length forced to a draw from a recorded distribution.

A target with random weights accepts almost no draft, yet a verify step's cost depends on shapes, not values: so
bench/capacity.py measures a 1B- or 8B-shaped target with a trained model's acceptance by letting the server verify
as usual, then replacing each verdict's accepted path by one of a length drawn from a histogram recorded from the
trained target on held-out prompts (bench/traces.py `--acceptance`). The KV of the forced path's nodes was computed
by the same step (as for any accepted draft), so the commit, the drafter's delta and the verdict sent are those of a
round that accepted that many drafts; the bonus stays the target's own verdict's (with random weights the text means
nothing, only lengths count).

Contract:
- `AcceptanceHistogram(counts)`: counts[a] = rounds that accepted a drafts (a = 0 .. k). `draw(rng, depth)` is a
  length drawn with those weights, capped at the tree's depth (a round with fewer drafts cannot accept more);
  `tau` is the histogram's tokens per round, sum (a + 1) counts[a] / sum counts[a].
- `ForcedAcceptance(histogram, seed)`, a context manager: inside it, in this process, the verdicts
  tether.server.rounds decides (its module-level `unpack_verdicts` and `verify_rows`, through which every round of a
  Session, of server-draft decoding and of plain decoding goes) are forced; on exit they are the server's again. A
  one-node tree (plain decoding's step) has nothing to force and keeps its verdict; a row that failed keeps its
  error. `rounds` / `accepted` count the forced rounds (those with drafts) and `tau` their tokens per round.
- Nothing else turns it on: no flag of `tether-server`, no ServeConfig field, no environment variable, so a
  production server cannot run with it by accident. Against a server in another process (capacity's --target) it
  cannot apply, and the bench refuses to pretend it did.

    with ForcedAcceptance(AcceptanceHistogram([40, 25, 15, 10, 6, 4]), seed=0) as forced:
        ...  # serve rounds; forced.tau is what they gained

Tested by tests/server/test_bench_capacity.py (the forced lengths follow the histogram; a bonus and errors kept).
"""

from __future__ import annotations

import random
import threading
from collections.abc import Sequence

from tether.server import rounds
from tether.shared.speculative import DraftTree, Verdict


class AcceptanceHistogram:
    """Per-round accepted lengths recorded from a trained target (see the module docstring)."""

    def __init__(self, counts: Sequence[int]):
        if not counts or min(counts) < 0 or not sum(counts):
            raise ValueError(f"an acceptance histogram needs non-negative counts, some of them > 0, got {counts}")
        self.counts = list(counts)

    @property
    def k(self) -> int:
        return len(self.counts) - 1

    @property
    def tau(self) -> float:
        return sum((a + 1) * n for a, n in enumerate(self.counts)) / sum(self.counts)

    def draw(self, rng: random.Random, depth: int) -> int:
        return min(depth, rng.choices(range(len(self.counts)), weights=self.counts)[0])


def forced_path(tree: DraftTree, accepted: int) -> list[int]:
    """A root-to-node path of `accepted` drafts: the first child at each level (a chain's first `accepted` nodes)."""
    path = [0]
    for _ in range(accepted):
        children = tree.children(path[-1])
        if not children:
            break
        path.append(children[0])
    return path


def depth(tree: DraftTree) -> int:
    return len(forced_path(tree, len(tree))) - 1


class ForcedAcceptance:
    """The verdicts of tether.server.rounds forced to the histogram's lengths while entered (module docstring)."""

    def __init__(self, histogram: AcceptanceHistogram, seed: int = 0):
        self.histogram = histogram
        self.rng = random.Random(seed)
        self.lock = threading.Lock()  # the batcher's thread and the model threads verify
        self.rounds = self.accepted = 0
        self._saved = None

    @property
    def tau(self) -> float:
        return (self.accepted + self.rounds) / self.rounds if self.rounds else 0.0

    def force(self, trees: Sequence[DraftTree], verdicts: list) -> list:
        out = []
        with self.lock:
            for tree, v in zip(trees, verdicts, strict=False):
                if isinstance(v, Exception) or len(tree) < 2:
                    out.append(v)
                    continue
                path = forced_path(tree, self.histogram.draw(self.rng, depth(tree)))
                self.rounds += 1
                self.accepted += len(path) - 1
                out.append(Verdict(path, v.bonus))
        return out + list(verdicts[len(out) :])

    def __enter__(self) -> ForcedAcceptance:
        if self._saved is not None:
            raise RuntimeError("ForcedAcceptance is already entered")
        unpack, verify = self._saved = rounds.unpack_verdicts, rounds.verify_rows

        def unpack_verdicts(trees, packed, *args, **kw):
            return self.force(trees, unpack(trees, packed, *args, **kw))

        def verify_rows(trees, *args, **kw):
            return self.force(trees, verify(trees, *args, **kw))

        rounds.unpack_verdicts, rounds.verify_rows = unpack_verdicts, verify_rows
        return self

    def __exit__(self, *exc) -> None:
        rounds.unpack_verdicts, rounds.verify_rows = self._saved
        self._saved = None
