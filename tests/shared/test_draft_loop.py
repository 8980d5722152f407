"""The drafting loop's rules over a scripted backend (tether.shared.draft_loop), apart from any model.

- begin takes the prompt's delta only; commit keeps drafted rows only when asked and rows past the delta are held,
  and says whether it kept them; discard_drafts goes back to the verified rows.
- A greedy chain is the argmax after each token; a sampled one draws through the backend's sampler from the
  top-`support` proposal and returns those proposals, [k, min(support, V)] also for k = 0; `stop` ends a chain
  early; each position is processed (penalties) after the tokens drafted before it.
- feed steps over known tokens and gives the argmax after them (None for none).
- A tree level hands the backend a mask where each node sees the rows held, its ancestors' rows and itself; the
  tree's rows are dropped again, and its nodes are each parent's best children.

The backends themselves (torch, ONNX) are held to the same drafts in tests/client/test_onnx_backend.py.
"""

import numpy as np
import pytest

from tether.shared.draft_loop import DraftLoop
from tether.shared.drafter_config import ArrayDelta
from tether.shared.logits_processing import SamplingControls

V = 6


def next_logits(token: int) -> np.ndarray:
    """The scripted drafter's logits after `token`: its pair (token ^ 1) first, token + 2 (mod V) second, the rest
    after; a greedy chain swings between a pair."""
    logits = np.zeros(V, dtype=np.float32)
    logits[token ^ 1], logits[(token + 2) % V] = 3.0, 2.0
    return logits


class Scripted:
    """A DraftBackend whose rows are the tokens fed and whose logits depend on the last token alone."""

    vocab_size = V

    def __init__(self):
        self.held: list[int] = []
        self.verified = 0
        self.commits: list[bool] = []  # each commit's keep
        self.masks: list[np.ndarray] = []
        self.draws: list[np.ndarray] = []

    def begin(self, capacity):
        self.held, self.verified = [], 0

    def commit(self, delta, keep):
        end = delta.start + len(delta.tokens)
        self.held = self.held[: delta.start] + list(delta.tokens) + (self.held[end:] if keep else [])
        self.verified = end
        self.commits.append(keep)

    def step(self, token):
        self.held.append(token)
        return next_logits(token)

    def feed(self, tokens):
        self.held += tokens
        return next_logits(tokens[-1])

    def tree_step(self, tokens, positions, mask, parent_rows):
        assert mask.shape == (len(tokens), len(self.held) + len(tokens))
        self.masks.append(mask)
        self.held += tokens
        return np.stack([next_logits(t) for t in tokens])

    def rows(self):
        return len(self.held)

    def verified_length(self):
        return self.verified

    def drop(self, rows):
        self.held = self.held[:rows]

    def sampler(self, generator):
        def draw(q):
            self.draws.append(q)
            return len(q) - 1  # the least probable token kept: a draw no argmax would give

        return draw


def delta(start: int, tokens: list[int]) -> ArrayDelta:
    return ArrayDelta(start, tokens, {})


@pytest.fixture
def loop():
    loop = DraftLoop(Scripted())
    loop.begin(delta(0, [0, 1, 2]))
    return loop


def test_begin_takes_the_prompts_delta_and_commit_keeps_drafts_only_past_the_delta(loop):
    with pytest.raises(ValueError, match="position 0"):
        DraftLoop(Scripted()).begin(delta(2, [1]))
    backend = loop.backend
    assert (backend.held, loop.verified_length(), backend.commits) == ([0, 1, 2], 3, [False])
    assert loop.draft(3, 3)[0] == [2, 3, 2]  # rows 3, 4, 5 hold 3, 2, 3
    assert loop.commit(delta(3, [3, 2]), keep_drafts=True)  # row 5 is past the delta: kept
    assert backend.held == [0, 1, 2, 3, 2, 3] and loop.verified_length() == 5
    assert not loop.commit(delta(5, [3]), keep_drafts=True)  # nothing past it
    loop.draft(0, 2)
    assert not loop.commit(delta(6, [0]))  # not asked
    assert backend.held == [0, 1, 2, 3, 2, 3, 0] and backend.commits == [False, True, False, False]
    loop.draft(0, 2)
    loop.discard_drafts()
    assert backend.held == [0, 1, 2, 3, 2, 3, 0]


def test_greedy_and_sampled_chains(loop):
    assert loop.draft(2, 4) == ([3, 2, 3, 2], None, None)
    loop.discard_drafts()
    tokens, q_ids, q_probs = loop.draft(2, 3, temperature=1.0, support=2)
    draws = loop.backend.draws
    assert len(draws) == 3 and tokens == [4, 0, 2]  # each the second of the two kept: the sampler's pick
    assert q_ids.tolist() == [[3, 4], [5, 0], [1, 2]] and q_ids.dtype == np.int64 and q_probs.dtype == np.float32
    assert np.allclose(q_probs.sum(-1), 1) and all(np.array_equal(q, d) for q, d in zip(q_probs, draws, strict=True))
    loop.discard_drafts()
    for k, support in ((0, 3), (0, 10)):
        tokens, q_ids, q_probs = loop.draft(2, k, temperature=1.0, support=support)
        assert tokens == [] and q_ids.shape == q_probs.shape == (0, min(support, V))


def test_a_chain_stops_when_asked_and_each_position_is_processed_after_the_tokens_before_it(loop):
    asked = []
    assert loop.draft(2, 4, stop=lambda: asked.append(1) or len(asked) == 2)[0] == [3, 2]
    loop.discard_drafts()
    assert loop.draft(0, 4)[0] == [1, 0, 1, 0]
    loop.discard_drafts()
    # Penalties (4 in all) wider than the favourite's lead over the rest: a token drafted once is not drafted again.
    processing = SamplingControls(presence_penalty=2.0, frequency_penalty=2.0).processing([0, 1, 2], 3, V)
    seen: list[np.ndarray] = []
    tokens, _, _ = loop.draft(0, 4, processing=processing, logits_seen=seen.append)
    assert tokens == [1, 0, 2, 3]
    assert len(seen) == 4 and np.array_equal(seen[0], next_logits(0)) and seen[0].dtype == np.float64
    assert seen[2][1] == 3.0 - 4  # the third position (after 0) sees the 1 drafted at the first


def test_feed_steps_over_known_tokens(loop):
    assert loop.feed([]) is None
    assert loop.feed([4, 1]) == 0 and loop.backend.held == [0, 1, 2, 4, 1]


def test_a_tree_sees_the_rows_held_and_its_ancestors_and_is_dropped_again(loop):
    loop.draft(2, 1)  # a chain drafted ahead: 4 rows held, which the tree grows after
    tree = loop.draft_tree(3, depth=2, top_k=2, total_tokens=7)
    assert loop.backend.held == [0, 1, 2, 2]
    assert tree.tokens == [3, 2, 5, 3, 4, 4, 1] and tree.parents == [-1, 0, 0, 1, 1, 2, 2]
    root_level, second = loop.backend.masks
    assert root_level.tolist() == [[True] * 5]  # the rows held and itself
    # The second level's nodes are the root's children 2 and 5, fed at rows 5 and 6 after the root's row 4.
    assert second.shape == (2, 4 + 1 + 2)
    assert second[:, :5].all()  # the rows held, and their parent (the root)
    assert second[:, 5:].tolist() == [[True, False], [False, True]]  # each itself, not its sibling
    again = loop.draft_tree(3, depth=2, top_k=2, total_tokens=7)
    assert (again.tokens, again.parents) == (tree.tokens, tree.parents)
