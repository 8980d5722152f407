"""One Session stream's rounds: checked, verified by the batcher and answered, either from the stream's handler
coroutine or straight from the stream's frames.

Why two ways in: through a front end, a round used to cross the call's request queue, the Session handler's coroutine
and two async generators (the request in, the reply out), and awaited two Futures, which was about half of the
engine's event-loop time a round (issue #44). A round whose stream has nothing else to do (its handler is waiting
for the next message) is now started from the plain callback that read its frame (tether.server.call_inbox), and
answered from the batcher's completion, with the same checks, the same verdict and the same records.

Contract (all on the engine's event loop):
- `StreamRounds(engine, refused, watch)`: made by the Session handler (tether.server.service) for each stream.
  `bind(session)` once the stream has opened or attached a session: its resync count then is the stream's epoch
  (a round from a stream attached before a later resync is refused: round numbers restart after a resync).
- `await run(req)`: a round from the handler: waits for the session's other handlers, checks the round, verifies
  it, records it and returns the reply (a ServerMessage, or a VerdictFrame for a front end to encode, which
  VERDICT_FRAMES says), raising RequestError. A round number already answered gets the recorded reply again.
- `take(req, answer) -> bool`: the same round from a frame, for a stream carried by a front end. False, with
  nothing done, unless it can start at once: a bound session nobody else holds, a round that passes every check,
  no logprobs asked (their entries are built with the reply). The handler then gets the message and answers it
  as ever (a refusal included). True: `answer(reply)` is called on the loop when the round ends: its VerdictFrame,
  or an inline Error (tether.server.errors.inline) for a failure found after it started, unless `close()` came
  first. The stream's idle watch counts the round as the stream being read.
- `close()`: the stream has ended: a round taken from a frame is dropped if its step has not begun, else left to
  end, its claim released when it does, and it is never answered.
- A round through a front end is finished with the rest of its step's (the batcher's Together): `verdict_frames_of`
  makes their VERDICT frames in one call (tether.server.frontend_wire.verdict_frames).

    rounds = StreamRounds(engine, service._refused, watch)
    rounds.bind(session)
    reply = await rounds.run(message.round)
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Any

from tether.server.batcher import Together
from tether.server.engine_core import Engine
from tether.server.errors import Reason, RequestError, inline
from tether.server.frontend_wire import (
    VERDICT_FRAMES,
    VerdictFrame,
    verdict_frame,
    verdict_frames,
    verdict_message,
)
from tether.server.idle_watch import IdleWatch
from tether.server.kv_pool import PoolExhausted
from tether.server.logprob_wire import taken_logprobs
from tether.server.plain_decoding import POOL_RETRY_S
from tether.server.round_ticket import RoundTicket
from tether.server.sessions import Claim, Session
from tether.server.validation import invalid
from tether.server.verifier import SequenceVerifier
from tether.shared.codecs import Codec, CodecError, bf16_bits
from tether.shared.drafter_config import ArrayDelta
from tether.shared.speculative import DraftTree
from tether.v1 import tether_pb2 as pb

log = logging.getLogger("tether.server")

Reply = pb.ServerMessage | VerdictFrame


class StreamRounds:
    def __init__(self, engine: Engine, refused: Callable[[RequestError, str, str], None], watch: IdleWatch):
        self.engine, self.refused, self.watch = engine, refused, watch
        self.session: Session | None = None
        self.epoch = 0  # the session's resync count when this stream opened or attached it
        self.running: tuple[RoundTicket, Claim] | None = None  # a round taken from a frame, not yet answered

    def bind(self, session: Session) -> None:
        self.session, self.epoch = session, session.resyncs

    # ---- from the handler -------------------------------------------------------------------------------

    async def run(self, req: pb.DraftRound) -> Reply:
        if self.session is None:
            raise RequestError(Reason.REASON_OUT_OF_ORDER, "open or attach a session before rounds")
        claim = await self.engine.table.claim(self.session)
        async with claim as s:
            if req.round == s.last_round and s.last_reply is not None and self.epoch == s.resyncs:
                return _again(s.last_reply)  # a round sent again after a reconnect: same answer, no second run
            tree = self._admit(s, req)
            t0 = time.perf_counter()
            try:
                # The reply is made on the batcher's thread, straight after the step; a front end carrying the call
                # encodes its delta (VERDICT_FRAMES), which takes that work off the engine.
                if VERDICT_FRAMES.get() and s.verifier.logprobs is None:
                    finish = Together(verdict_frames_of, (req.round, s.codec, bool(req.parents)))
                else:
                    finish = functools.partial(self._verdict_reply, req.round, s.codec, bool(req.parents), s.verifier)
                work, here = self.engine.batcher.submit_here(s.verifier, tree, finish)
                verdict, message = await self.engine.work.wait(work, claim, here)
            except (ValueError, PoolExhausted) as e:
                raise _refusal(e) from None
            self._record(s, req, len(tree), verdict, message, t0)
            return message

    # ---- from a frame -------------------------------------------------------------------------------------

    def take(self, req: pb.DraftRound, answer: Callable[[Reply], None]) -> bool:
        s = self.session
        if s is None or self.running is not None or s.verifier.logprobs is not None or req.round == s.last_round:
            return False
        try:
            claim = self.engine.table.try_claim(s)
        except RequestError:  # evicted: the handler answers it
            return False
        if claim is None:
            return False
        try:
            tree = self._admit(s, req)
        except RequestError:
            claim.release()
            return False
        t0 = time.perf_counter()
        finish = Together(verdict_frames_of, (req.round, s.codec, bool(req.parents)))
        ended = functools.partial(self._taken_ended, s, req, len(tree), claim, answer, t0)
        work = self.engine.batcher.submit_to(s.verifier, tree, finish, self.watch.loop, ended)
        self.engine.work.track(work)
        self.running = (work, claim)
        self.watch.reading()
        return True

    def _taken_ended(
        self, s: Session, req: pb.DraftRound, n: int, claim: Claim, answer: Callable, t0: float, outcome: Any
    ) -> None:
        if self.running is None or self.running[1] is not claim:
            return  # the stream ended meanwhile: close() handed the claim over to the work
        self.running = None
        self.watch.reading()
        try:
            if isinstance(outcome, Exception):
                if isinstance(outcome, (ValueError, PoolExhausted)):
                    raise _refusal(outcome)
                log.error("internal error", exc_info=outcome, extra={"event": "error", "session": s.id})
                raise RequestError(Reason.REASON_INTERNAL, f"internal error: {type(outcome).__name__}")
            verdict, message = outcome
            self._record(s, req, n, verdict, message, t0)
        except RequestError as e:
            self.refused(e, "round", s.id)
            message = inline(e, req.round)
        finally:
            claim.release()
        answer(message)

    def close(self) -> None:
        if self.running is not None:
            work, claim = self.running
            self.running = None
            self.engine.work.drop(work, claim)

    # ---- shared ------------------------------------------------------------------------------------------

    def _admit(self, s: Session, req: pb.DraftRound) -> DraftTree:
        """The round's draft tree, once the round is the one the session expects and fits; RequestError if not."""
        if self.epoch != s.resyncs:
            # Round numbers restart after a resync: a late round from a stream attached before it must not be
            # taken (or recorded) as the new numbering's round.
            raise RequestError(Reason.REASON_OUT_OF_ORDER, "the session was resynced since this stream attached")
        stands = (s.last_round + 1, s.root, s.verifier.length)
        if req.after_length and (req.round, req.root, req.after_length) != stands:
            # Sent before the verdict of the round before it, on a guess of that verdict which did not hold.
            raise RequestError(
                Reason.REASON_STALE_ROUND,
                f"round {req.round} assumed {req.after_length} verified positions and root "
                f"{req.root}; the session stands at {s.verifier.length}, root {s.root}",
            )
        if req.round != s.last_round + 1:
            raise RequestError(
                Reason.REASON_OUT_OF_ORDER, f"round {req.round} out of order: expected {s.last_round + 1}"
            )
        if req.root != s.root:
            raise RequestError(
                Reason.REASON_OUT_OF_ORDER, f"round root {req.root} is not the last decided token {s.root}"
            )
        tree = self.engine.check.draft_tree(req, self.engine.config.max_draft_tokens)
        if len(tree) > s.verifier.room:
            raise RequestError(
                Reason.REASON_SESSION_FULL, f"{len(tree)} tokens do not fit the {s.verifier.room} positions left"
            )
        return tree

    def _record(self, s: Session, req: pb.DraftRound, n: int, verdict, message: Reply, t0: float) -> None:
        self.engine.metrics.rounds.round(n - 1, verdict.accepted, time.perf_counter() - t0)
        s.root, s.last_round, s.last_reply = verdict.bonus, req.round, message

    def _verdict_reply(
        self, round_no: int, codec: Codec, tree_round: bool, verifier: SequenceVerifier, result: tuple
    ) -> tuple:
        """(verdict, its ServerMessage) from a round's (verdict, delta). A tree round's reply names the accepted
        nodes (`path`, the root left out); a chain round's is what it has always been. With logprobs asked, the
        round's emitted tokens' entries go with it."""
        verdict, delta = result
        try:
            payload = self.engine.encode_delta(delta, codec)
        except CodecError as e:  # the session's codec was checked at open: this is the server's fault, not the call's
            raise RuntimeError(f"encoding a round's delta failed: {e}") from e
        v = pb.Verdict(
            round=round_no,
            accepted=verdict.accepted,
            bonus=verdict.bonus,
            delta=payload,
            path=verdict.path[1:] if tree_round else (),
            logprobs=taken_logprobs(verifier, verdict.accepted + 1),
        )
        return verdict, pb.ServerMessage(verdict=v)


def verdict_frames_of(rows: list[tuple[tuple[int, Codec, bool], tuple]]) -> list:
    """A step's rounds through front ends (the batcher's Together): each round's (round number, codec, whether a
    tree round) and (verdict, delta) -> (verdict, its VERDICT frame), _verdict_reply's reply for the front end
    carrying the call, which encodes its delta (torch tensors first become the bfloat16 bits encode_delta would
    send). The frames are made for the whole step at once; should that fail, one by one, so a row that cannot be
    framed fails alone (its outcome the exception)."""
    framed = []
    for (round_no, codec, tree_round), (verdict, delta) in rows:
        if not isinstance(delta, ArrayDelta):
            delta = ArrayDelta(delta.start, delta.tokens, {k: bf16_bits(t) for k, t in delta.tensors.items()})
        path = verdict.path[1:] if tree_round else ()
        framed.append((round_no, verdict.accepted, verdict.bonus, path, delta, codec))
    try:
        frames: list = verdict_frames(framed)
    except Exception:
        frames = []
        for row in framed:
            try:
                frames.append(verdict_frame(*row))
            except Exception as e:
                frames.append(e)
    return [f if isinstance(f, Exception) else (v, f) for (_, (v, _)), f in zip(rows, frames, strict=True)]


def _refusal(e: ValueError | PoolExhausted) -> RequestError:
    if isinstance(e, PoolExhausted):
        return RequestError(
            Reason.REASON_CAPACITY, "the KV pool is full; try again shortly", retry_after_s=POOL_RETRY_S
        )
    return invalid(str(e))


def _again(reply: Reply) -> Reply:
    """The recorded reply for a stream of this call's kind: a VERDICT frame recorded through a front end is
    answered in process as the message that front end made of it (a front end takes either)."""
    if isinstance(reply, VerdictFrame) and not VERDICT_FRAMES.get():
        return pb.ServerMessage.FromString(verdict_message(reply.payload)[0])
    return reply
