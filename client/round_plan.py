"""What the edge session sends next: a draft round's shape, a pure function of the config, the server's limits and
what the session measured of its rounds.

The wire side is docs/ARCHITECTURE.md, section 5 (DraftRound.parents, ModelInfo.max_tree_nodes); the rounds
themselves are tether.client.rounds.
- `plan_round(cfg, measured, limits, emitted=, length=)` -> Shape: a chain of `k` draft tokens after the root, or
  an EAGLE-2 dynamic tree of at most `tree_nodes` nodes grown `tree_depth` levels deep, `tree_top_k` wide (the
  drafter's draft_tree), where the server takes trees: ModelInfo.max_tree_nodes caps the nodes, and 0 (a server
  that verifies chains only, or one older than trees) means chains whatever `tree` says. The room left (the
  generation's length, the model's context) and the server's max_draft_tokens cap both; a tree's nodes need
  positions too, though only its path stays. Tree children are deterministic top-k picks, which the server's
  lossless check takes as point-mass proposals when no q rows come with them, so a tree round carries no q and
  sampling stays lossless with trees too.
- `tree="auto"` (`use_tree`): a tree while a round waits for its verdict at least RTT_DOMINANCE times as long as
  drafting a chain takes and rounds get as far as a whole chain would at least WHOLE_OFTEN of the time; a chain
  otherwise, and for the first MIN_ROUNDS rounds. A tree costs more draft compute and upload and earns more
  accepted tokens per round, which pays when the round trip, not drafting, sets the pace. The figures (`Measured`)
  are EWMAs (weight EWMA_WEIGHT for the newest): the wait from sending a round to its verdict's arrival (the
  reader thread stamps it, so drafting ahead meanwhile does not count), the drafter's time per step (a chain token
  or a tree level), and whether a round accepted at least the k tokens of a chain. Auto decides on measured times,
  so a seed repeats a sampled text exactly only with `tree` chain or tree.
- `main_branch(parents)`: a tree's favourite path (first children), which a round drafted ahead assumes;
  `lookahead_rows(cfg)`: the drafter cache rows one round may take past the text.
Importing this module imports nothing but the standard library and the session's configuration.

    shape = plan_round(cfg, measured, Limits(max_positions=2048, max_draft_tokens=16, max_tree_nodes=64),
                       emitted=len(tokens), length=len(sequence))

Tests: tests/client/test_round_shape.py (the auto rule, the shapes, main branches).
"""

from __future__ import annotations

from dataclasses import dataclass

from tether.client.session_types import ClientConfig

# auto: a tree once a round waits for its verdict at least this many times as long as drafting a chain takes. A tree
# of the default shape (32 nodes, 12 levels, 3 wide) takes about two and a half chains' drafting for 1.85 times
# a chain's tokens per round (the default models, greedy: tau 9.95 against 5.38), which pays once the wait is several
# chains' drafting long: a link's round trip, not a server on the same host, whose own step makes the wait 1.5 to 3
# chains' drafting (and grows with a tree's nodes on a CPU).
RTT_DOMINANCE = 4.0
WHOLE_OFTEN = 0.5  # auto: ... and at least this share of rounds get as far as a whole chain of k
MIN_ROUNDS = 2  # auto: chains until this many verdicts were measured
EWMA_WEIGHT = 0.25  # weight of the newest figure in each moving average


@dataclass
class Measured:
    """What the session measured of its rounds: EWMAs, each started by its first figure."""

    wait_s: float = 0.0  # from sending a round to its verdict's arrival: the round trip, the server's step included
    step_s: float = 0.0  # the drafter's time per step: a chain token, or a tree level
    whole: float = 0.0  # the share of rounds that accepted at least what a whole chain holds (k tokens)
    rounds: int = 0  # verdicts measured
    waits: int = 0  # of them, those whose wait was measured (not overlapping rounds')
    steps: int = 0  # drafter steps measured

    def drafted(self, seconds: float, steps: int) -> None:
        """`steps` drafter steps took `seconds`."""
        if steps > 0:
            per = seconds / steps
            self.step_s = per if not self.steps else self.step_s + EWMA_WEIGHT * (per - self.step_s)
            self.steps += steps

    def answered(self, wait_s: float | None, whole: bool) -> None:
        """A verdict came `wait_s` after its round was sent (None: an overlapping round's, which queued behind the
        verdict before it, so says nothing of the round trip); `whole`: it accepted a whole chain's worth."""
        if wait_s is not None:
            self.wait_s = wait_s if not self.waits else self.wait_s + EWMA_WEIGHT * (wait_s - self.wait_s)
            self.waits += 1
        self.whole = float(whole) if not self.rounds else self.whole + EWMA_WEIGHT * (float(whole) - self.whole)
        self.rounds += 1


@dataclass(frozen=True)
class Limits:
    """What bounds a round besides the config: the model's context and what the server verifies (ModelInfo)."""

    max_positions: int  # the model's context
    max_draft_tokens: int  # the most draft tokens (or tree nodes) a round may carry
    max_tree_nodes: int  # the most nodes of a draft tree; 0: the server verifies chains only


@dataclass(frozen=True)
class Shape:
    k: int  # a chain's draft tokens, or a tree's depth
    chain_k: int  # the tokens a chain would have drafted (what "accepted whole" measures against)
    tree: bool = False
    nodes: int = 0  # a tree's most draft nodes, the root not counted
    top_k: int = 0  # a tree's width


def use_tree(mode: str, m: Measured, *, k: int, nodes: int, depth: int) -> bool:
    """Whether the next round is a tree: `mode` is ClientConfig.tree; `k` a chain's length as configured (the wait
    is weighed against drafting that many tokens, also when the end of the text leaves room for fewer), `nodes`
    and `depth` what a tree may have now (0 nodes: the server takes chains only)."""
    if mode == "chain" or nodes < 2 or depth < 1:
        return False
    if mode == "tree":
        return True
    if m.rounds < MIN_ROUNDS:
        return False
    return m.wait_s >= RTT_DOMINANCE * max(k, 1) * m.step_s and m.whole >= WHOLE_OFTEN


def plan_round(cfg: ClientConfig, measured: Measured, limits: Limits, *, emitted: int, length: int) -> Shape:
    """The shape of the round after the `emitted`-th generated token, the text (prompt included) `length` long."""
    room = min(cfg.max_new_tokens - emitted - 1, limits.max_positions - length)
    k = max(0, min(cfg.k, room, limits.max_draft_tokens))
    # A tree is verified over all its nodes: they need the positions, though only its path stays.
    nodes = max(0, min(cfg.tree_nodes, limits.max_tree_nodes, limits.max_draft_tokens, limits.max_positions - length))
    depth = max(0, min(cfg.tree_depth, room, nodes))
    if use_tree(cfg.tree, measured, k=cfg.k, nodes=nodes, depth=depth):
        return Shape(depth, k, True, nodes, cfg.tree_top_k)
    return Shape(k, k)


def main_branch(parents: list[int]) -> list[int]:
    """A tree's main branch: node numbers from the root's first child down, each the first child of the one before
    (siblings come by descending drafter score, so it is the drafter's favourite path). parents[i - 1] is node i's
    parent, parents before children."""
    path, node = [], 0
    for i, p in enumerate(parents, start=1):
        if p == node:
            path.append(i)
            node = i
    return path


def lookahead_rows(cfg: ClientConfig) -> int:
    """Drafter cache rows one round may take past the text: a chain's k, or every node a tree expands (the root,
    then up to top_k per further level), and the root and bonus (a round drafted ahead fits in what its guessed
    path will have made text)."""
    tree_rows = 1 + (cfg.tree_depth - 1) * cfg.tree_top_k if cfg.tree != "chain" else 0
    return max(cfg.k, tree_rows) + 2
