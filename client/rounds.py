"""The edge session's ONLINE rounds: draft a chain or a tree, send it, draft the next round while this one is
verified, and take the verdict.

A part of tether.client.session.EdgeSession (a mixin over its state, as tether.client.resync is); the wire side is
docs/ARCHITECTURE.md, section 5 (DraftRound.parents, Verdict.path, ModelInfo.max_tree_nodes).
- A round's shape (`EdgeSession._plan`): a chain of `k` draft tokens after the root, or an EAGLE-2 dynamic tree of
  at most `tree_nodes` nodes grown `tree_depth` levels deep, `tree_top_k` wide (the drafter's draft_tree), where
  the server takes trees: ModelInfo.max_tree_nodes caps the nodes, and 0 (a server that verifies chains only, or
  one older than trees) means chains whatever `tree` says. Tree children are deterministic top-k picks, which the
  server's lossless check takes as point-mass proposals when no q rows come with them, so a tree round carries no
  q and sampling stays lossless with trees too.
- `tree="auto"` (`use_tree`, a pure function of what the session measured, `Measured`): a tree while a round waits
  for its verdict at least RTT_DOMINANCE times as long as drafting a chain takes and rounds get as far as a whole
  chain would at least WHOLE_OFTEN of the time; a chain otherwise, and for the first MIN_ROUNDS rounds. A tree
  costs more draft compute and upload and earns more accepted tokens per round, which pays when the round trip,
  not drafting, sets the pace. The figures are EWMAs (weight EWMA_WEIGHT for the newest): the wait from sending a
  round to its verdict's arrival (the reader thread stamps it, so drafting ahead meanwhile does not count), the
  drafter's time per step (a chain token or a tree level), and whether a round accepted at least the k tokens of a
  chain. Auto decides on measured times, so a seed repeats a sampled text exactly only with `tree` chain or tree.
- A tree round sends its nodes after the root in topological order with `parents` (node i's parent is
  parents[i - 1], the root being node 0). The verdict's `path` names the accepted nodes, checked to be a walk
  down from the root; their tokens and the bonus are emitted, and the delta covers the root and that path.
- Pipelining (`pipeline`, SpecEdge's proactive drafting): once a round is sent, the drafter drafts the next one as
  if this one were accepted whole (the chain, or the tree's main branch: each node's first child, the drafter's
  favourite), after its own guess of the bonus (the argmax there; a guess draws nothing from the random stream).
  When the verdict accepts exactly that path and its bonus is the guess, the round drafted ahead is sent at once,
  before the verdict's delta is adopted (Stats.pipeline_hits); otherwise it is dropped (pipeline_discarded) and the
  next round is drafted anew. A round is drafted ahead only when accepting the one in flight whole would not end
  the generation. A chain drafted ahead stops as soon as a verdict is in (a drafter slower than the round trip: a
  large TLI on a CPU edge, or a link of RTT 0), so a miss costs no more drafting; a hit finishes it first
  (`_draft_rest`: the same tokens and draws as a draft never stopped). Each online draft samples from a random stream
  of its own (the session's n-th), so where a draft was cut never moves a later draw: a seed repeats a text. Round
  numbers and roots are those a client without pipelining sends: the server sees nothing new, and a round stays
  idempotent.
- Overlapping rounds (`overlap`, where ModelInfo.overlapping_rounds): the round drafted ahead goes out as soon as it
  is drafted, with DraftRound.after_length, the verified length the guess leaves (the root and the main path
  added). The server takes a stream's messages in order, so it sees that round straight after the verdict it depends
  on, and verifies it only if the session stands at that length with the guessed bonus as its root; otherwise it
  refuses it as REASON_STALE_ROUND and changes nothing. The client mirrors that test on the verdict (same length of
  path, same bonus: a tree's other path of the main branch's length counts too, and is exact, as every verdict is):
  a hit makes that round the one in flight with no send of its own (Stats.overlapped); a miss waits for its
  refusal, which the transport passes over, before the next round's verdict. So a run of hits costs a round trip
  once, not a round trip a round, and greedy text and sampled laws are the same as without overlap: whether a round
  counts still depends on the verdict alone.
  `overlap_depth` rounds may be queued so behind the one in flight (`_fill_overlap`): each drafted after the one
  before it, on the guess that every round before it holds, and sent with the length all those guesses leave.
  A verdict that bears out the first queued round's guess makes it the round in flight and keeps the others
  queued; one that does not makes every queued round stale. A round being drafted behind a queued one when a
  verdict comes in is cut short and kept unsent: a hit finishes it from the rows it was drafted from and sends it, so
  the drafting already done is not thrown away. With one queued, the client drafts the next round
  only once a verdict is in, so rounds go out every (drafting + round trip) / 2 at best; with two, the client drafts
  through the round trip while it lasts (every max(drafting, (drafting + round trip) / 3)). Once the drafter holds no
  rows for the rounds in flight (after a verdict's delta), drafting the next one steps over all their roots and main
  paths in one call. Greedy generations only: a round queued behind another is drafted from that one's drafted rows
  or from verified ones, whichever the timing gives, which would make a sampled text depend on the clock; sampled
  generations queue one round (greedy text is the target's whatever was drafted).
- Exactness: the caches of verified positions come from the deltas alone, the same after a chain, a tree or a round
  drafted ahead (tests/client/test_round_shape.py). Before a verdict's delta is adopted the drafter drops every drafted
  row (the round's own and those drafted ahead), and a round sent as drafted ahead has its root and main path fed again
  over the verified states (one causal call, as the round after it is drafted ahead), so that round is drafted from
  there. Except under greedy when the verdict bears out the guess the rounds pending were drafted on (the main path
  itself, not another of its length): the delta is adopted with the rows drafted after it kept
  (commit(keep_drafts=True), where the drafter can; Stats.rows_kept), since their tokens are the ones drafted over, and
  drafting goes on after them with no re-feed (12 tokens a round with two queued). Those rows were drafted over drafted
  rows of the verified positions; only the drafts after them read them, and greedy text is the target's whatever was
  drafted. A round drafted ahead when sampling carries the q its tokens were drawn from (over the drafter's state then);
  its draws are the drafter's own, apart from the verifier's uniforms, and whether it is sent depends on the verdict
  before it only. Under greedy every emitted token is the target's, whatever was drafted.
- A lost round (no verdict in time, a refused message, a broken stream) drops the drafted rows and any round drafted
  ahead, and the session goes OFFLINE as before (tether.client.resync).

Tests: tests/client/test_round_shape.py (the auto rule, trees' main branches and paths, the drafter's caches after
tree rounds and rounds drafted ahead), tests/e2e/test_tree_pipeline.py (greedy equals plain greedy for chain / tree x
pipelining x overlap, a cut link under pipelining, sampled runs, a server without trees), tests/server/test_service.py
(the server's side of overlapping rounds).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tether.client.delta_gate import wire_delta
from tether.client.errors import Problem
from tether.client.session_types import ClientConfig
from tether.shared.logits_processing import LogitsProcessing
from tether.v1 import tether_pb2 as pb

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


@dataclass(frozen=True)
class Shape:
    k: int  # a chain's draft tokens, or a tree's depth
    chain_k: int  # the tokens a chain would have drafted (what "accepted whole" measures against)
    tree: bool = False
    nodes: int = 0  # a tree's most draft nodes, the root not counted
    top_k: int = 0  # a tree's width


@dataclass
class Drafted:
    """A round drafted, then sent."""

    msg: pb.DraftRound
    parents: list[int] | None  # a tree's (node i's parent is parents[i - 1]); None: a chain
    chain_k: int
    fed: int  # of the root and the main branch's tokens, how many the drafter holds rows for
    sent_at: float = 0.0  # time.monotonic() when it was sent; 0.0: not sent (yet)
    overlapped: bool = False  # sent before the verdict of the round before it, and taken
    short: int = 0  # a chain drafted ahead and cut short by its verdict's arrival: the tokens still to draft
    rng: Any = None  # the random stream its tokens were drawn from (its own: see Rounds._draft), when sampling
    proc: LogitsProcessing | None = None  # the logit_bias and penalties of the position after its root
    main: list[int] = field(default_factory=list)  # the path a round drafted ahead assumes: the chain, or main branch
    # The drafter's guess of the bonus after the root and main path, once it holds their rows (fed == len(main) + 1):
    # a later draft ahead that finds nothing left to feed drafts after it.
    guess: int | None = None

    def tokens_on(self, path: list[int]) -> list[int]:
        return [self.msg.tokens[i - 1] for i in path]


@dataclass(frozen=True)
class Ahead:
    """The next round, drafted while `path` and `bonus` were only guessed."""

    path: list[int]
    bonus: int
    round: Drafted
    after: int  # the verified length the guess leaves: where the server must stand to verify this round


class Rounds:
    """EdgeSession's ONLINE rounds (see the module docstring)."""

    def _plan(self, emitted: int, length: int) -> Shape:
        """The shape of the round after the `emitted`-th token, with the text (prompt included) `length` long."""
        cfg, info = self.cfg, self.info
        room = min(cfg.max_new_tokens - emitted - 1, self.max_positions - length)
        k = max(0, min(cfg.k, room, info.max_draft_tokens))
        # A tree is verified over all its nodes: they need the positions, though only its path stays.
        nodes = max(0, min(cfg.tree_nodes, info.max_tree_nodes, info.max_draft_tokens, self.max_positions - length))
        depth = max(0, min(cfg.tree_depth, room, nodes))
        if use_tree(cfg.tree, self.measured, k=cfg.k, nodes=nodes, depth=depth):
            return Shape(depth, k, True, nodes, cfg.tree_top_k)
        return Shape(k, k)

    def _draft(self, number: int, context: list[int], shape: Shape, stop: Callable[[], bool] | None = None) -> Drafted:
        """Round `number`'s draft after its root, the last token of `context` (the text through it, guesses
        included), from the rows the drafter holds now; each drafted position is processed by the sampling controls
        with its own context's counts. `stop` may cut a chain short (Drafted.short; `_draft_rest` completes it).
        Each draft samples from a random stream of its own, the session's n-th: how far a draft cut short got then
        changes no later draw, so a seed repeats a text whenever the draft ahead is cut."""
        cfg, root, proc = self.cfg, context[-1], self._processing(context)
        t0 = time.monotonic()
        if shape.tree:
            tree = self.drafter.draft_tree(root, depth=shape.k, top_k=shape.top_k, total_tokens=shape.nodes + 1,
                                           processing=proc)  # fmt: skip
            tokens, parents = [int(t) for t in tree.tokens][1:], [int(p) for p in tree.parents][1:]
            msg = pb.DraftRound(round=number, root=root, tokens=tokens, parents=parents)
            d = Drafted(msg, parents, shape.chain_k, fed=0, main=main_branch(parents), proc=proc)
        else:  # a tree's nodes are top-k picks, which draw nothing: only chains take a stream
            rng = self._draft_streams(self._drafts_started) if cfg.temperature > 0 else None
            self._drafts_started += 1
            drafts, q_ids, q_probs = self.drafter.draft(root, shape.k, temperature=cfg.temperature, top_p=cfg.top_p,
                                                        top_k=cfg.top_k, stop=stop, generator=rng, min_p=cfg.min_p,
                                                        processing=proc)  # fmt: skip
            msg = pb.DraftRound(round=number, root=root)
            d = Drafted(msg, None, shape.chain_k, fed=0, short=shape.k, rng=rng, proc=proc)
            self._extend(d, drafts, q_ids, q_probs)
        self.measured.drafted(time.monotonic() - t0, shape.k)
        return d

    def _extend(self, d: Drafted, drafts: list[int], q_ids, q_probs) -> None:
        """Add a chain's `drafts` (and their q rows when sampling) to round `d`."""
        d.msg.tokens.extend(drafts)
        if q_ids is not None:
            rows = zip(q_ids.tolist(), q_probs.tolist(), strict=True)
            d.msg.q.extend(pb.SparseDistribution(ids=i, probs=p) for i, p in rows)
        # The drafter stepped over the root and every draft but the last.
        d.fed, d.short = len(d.msg.tokens), d.short - len(drafts)
        d.main = list(range(1, d.fed + 1))

    def _draft_rest(self, d: Drafted) -> None:
        """Complete a chain cut short: the same tokens and draws as if it had never stopped."""
        t0, cfg = time.monotonic(), self.cfg
        proc = None if d.proc is None else d.proc.after(list(d.msg.tokens))  # the position after the last draft
        drafts, q_ids, q_probs = self.drafter.draft(d.msg.tokens[-1], d.short, temperature=cfg.temperature,
                                                    top_p=cfg.top_p, top_k=cfg.top_k, generator=d.rng, min_p=cfg.min_p,
                                                    processing=proc)  # fmt: skip
        self._extend(d, drafts, q_ids, q_probs)
        self.measured.drafted(time.monotonic() - t0, len(drafts))

    def _feed(self, tokens: list[int], proc: LogitsProcessing | None = None) -> int | None:
        """Step the drafter over tokens already decided or sent (greedy steps draw nothing); the argmax after the
        last of them, processed by `proc` (the position after them)."""
        t0 = time.monotonic()
        guess = self.drafter.feed(tokens, processing=proc)
        self.measured.drafted(time.monotonic() - t0, len(tokens))
        return guess

    def _send(self, d: Drafted, *, after_length: int = 0) -> None:
        """Send round `d`: the next to be answered, or with `after_length` an overlapping round, sent before the
        verdict of the one in flight on the guess that it leaves that many verified positions."""
        d.sent_at = time.monotonic()
        d.msg.after_length = after_length
        if after_length == 0:
            if self._answered_at is not None:
                self.stats.verdict_to_send_s += d.sent_at - self._answered_at
                self._answered_at = None
            self._inflight = d
        self.stream.send(pb.ClientMessage(round=d.msg))
        q = sum(len(row.ids) for row in d.msg.q)
        self.stats.bytes_up += 4 * (1 + len(d.msg.tokens) + len(d.msg.parents)) + 8 * q

    def _pending(self) -> list[Drafted]:
        """The rounds sent and not answered, in order: the one in flight, then those queued behind it."""
        return [self._inflight, *(a.round for a in self._queued)]

    def _draft_ahead(self) -> Ahead | None:
        """The round after the last one pending, drafted as if every pending round were accepted along its main
        path with the drafter's guess of each bonus; None when that would end the generation. The drafter first
        steps over what it holds no rows for of the pending rounds' roots and main paths, in one call."""
        pending = self._pending()
        base = pending[-1]
        path = base.main
        tokens = base.tokens_on(path)
        ahead = sum(len(d.main) + 1 for d in pending)  # positions the pending rounds make text when they all hold
        emitted, length = len(self.tokens) + ahead, len(self.sequence) + ahead
        stops = self.stop_ids or frozenset()
        if stops.intersection(tokens) or emitted >= self.cfg.max_new_tokens or length >= self.max_positions:
            return None
        unfed = [t for d in pending for t in ([d.msg.root] + d.tokens_on(d.main))[d.fed :]]
        # The text the guess follows: the first pending round's root ends the sequence; each root and main path.
        context = self.sequence[:-1] + [t for d in pending for t in [d.msg.root] + d.tokens_on(d.main)]
        # Nothing unfed: an earlier draft ahead stepped over them all (and stopped, at an end-of-text guess or a
        # verdict) and a verdict that bore the rounds before out kept those rows; its guess still follows them.
        guess = self._feed(unfed, self._processing(context)) if unfed else base.guess
        for d in pending:
            d.fed = len(d.main) + 1
        base.guess = guess
        if guess is None:
            raise AssertionError(f"round {base.msg.round}: fed through with no guess kept")
        if guess in stops:
            return None
        # A verdict in already: stop drafting ahead, so a miss costs no more of it (a hit finishes the chain).
        stop = functools.partial(self.stream.has_reply, self._stale)
        drafted = self._draft(base.msg.round + 1, [*context, guess], self._plan(emitted, length), stop)
        return Ahead(path, guess, drafted, after=self.verified + ahead)

    def _fill_overlap(self) -> Ahead | None:
        """Draft rounds ahead and send them before the verdicts they depend on, until `overlap_depth` are queued
        behind the round in flight or a verdict is in. Returns a round drafted ahead but cut short by a verdict
        while none was queued (sent after that verdict if it bears the guess out, as without overlap)."""
        # Sampled text must repeat for a seed: a round drafted behind a queued one reads that one's drafted rows, or
        # the verified ones if the verdict came first, so its proposals would depend on timing. Greedy text is the
        # target's whatever was drafted.
        depth = self.cfg.overlap_depth if self.cfg.temperature == 0 else 1
        while len(self._queued) < depth and not self._stopping.is_set():
            if self._queued and self.stream.has_reply(self._stale):
                break  # the verdict is in: taking it comes first
            ahead = self._draft_ahead()
            if ahead is None:
                break
            if ahead.round.short:
                if not self._queued:
                    return ahead
                # Cut short behind a queued round: kept unsent; a verdict that bears out the round before it
                # finishes it from the same rows and sends it, one that does not throws it away with the others.
                self._queued.append(ahead)
                break
            self._send(ahead.round, after_length=ahead.after)
            self._queued.append(ahead)
        return None

    def _send_queued(self) -> None:
        """After a hit: finish and send the round queued unsent (cut short by that verdict), before the drafter
        drops the rows it was drafted from."""
        for a in self._queued:
            if not a.round.sent_at and not self._stopping.is_set():
                self._finish_and_send(a.round, after_length=a.after)

    def _finish_and_send(self, d: Drafted, *, after_length: int = 0) -> None:
        """Send round `d` drafted ahead, first completing it if a verdict cut it short."""
        if d.short:
            self._draft_rest(d)
        self._send(d, after_length=after_length)

    def _overlaps(self) -> bool:
        """Whether a round drafted ahead goes out before the verdict it depends on (see the module docstring)."""
        return self.cfg.pipeline and self.cfg.overlap and self.info.overlapping_rounds

    def _drop_rounds(self) -> None:
        """Forget the rounds in flight and their drafted rows (the stream they went on is gone, or the generation
        is)."""
        self._inflight = self._answered_at = None
        self.stats.pipeline_discarded += len(self._queued)
        self._queued, self._stale = [], []
        self.drafter.discard_drafts()

    def _round(self) -> None:
        """One verdict: draft and send a round unless one is in flight, draft the next ahead while it is verified,
        take the verdict (sending the round drafted ahead at once when the guess held) and emit its tokens."""
        t_round = time.monotonic()
        if self._inflight is None:
            shape = self._plan(len(self.tokens), len(self.sequence))
            self._send(self._draft(self.round + 1, self.sequence, shape))
        sent, ahead = self._inflight, None
        try:
            if self.cfg.pipeline and self._overlaps():
                ahead = self._fill_overlap()
            elif self.cfg.pipeline:
                ahead = self._draft_ahead()
            t_wait = time.monotonic()
            reply = self.stream.receive(self.cfg.round_timeout_s, since=sent.sent_at, stale=self._stale)
            self._stale = []
            waited, self._answered_at = time.monotonic() - t_wait, self.stream.arrived_at
            v, path = self._verdict(reply, sent)
            reported = self._reported(v.logprobs, sent.tokens_on(path) + [v.bonus])  # checked before anything moves
            self._inflight = None
            wait = None if sent.overlapped else self._answered_at - sent.sent_at
            self.measured.answered(wait, whole=v.accepted >= sent.chain_k)
            self.stats.verdict_wait_s += self._answered_at - sent.sent_at
            borne_out = False  # the round drafted ahead went out on this verdict's exact path and bonus
            if self._queued:
                # The server's test, not the client's: a tree's other path of the same length and bonus also
                # leaves it at the queued round's `after` with that root, and the round then is verified there
                # (exactly: it is the target that decides).
                first = self._queued[0]
                if (len(path), v.bonus) == (len(first.path), first.bonus):
                    borne_out = path == first.path
                    self._queued.pop(0)
                    self._inflight, self._answered_at = first.round, None
                    first.round.overlapped = True
                    self.stats.pipeline_hits += 1
                    self.stats.overlapped += 1
                    self._send_queued()
                else:
                    # Every queued round assumed this one held: the refusals of those sent come before the next
                    # verdict.
                    self._stale = [a.round.msg.round for a in self._queued if a.round.sent_at]
                    self.stats.pipeline_discarded += len(self._queued)
                    self._queued = []
            elif ahead is not None and (path, v.bonus) == (ahead.path, ahead.bonus) and not self._stopping.is_set():
                self._finish_and_send(ahead.round)
                self.stats.pipeline_hits += 1
                borne_out = True
            elif ahead is not None:
                self.stats.pipeline_discarded += 1
            ahead = None
            accepted = sent.tokens_on(path)
            self._count_down(v.delta)
            self._drafts = accepted  # what the delta may cover after the root
            try:
                # Verified rows come from the delta alone, however they were drafted. Under greedy, rows drafted
                # after them for the rounds now pending stay where the drafter can keep them (their tokens are
                # the ones drafted over); sampled text must not depend on which rows a draft read.
                keep = borne_out and self.cfg.temperature == 0 and self._inflight is not None
                if not keep:
                    self.drafter.discard_drafts()
                kept = self.drafter.commit(wire_delta(v.delta), keep_drafts=keep)
            finally:
                self._drafts = []
        except BaseException:
            self.stats.pipeline_discarded += int(ahead is not None)
            self._drop_rounds()  # the round is lost: drafting goes on after the verified positions
            raise
        self.round += 1
        self.stats.rounds += 1
        self.stats.tree_rounds += int(sent.parents is not None)
        self.stats.drafted += len(sent.msg.tokens)
        self.stats.accepted += v.accepted
        self.verified = v.delta.start + len(v.delta.tokens)
        self.stats.rows_kept += int(kept)
        if self._inflight is not None and not kept:
            # Sent as drafted ahead: their rows went with this verdict's delta. Drafting the round after them feeds
            # their roots and main paths again, over the verified states and in one call (_draft_ahead).
            for d in self._pending():
                d.fed = 0
        self.stats.round_work_s += time.monotonic() - t_round - waited
        self._emit(accepted + [v.bonus], "verified", reported)

    def _verdict(self, reply: pb.ServerMessage, sent: Drafted) -> tuple[pb.Verdict, list[int]]:
        """The reply's verdict and its accepted path (node numbers) if it answers the round sent (the gate checks
        its delta), else BadMessage."""
        body = reply.WhichOneof("body")
        number = sent.msg.round
        if body != "verdict":
            raise self._bad_message(Problem.VERDICT, f"round {number} was answered by a {body} message")
        v = reply.verdict
        n = len(sent.msg.tokens)
        if v.round != number or v.accepted > n or len(v.delta.tokens) != v.accepted + 1:
            raise self._bad_message(
                Problem.VERDICT,
                f"round {v.round} (sent {number}): {v.accepted} of {n} drafts accepted, "
                f"a delta of {len(v.delta.tokens)} positions",
            )
        self._check_token(v.bonus, f"bonus token of round {v.round}")
        if sent.parents is None:
            if v.path:
                raise self._bad_message(Problem.VERDICT, f"round {number} sent a chain, its verdict names tree nodes")
            return v, list(range(1, v.accepted + 1))
        path, parent = list(v.path), 0
        for node in path:
            if not (1 <= node <= n and sent.parents[node - 1] == parent):
                break
            parent = node
        else:
            if len(path) == v.accepted:
                return v, path
        raise self._bad_message(Problem.VERDICT, f"round {number}: its verdict's path is not {v.accepted} nodes of "
                                                 "the tree sent, each a child of the one before")  # fmt: skip
