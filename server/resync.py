"""Resync: a session brought back in step with a client that decoded on its own while it was cut off.

Contract (`resync(engine, request, caller)`, which the Resync handler of tether.server.service awaits; the message is
ResyncRequest in proto/tether/v1/tether.proto):
- A session the server holds (the caller's, with its resume token) is truncated to the client's verified length,
  then absorbs its offline tokens (all of them under `keep`, those before the first disagreement under `rewind`);
  the reply is the delta of what was kept, the first disagreement and the target's next token. Round numbers
  restart: only streams attached after it may send rounds.
- A session it does not hold (never, evicted, expired, on an engine that died) is rebuilt from the full verified
  history under a new id (the reply's session_id, `rebuilt`); without the history: REASON_HISTORY_REQUIRED. The
  rebuild's prefill runs on a model thread and stops between chunks if its caller goes away, which retires the
  half-built session at once (tether.server.model_work).
- A reply over the message limit is refused (REASON_REPLY_TOO_LARGE): the client resyncs fewer tokens per call.

It runs on the engine's event loop (tether.server.engine_core) and uses its table, checks, model threads and codecs.
"""

from __future__ import annotations

import functools

from tether.server.engine_core import Engine
from tether.server.errors import Reason, RequestError
from tether.server.kv_pool import PoolExhausted
from tether.server.logprob_wire import taken_logprobs
from tether.server.plain_decoding import POOL_RETRY_S
from tether.server.sessions import Claim, Session
from tether.server.validation import check_id, invalid, pick_codec
from tether.v1 import tether_pb2 as pb


async def resync(engine: Engine, req: pb.ResyncRequest, caller: str) -> pb.ResyncReply:
    """The reply to a checked caller's Resync (see the module docstring), or a RequestError."""
    c = engine.config
    engine.need_drafter()
    engine.check.fingerprint(req.model_fingerprint)
    engine.check.sampling(req.sampling)
    codec = pick_codec(req.delta_codec, req.accept_codecs)
    offline = engine.check.tokens(req.offline_tokens, "offline tokens", c.max_new_tokens + 1)
    if not offline:
        raise invalid("resync needs at least the root token")
    if req.session_id:
        check_id(req.session_id, "session_id")
    if req.resume_token:
        check_id(req.resume_token, "resume_token")
    V = req.verified_length
    held = engine.table.lookup(req.session_id, caller) if req.session_id else None
    if held is not None:
        engine.check_resume_token(held, req.resume_token)
        try:
            claim = await engine.table.claim(held)
        except RequestError:  # evicted since the lookup: rebuild below, as if never held
            held = None
        else:
            return await _extend(engine, held, claim, V, offline, req.rewind)
    history = engine.check.tokens(req.history, "history", c.max_prompt_tokens + c.max_new_tokens)
    if not history or len(history) != V:
        raise RequestError(
            Reason.REASON_HISTORY_REQUIRED, "session not held here: resend with the full verified history"
        )
    prompt_len = req.prompt_length if req.HasField("prompt_length") else V
    if prompt_len > V:
        raise invalid(f"prompt_length must be at most {V}, the history's length")
    engine.check.fits_pool(V + len(offline), "history")
    capacity = engine.capacity(V + len(offline), c.max_new_tokens)
    if V + len(offline) >= capacity:
        raise RequestError(Reason.REASON_TOO_LONG, f"{V + len(offline)} positions do not fit a session")
    session, claim = await engine.table.create(caller, req.sampling, codec, capacity)
    async with claim:
        try:
            prefill = functools.partial(session.verifier.open, history, prompt_len=prompt_len)
            await engine.in_thread(prefill, claim=claim, stoppable=True)
        except (ValueError, PoolExhausted) as e:
            raise RequestError(
                Reason.REASON_CAPACITY, f"no KV memory to rebuild the session: {e}", retry_after_s=POOL_RETRY_S
            ) from None
        engine.metrics.opened.inc()
        reply = await _absorb(engine, session, claim, V, offline, req.rewind, rebuilt=True)
        claim.keep()
        return reply


async def _extend(engine: Engine, session: Session, claim: Claim, V: int, offline: list[int], rewind: bool):
    """Resync a held session: back to the client's verified length, then absorb its offline tokens."""
    async with claim:
        ver = session.verifier
        if V > ver.length:
            raise RequestError(
                Reason.REASON_OUT_OF_ORDER, f"client claims {V} verified positions, the server holds {ver.length}"
            )
        if len(offline) > ver.cache.capacity - V:
            raise RequestError(Reason.REASON_SESSION_FULL, "too many offline tokens for this session")
        return await _absorb(engine, session, claim, V, offline, rewind, rebuilt=False)


async def _absorb(
    engine: Engine, session: Session, claim: Claim, V: int, offline: list[int], rewind: bool, *, rebuilt: bool
) -> pb.ResyncReply:
    try:
        disagreement, next_token, delta = await engine.in_thread(
            functools.partial(session.verifier.absorb, V, offline, rewind=rewind), claim=claim
        )
    except PoolExhausted:
        raise RequestError(
            Reason.REASON_CAPACITY, "the KV pool is full; try again shortly", retry_after_s=POOL_RETRY_S
        ) from None
    payload = await engine.in_thread(engine.encode_delta, delta, session.codec)
    session.root = next_token
    session.last_round, session.last_reply = 0, None  # round numbering restarts after a resync
    session.resyncs += 1
    reply = pb.ResyncReply(
        session_id=session.id,
        resume_token=session.resume_token,
        rebuilt=rebuilt,
        first_disagreement=disagreement,
        target_token=next_token,
        verified_length=session.verifier.length,
        delta=payload,
    )
    if reported := taken_logprobs(session.verifier, 1):  # the next token's; a rebuild's prefill reports dropped
        reply.target_logprob.CopyFrom(reported[0])
    # Refused here rather than failing in gRPC's send: a client that retries from its verified length with
    # fewer tokens gets the same state (the cache is truncated to that length first).
    if reply.ByteSize() > engine.config.max_message_bytes - 1024:
        limit = engine.config.max_message_bytes
        raise RequestError(
            Reason.REASON_REPLY_TOO_LARGE,
            f"the reply for {len(offline)} offline tokens would take {reply.ByteSize()} bytes, over "
            f"the {limit}-byte message limit: resync fewer tokens per call",
        )
    return reply
