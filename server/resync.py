"""Resync: a session brought back in step with a client that decoded on its own while it was cut off.

Contract (`Resyncing`, a part of tether.server.service.TetherService; the message is ResyncRequest in
proto/tether/v1/tether.proto):
- A session the server holds (the caller's, with its resume token) is truncated to the client's verified length,
  then absorbs its offline tokens (all of them under `keep`, those before the first disagreement under `rewind`);
  the reply is the delta of what was kept, the first disagreement and the target's next token. Round numbers
  restart: only streams attached after it may send rounds.
- A session it does not hold (never, evicted, expired, on an engine that died) is rebuilt from the full verified
  history under a new id (the reply's session_id, `rebuilt`); without the history: REASON_HISTORY_REQUIRED. The
  rebuild's prefill runs on a model thread and stops between chunks if its caller goes away, which retires the
  half-built session at once (tether.server.model_work).
- A reply over the message limit is refused (REASON_REPLY_TOO_LARGE): the client resyncs fewer tokens per call.

The mixin runs on the service's event loop and uses its table, checks, model threads, codecs and metrics.
"""

from __future__ import annotations

import functools
import logging

from tether.server.auth import CALLER
from tether.server.errors import Reason, RequestError
from tether.server.kv_pool import PoolExhausted
from tether.server.logprob_wire import taken_logprobs
from tether.server.plain_decoding import POOL_RETRY_S
from tether.server.sessions import Claim, Session
from tether.server.validation import check_codec, check_id, invalid
from tether.shared.ids import is_session_id
from tether.v1 import tether_pb2 as pb

log = logging.getLogger("tether.server")


class Resyncing:
    """Resync, over TetherService's state (see the module docstring)."""

    async def Resync(self, request: pb.ResyncRequest, context) -> pb.ResyncReply:
        try:
            reply = await self._resync(request, CALLER.get())
        except RequestError as e:
            await self._abort(context, e, "resync", request.session_id if is_session_id(request.session_id) else "")
        self.metrics.resyncs.labels(outcome="rebuilt" if reply.rebuilt else "extended").inc()
        log.info("session resynced", extra={"event": "resync", "session": reply.session_id, "rebuilt": reply.rebuilt,
                                            "offline_tokens": len(request.offline_tokens),
                                            "first_disagreement": reply.first_disagreement,
                                            "verified_length": reply.verified_length})  # fmt: skip
        return reply

    async def _resync(self, req: pb.ResyncRequest, caller: str) -> pb.ResyncReply:
        c = self.config
        self._need_drafter()
        self.check.fingerprint(req.model_fingerprint)
        self.check.sampling(req.sampling)
        codec = check_codec(req.delta_codec)
        offline = self.check.tokens(req.offline_tokens, "offline tokens", c.max_new_tokens + 1)
        if not offline:
            raise invalid("resync needs at least the root token")
        if req.session_id:
            check_id(req.session_id, "session_id")
        if req.resume_token:
            check_id(req.resume_token, "resume_token")
        V = req.verified_length
        held = self.table.lookup(req.session_id, caller) if req.session_id else None
        if held is not None:
            self._check_token(held, req.resume_token)
            try:
                claim = await self.table.claim(held)
            except RequestError:  # evicted since the lookup: rebuild below, as if never held
                held = None
            else:
                return await self._extend(held, claim, V, offline, req.rewind)
        history = self.check.tokens(req.history, "history", c.max_prompt_tokens + c.max_new_tokens)
        if not history or len(history) != V:
            raise RequestError(Reason.REASON_HISTORY_REQUIRED,
                               "session not held here: resend with the full verified history")  # fmt: skip
        prompt_len = req.prompt_length if req.HasField("prompt_length") else V
        if prompt_len > V:
            raise invalid(f"prompt_length must be at most {V}, the history's length")
        self.check.fits_pool(V + len(offline), "history")
        capacity = self._capacity(V + len(offline), c.max_new_tokens)
        if V + len(offline) >= capacity:
            raise RequestError(Reason.REASON_TOO_LONG, f"{V + len(offline)} positions do not fit a session")
        session, claim = await self.table.create(caller, req.sampling, codec, capacity)
        async with claim:
            try:
                prefill = functools.partial(session.verifier.open, history, prompt_len=prompt_len)
                await self._in_thread(prefill, claim=claim, stoppable=True)
            except (ValueError, PoolExhausted) as e:
                raise RequestError(Reason.REASON_CAPACITY, f"no KV memory to rebuild the session: {e}",
                                   retry_after_s=POOL_RETRY_S) from None  # fmt: skip
            self.metrics.opened.inc()
            reply = await self._absorb(session, claim, V, offline, req.rewind, rebuilt=True)
            claim.keep()
            return reply

    async def _extend(self, session: Session, claim: Claim, V: int, offline: list[int], rewind: bool):
        """Resync a held session: back to the client's verified length, then absorb its offline tokens."""
        async with claim:
            ver = session.verifier
            if V > ver.length:
                raise RequestError(Reason.REASON_OUT_OF_ORDER,
                                   f"client claims {V} verified positions, the server holds {ver.length}")  # fmt: skip
            if len(offline) > ver.cache.capacity - V:
                raise RequestError(Reason.REASON_SESSION_FULL, "too many offline tokens for this session")
            return await self._absorb(session, claim, V, offline, rewind, rebuilt=False)

    async def _absorb(self, session: Session, claim: Claim, V: int, offline: list[int], rewind: bool, *,
                      rebuilt: bool) -> pb.ResyncReply:  # fmt: skip
        try:
            disagreement, next_token, delta = await self._in_thread(
                functools.partial(session.verifier.absorb, V, offline, rewind=rewind), claim=claim
            )
        except PoolExhausted:
            raise RequestError(Reason.REASON_CAPACITY, "the KV pool is full; try again shortly",
                               retry_after_s=POOL_RETRY_S) from None  # fmt: skip
        payload = await self._in_thread(self._delta, delta, session.codec)
        session.root = next_token
        session.last_round, session.last_reply = 0, None  # round numbering restarts after a resync
        session.resyncs += 1
        reply = pb.ResyncReply(session_id=session.id, resume_token=session.resume_token, rebuilt=rebuilt,
                               first_disagreement=disagreement, target_token=next_token,
                               verified_length=session.verifier.length, delta=payload)  # fmt: skip
        if reported := taken_logprobs(session.verifier, 1):  # the next token's; a rebuild's prefill reports dropped
            reply.target_logprob.CopyFrom(reported[0])
        # Refused here rather than failing in gRPC's send: a client that retries from its verified length with
        # fewer tokens gets the same state (the cache is truncated to that length first).
        if reply.ByteSize() > self.config.max_message_bytes - 1024:
            limit = self.config.max_message_bytes
            raise RequestError(Reason.REASON_REPLY_TOO_LARGE,
                               f"the reply for {len(offline)} offline tokens would take {reply.ByteSize()} bytes, over "
                               f"the {limit}-byte message limit: resync fewer tokens per call")  # fmt: skip
        return reply
