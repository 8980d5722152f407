"""The edge session's ONLINE rounds: draft a chain or a tree, send it, draft the next round while this one is
verified, and take the verdict.

`Rounds` is an object EdgeSession (tether.client.session) composes: it holds the session's text (SessionText, whose
verified length it advances as verdicts' deltas are adopted), the server link, the output it emits to, and the state
of the rounds in flight. What a round is (its shape, from what the session measured) is tether.client.round_plan's
`plan_round`, a pure function; the wire side is docs/ARCHITECTURE.md, section 5 (DraftRound.parents, Verdict.path).
- `step()`: one verdict. It drafts and sends a round unless one is in flight, drafts ahead while it is verified,
  takes the verdict and emits its accepted tokens and bonus, tagged verified. `drop()` forgets the rounds in flight
  and their drafted rows; `restart()` numbers rounds from 1 again (a new stream attached).
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
  (`draft_rest`: the same tokens and draws as a draft never stopped). Each online draft samples from a random stream
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
  `overlap_depth` rounds may be queued so behind the one in flight (`fill_overlap`): each drafted after the one
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

Tests: tests/client/test_round_shape.py (the shapes, verdicts' paths, the drafter's caches after tree rounds and
rounds drafted ahead, drafting ahead over a scripted drafter), tests/e2e/test_tree_pipeline.py (greedy equals plain
greedy for chain / tree x pipelining x overlap, a cut link under pipelining, sampled runs, a server without trees),
tests/server/test_service.py (the server's side of overlapping rounds).
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tether.client.delta_gate import DeltaGate, wire_delta
from tether.client.errors import Problem
from tether.client.reply_check import ReplyCheck
from tether.client.round_plan import Limits, Measured, Shape, main_branch, plan_round
from tether.client.server_link import ServerLink
from tether.client.session_output import SessionOutput
from tether.client.session_text import SessionText
from tether.client.session_types import ClientConfig
from tether.shared.logits_processing import LogitsProcessing, SamplingControls
from tether.v1 import tether_pb2 as pb


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
    rng: Any = None  # the random stream its tokens were drawn from (its own: see Rounds.draft), when sampling
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


def check_verdict(reply: pb.ServerMessage, sent: Drafted, check: ReplyCheck) -> tuple[pb.Verdict, list[int]]:
    """The reply's verdict and its accepted path (node numbers) if it answers the round sent (the gate checks its
    delta), else what `check` refuses it with (BadMessage once generating)."""
    body = reply.WhichOneof("body")
    number = sent.msg.round
    if body != "verdict":
        raise check.refused(Problem.VERDICT, f"round {number} was answered by a {body} message")
    v = reply.verdict
    n = len(sent.msg.tokens)
    if v.round != number or v.accepted > n or len(v.delta.tokens) != v.accepted + 1:
        raise check.refused(
            Problem.VERDICT,
            f"round {v.round} (sent {number}): {v.accepted} of {n} drafts accepted, "
            f"a delta of {len(v.delta.tokens)} positions",
        )
    check.token(v.bonus, f"bonus token of round {v.round}")
    if sent.parents is None:
        if v.path:
            raise check.refused(Problem.VERDICT, f"round {number} sent a chain, its verdict names tree nodes")
        return v, list(range(1, v.accepted + 1))
    path, parent = list(v.path), 0
    for node in path:
        if not (1 <= node <= n and sent.parents[node - 1] == parent):
            break
        parent = node
    else:
        if len(path) == v.accepted:
            return v, path
    raise check.refused(
        Problem.VERDICT,
        f"round {number}: its verdict's path is not {v.accepted} nodes of the "
        "tree sent, each a child of the one before",
    )


class Rounds:
    """The session's ONLINE rounds over its text, link and output (see the module docstring)."""

    def __init__(
        self,
        cfg: ClientConfig,
        text: SessionText,
        link: ServerLink,
        output: SessionOutput,
        check: ReplyCheck,
        drafter: DeltaGate,
        *,
        controls: SamplingControls,
        limits: Limits,
        streams: Callable[[int], Any],
        stopping: threading.Event,
    ):
        """streams(n): the random stream the session's n-th online draft samples from; stopping: set by stop()."""
        self.cfg, self.text, self.link, self.output, self.check = cfg, text, link, output, check
        self.drafter, self.controls, self.limits = drafter, controls, limits
        self.streams, self.stopping = streams, stopping
        self.measured = Measured()  # the round trip, drafting time and acceptance (round_plan: tree="auto")
        self.number = 0  # rounds answered on this stream
        self.inflight: Drafted | None = None  # the round sent and not answered yet
        self.queued: list[Ahead] = []  # overlapping rounds sent behind the one in flight, in order
        self.stale: list[int] = []  # overlapping rounds whose refusals as stale are still to come back (numbers)
        self.accepted: list[int] = []  # a verdict's accepted tokens, while its delta is checked (the gate's coverable)
        self._answered_at: float | None = None  # when the last verdict arrived, until the round after it is sent
        self._drafts_started = 0  # online chains drafted so far: the next one samples from the stream of that number

    def restart(self) -> None:
        """A new stream attached: its rounds are numbered from 1."""
        self.number = 0

    def _processing(self, context: list[int]) -> LogitsProcessing | None:
        """The logit_bias and penalties of the position after `context` (the text through a draft's root), which
        the drafter proposes from as the server's verifier does; None when the controls change nothing."""
        return self.controls.processing(context, len(self.text.prompt), self.check.vocab_size)

    def _plan(self, emitted: int, length: int) -> Shape:
        return plan_round(self.cfg, self.measured, self.limits, emitted=emitted, length=length)

    def draft(self, number: int, context: list[int], shape: Shape, stop: Callable[[], bool] | None = None) -> Drafted:
        """Round `number`'s draft after its root, the last token of `context` (the text through it, guesses
        included), from the rows the drafter holds now; each drafted position is processed by the sampling controls
        with its own context's counts. `stop` may cut a chain short (Drafted.short; `draft_rest` completes it).
        Each draft samples from a random stream of its own, the session's n-th: how far a draft cut short got then
        changes no later draw, so a seed repeats a text whenever the draft ahead is cut."""
        cfg, root, proc = self.cfg, context[-1], self._processing(context)
        t0 = time.monotonic()
        if shape.tree:
            tree = self.drafter.draft_tree(
                root, depth=shape.k, top_k=shape.top_k, total_tokens=shape.nodes + 1, processing=proc
            )
            tokens, parents = [int(t) for t in tree.tokens][1:], [int(p) for p in tree.parents][1:]
            msg = pb.DraftRound(round=number, root=root, tokens=tokens, parents=parents)
            d = Drafted(msg, parents, shape.chain_k, fed=0, main=main_branch(parents), proc=proc)
        else:  # a tree's nodes are top-k picks, which draw nothing: only chains take a stream
            rng = self.streams(self._drafts_started) if cfg.temperature > 0 else None
            self._drafts_started += 1
            drafts, q_ids, q_probs = self.drafter.draft(
                root,
                shape.k,
                temperature=cfg.temperature,
                top_p=cfg.top_p,
                top_k=cfg.top_k,
                stop=stop,
                generator=rng,
                min_p=cfg.min_p,
                processing=proc,
            )
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

    def draft_rest(self, d: Drafted) -> None:
        """Complete a chain cut short: the same tokens and draws as if it had never stopped."""
        t0, cfg = time.monotonic(), self.cfg
        proc = None if d.proc is None else d.proc.after(list(d.msg.tokens))  # the position after the last draft
        drafts, q_ids, q_probs = self.drafter.draft(
            d.msg.tokens[-1],
            d.short,
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            top_k=cfg.top_k,
            generator=d.rng,
            min_p=cfg.min_p,
            processing=proc,
        )
        self._extend(d, drafts, q_ids, q_probs)
        self.measured.drafted(time.monotonic() - t0, len(drafts))

    def _feed(self, tokens: list[int], proc: LogitsProcessing | None = None) -> int | None:
        """Step the drafter over tokens already decided or sent (greedy steps draw nothing); the argmax after the
        last of them, processed by `proc` (the position after them)."""
        t0 = time.monotonic()
        guess = self.drafter.feed(tokens, processing=proc)
        self.measured.drafted(time.monotonic() - t0, len(tokens))
        return guess

    def send(self, d: Drafted, *, after_length: int = 0) -> None:
        """Send round `d`: the next to be answered, or with `after_length` an overlapping round, sent before the
        verdict of the one in flight on the guess that it leaves that many verified positions."""
        stats = self.output.stats
        d.sent_at = time.monotonic()
        d.msg.after_length = after_length
        if after_length == 0:
            if self._answered_at is not None:
                stats.verdict_to_send_s += d.sent_at - self._answered_at
                self._answered_at = None
            self.inflight = d
        self.link.stream.send(pb.ClientMessage(round=d.msg))
        q = sum(len(row.ids) for row in d.msg.q)
        stats.bytes_up += 4 * (1 + len(d.msg.tokens) + len(d.msg.parents)) + 8 * q

    def _pending(self) -> list[Drafted]:
        """The rounds sent and not answered, in order: the one in flight, then those queued behind it."""
        return [self.inflight, *(a.round for a in self.queued)]

    def _draft_ahead(self) -> Ahead | None:
        """The round after the last one pending, drafted as if every pending round were accepted along its main
        path with the drafter's guess of each bonus; None when that would end the generation. The drafter first
        steps over what it holds no rows for of the pending rounds' roots and main paths, in one call."""
        pending = self._pending()
        base = pending[-1]
        path = base.main
        tokens = base.tokens_on(path)
        ahead = sum(len(d.main) + 1 for d in pending)  # positions the pending rounds make text when they all hold
        emitted, length = len(self.text.tokens) + ahead, len(self.text.sequence) + ahead
        stops = self.output.ends
        if stops.intersection(tokens) or emitted >= self.cfg.max_new_tokens or length >= self.limits.max_positions:
            return None
        unfed = [t for d in pending for t in ([d.msg.root] + d.tokens_on(d.main))[d.fed :]]
        # The text the guess follows: the first pending round's root ends the sequence; each root and main path.
        context = self.text.sequence[:-1] + [t for d in pending for t in [d.msg.root] + d.tokens_on(d.main)]
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
        stop = functools.partial(self.link.stream.has_reply, self.stale)
        drafted = self.draft(base.msg.round + 1, [*context, guess], self._plan(emitted, length), stop)
        return Ahead(path, guess, drafted, after=self.text.verified + ahead)

    def fill_overlap(self) -> Ahead | None:
        """Draft rounds ahead and send them before the verdicts they depend on, until `overlap_depth` are queued
        behind the round in flight or a verdict is in. Returns a round drafted ahead but cut short by a verdict
        while none was queued (sent after that verdict if it bears the guess out, as without overlap)."""
        # Sampled text must repeat for a seed: a round drafted behind a queued one reads that one's drafted rows, or
        # the verified ones if the verdict came first, so its proposals would depend on timing. Greedy text is the
        # target's whatever was drafted.
        depth = self.cfg.overlap_depth if self.cfg.temperature == 0 else 1
        while len(self.queued) < depth and not self.stopping.is_set():
            if self.queued and self.link.stream.has_reply(self.stale):
                break  # the verdict is in: taking it comes first
            ahead = self._draft_ahead()
            if ahead is None:
                break
            if ahead.round.short:
                if not self.queued:
                    return ahead
                # Cut short behind a queued round: kept unsent; a verdict that bears out the round before it
                # finishes it from the same rows and sends it, one that does not throws it away with the others.
                self.queued.append(ahead)
                break
            self.send(ahead.round, after_length=ahead.after)
            self.queued.append(ahead)
        return None

    def _send_queued(self) -> None:
        """After a hit: finish and send the round queued unsent (cut short by that verdict), before the drafter
        drops the rows it was drafted from."""
        for a in self.queued:
            if not a.round.sent_at and not self.stopping.is_set():
                self._finish_and_send(a.round, after_length=a.after)

    def _finish_and_send(self, d: Drafted, *, after_length: int = 0) -> None:
        """Send round `d` drafted ahead, first completing it if a verdict cut it short."""
        if d.short:
            self.draft_rest(d)
        self.send(d, after_length=after_length)

    def _overlaps(self) -> bool:
        """Whether a round drafted ahead goes out before the verdict it depends on (see the module docstring)."""
        return self.cfg.pipeline and self.cfg.overlap and self.link.info.overlapping_rounds

    def drop(self) -> None:
        """Forget the rounds in flight and their drafted rows (the stream they went on is gone, or the generation
        is)."""
        self.inflight = self._answered_at = None
        self.output.stats.pipeline_discarded += len(self.queued)
        self.queued, self.stale = [], []
        self.drafter.discard_drafts()

    def step(self) -> None:
        """One verdict: draft and send a round unless one is in flight, draft the next ahead while it is verified,
        take the verdict (sending the round drafted ahead at once when the guess held) and emit its tokens."""
        t_round, stats = time.monotonic(), self.output.stats
        if self.inflight is None:
            shape = self._plan(len(self.text.tokens), len(self.text.sequence))
            self.send(self.draft(self.number + 1, self.text.sequence, shape))
        sent, ahead = self.inflight, None
        try:
            if self.cfg.pipeline and self._overlaps():
                ahead = self.fill_overlap()
            elif self.cfg.pipeline:
                ahead = self._draft_ahead()
            t_wait = time.monotonic()
            reply = self.link.stream.receive(self.cfg.round_timeout_s, since=sent.sent_at, stale=self.stale)
            self.stale = []
            waited, self._answered_at = time.monotonic() - t_wait, self.link.stream.arrived_at
            v, path = check_verdict(reply, sent, self.check)
            reported = self.check.logprobs(v.logprobs, sent.tokens_on(path) + [v.bonus])  # before anything moves
            self.inflight = None
            wait = None if sent.overlapped else self._answered_at - sent.sent_at
            self.measured.answered(wait, whole=v.accepted >= sent.chain_k)
            stats.verdict_wait_s += self._answered_at - sent.sent_at
            borne_out = False  # the round drafted ahead went out on this verdict's exact path and bonus
            if self.queued:
                # The server's test, not the client's: a tree's other path of the same length and bonus also
                # leaves it at the queued round's `after` with that root, and the round then is verified there
                # (exactly: it is the target that decides).
                first = self.queued[0]
                if (len(path), v.bonus) == (len(first.path), first.bonus):
                    borne_out = path == first.path
                    self.queued.pop(0)
                    self.inflight, self._answered_at = first.round, None
                    first.round.overlapped = True
                    stats.pipeline_hits += 1
                    stats.overlapped += 1
                    self._send_queued()
                else:
                    # Every queued round assumed this one held: the refusals of those sent come before the next
                    # verdict.
                    self.stale = [a.round.msg.round for a in self.queued if a.round.sent_at]
                    stats.pipeline_discarded += len(self.queued)
                    self.queued = []
            elif ahead is not None and (path, v.bonus) == (ahead.path, ahead.bonus) and not self.stopping.is_set():
                self._finish_and_send(ahead.round)
                stats.pipeline_hits += 1
                borne_out = True
            elif ahead is not None:
                stats.pipeline_discarded += 1
            ahead = None
            accepted = sent.tokens_on(path)
            stats.bytes_down += len(v.delta.payload)
            self.accepted = accepted  # what the delta may cover after the root
            try:
                # Verified rows come from the delta alone, however they were drafted. Under greedy, rows drafted
                # after them for the rounds now pending stay where the drafter can keep them (their tokens are
                # the ones drafted over); sampled text must not depend on which rows a draft read.
                keep = borne_out and self.cfg.temperature == 0 and self.inflight is not None
                if not keep:
                    self.drafter.discard_drafts()
                kept = self.drafter.commit(wire_delta(v.delta), keep_drafts=keep)
            finally:
                self.accepted = []
        except BaseException:
            stats.pipeline_discarded += int(ahead is not None)
            self.drop()  # the round is lost: drafting goes on after the verified positions
            raise
        self.number += 1
        stats.rounds += 1
        stats.tree_rounds += int(sent.parents is not None)
        stats.drafted += len(sent.msg.tokens)
        stats.accepted += v.accepted
        self.text.adopt(v.delta.start + len(v.delta.tokens))
        stats.rows_kept += int(kept)
        if self.inflight is not None and not kept:
            # Sent as drafted ahead: their rows went with this verdict's delta. Drafting the round after them feeds
            # their roots and main paths again, over the verified states and in one call (_draft_ahead).
            for d in self._pending():
                d.fed = 0
        stats.round_work_s += time.monotonic() - t_round - waited
        self.output.emit(accepted + [v.bonus], "verified", reported)
