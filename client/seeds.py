"""The random streams an edge session derives from its seed, each apart from the server verifier's.

Contract:
- `draft_seed(seed, stream=-1)`: the drafter's own seed (online drafts: one stream each, numbered; -1: offline).
- `stream_seed(seed, position)`: the seed of a Generate stream started at `position` of the text (a stream restarted
  after a switch, tether.client.adaptive): each restart draws from a stream of its own, never again the uniforms an
  earlier stream of the same generation drew.
Both are non-negative int64s, as torch's manual_seed and the wire's SamplingParams.seed take.

    rng = np.random.default_rng(draft_seed(cfg.seed))

Tests: tests/client/test_session_file.py (the drafter's stream is not the server's), tests/client/test_mode_choice.py.
"""

from __future__ import annotations

import hashlib


def _derived(seed: int, salt: bytes) -> int:
    digest = hashlib.sha256(b"tether draft seed " + (seed % 2**64).to_bytes(8, "little") + salt).digest()
    return int.from_bytes(digest[:8], "little") >> 1  # a non-negative int64, as manual_seed takes


def draft_seed(seed: int, stream: int = -1) -> int:
    """The drafter's own seed, derived from the session's: the server seeds its verifier's uniforms with the session
    seed (a torch CPU Generator, as the torch drafter's), and drafts drawn from the same stream as the uniforms that
    judge them are not independent of them, which lossless rejection sampling needs (seen: chi-square 265 against a
    bound of 46 over sampled tree rounds drafted that way, 15.6 with independent streams). `stream` >= 0: the seed of
    the session's stream-th online draft (tether.client.rounds), one stream each; -1: offline drafting's stream."""
    return _derived(seed, b"" if stream < 0 else b" round draft " + stream.to_bytes(8, "little"))


def stream_seed(seed: int, position: int) -> int:
    """The seed of a Generate stream that continues the text from `position` (its length then)."""
    return _derived(seed, b" generate from " + position.to_bytes(8, "little"))
