"""The gRPC service `tether.v1.Tether`: model info, weight streaming, verification sessions, resync, close.

Contract (the messages are in proto/tether/v1/tether.proto):
- GetModelInfo: identities (model, tokenizer and drafter fingerprints), TLI depth, codecs, limits, chat format,
  and what a token of a Generate stream takes now (decode_step_s: tether.server.decode_pace), filled in per call.
- FetchWeights: the manifest of the client part (tether.shared.weights), then chunks of at most 1 MiB, from
  any (tensor, offset); REASON_MODEL_MISMATCH when the client expects other weights. As tensors or as ONNX files
  exported on the first request per precision (tether.server.client_export; a failed export: REASON_INTERNAL), or
  the tokenizer alone (CLIENT_PART_TOKENIZER: its canonical JSON, whose sha256 is ModelInfo.tokenizer_sha256).
- Session: `open` prefills and answers the first token and the prompt's KV delta; each `round` (a draft chain,
  or a draft tree when it carries `parents`) is verified (tether.server.verifier, batched with other sessions'
  rounds by tether.server.batcher) and answered with accepted count, bonus token and delta, and for a tree the
  accepted path. Round numbers make a repeated round idempotent (the recorded answer is sent again). A round with
  `after_length` was sent before the verdict it depends on (overlapping): a stream's messages are taken in order,
  so it is verified straight after that verdict if the session then stands at that length with its root, and is
  otherwise refused alone as REASON_STALE_ROUND. A bad message gets an inline Error (status code, reason, retry
  advice) and the stream goes on. `attach` lets a new stream take over a held session (session id + resume token),
  e.g. after a Resync. With SamplingParams.logprobs the first token's and each verdict's emitted tokens' (accepted
  drafts, then the bonus) log-probabilities go with them (Opened.first_logprob, Verdict.logprobs: the processed
  distribution, tether.server.logprob_wire).
  A stream that sends nothing for `stream_idle_s` is closed (REASON_STREAM_IDLE); its session stays held.
- Resync: after a disconnection, truncate to the client's verified length, absorb its offline tokens (all of
  them under `keep`, those before the first disagreement under `rewind`) and answer the delta, the first
  disagreement and the next token. A session the server does not hold is rebuilt from the full history under a
  new id (the reply's session_id); without the history the answer is REASON_HISTORY_REQUIRED
  (tether.server.resync).
- Close frees a session. Generate: server-side decoding streamed token by token (the baseline;
  tether.server.plain_decoding, which the OpenAI-compatible HTTP API decodes through too), or with `serve
  --server-draft` speculative decoding with the drafter on the server (tether.server.server_draft), as exact.
- Without a drafter (`serve --drafter none`) ModelInfo says `server_only`, and Session, Resync and FetchWeights
  of anything but the tokenizer answer REASON_NO_DRAFTER; Generate and the HTTP API work as ever, and a client
  fetches the tokenizer to encode its prompts and decode the stream.
grpc.health.v1 and reflection are served beside it (tether.server.rpc_server).

Trust: every field is validated before anything is allocated or logged (ids have the server's shape, tokens
are in the vocabulary, sampling values are finite and in range, lengths within the limits); every refusal is a
tether.server.errors.RequestError with its reason; every session's KV is owned by tether.server.sessions, which
gives it back on every error path, on Close, on eviction and when its lease ends. Authentication and call limits
run before any handler (tether.server.auth); a session is bound to the key that opened it and does not exist for
other keys. Running out of room (sessions, KV memory, streams) is retryable: REASON_CAPACITY with retry advice.

State: every piece of it (models, pool, session table, batcher, model threads, client part, ModelInfo, plain
decoding) is the engine's (tether.server.engine_core); these handlers only check, route and answer.
Threads: handlers are coroutines on the server's event loop; prefill, resync absorbs, Generate steps and delta
encoding run on `model_threads` threads, rounds on the batcher's thread, so the loop only routes messages. Work
whose caller has gone never starts (a long prefill stops between chunks), and a caller has at most
`max_model_calls_per_caller` calls waiting for the model threads (tether.server.model_work).

    engine = Engine(target, drafter, tokenizer, ServiceConfig(), model_fingerprint=fp)   # or Engine.build(ServeConfig)
    service = TetherService(engine)
    server, port = make_server(service, "127.0.0.1:50051"); server.start()  # tether.server.rpc_server
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import AsyncIterator

import grpc

from tether.server.auth import CALLER
from tether.server.call_inbox import CALL_INBOX
from tether.server.engine_core import PROTOCOL_VERSION, Engine
from tether.server.errors import Reason, RequestError, inline, status_metadata
from tether.server.idle_watch import IdleWatch
from tether.server.kv_pool import PoolExhausted
from tether.server.logprob_wire import taken_logprobs, wire_logprobs
from tether.server.plain_decoding import POOL_RETRY_S
from tether.server.resync import resync
from tether.server.serve_config import ServiceConfig
from tether.server.sessions import Session
from tether.server.stream_rounds import StreamRounds
from tether.server.validation import invalid, pick_codec, requested_logprobs
from tether.shared.ids import is_session_id
from tether.shared.weights import MAX_CHUNK, iter_chunks
from tether.v1 import tether_pb2 as pb
from tether.v1 import tether_pb2_grpc

__all__ = ["PROTOCOL_VERSION", "TetherService"]
log = logging.getLogger("tether.server")


class TetherService(tether_pb2_grpc.TetherServicer):
    """The gRPC handlers over one engine (tether.server.engine_core), which owns every piece of state they touch."""

    def __init__(self, engine: Engine):
        self.engine = engine

    # ---- what the server runs beside the handlers (tether.server.rpc_server.Servable) -------------------------

    @property
    def config(self) -> ServiceConfig:
        return self.engine.config

    async def housekeeping(self) -> None:
        await self.engine.housekeeping()

    def stop_work(self) -> None:
        self.engine.stop_work()

    def release_all(self) -> None:
        self.engine.release_all()

    def delta_bytes_sent(self, n: int) -> None:
        self.engine.metrics.kv_delta_bytes.inc(n)

    def _refused(self, e: RequestError, what: str, session: str = "") -> None:
        extra = {"event": "refused", "call": what, "code": e.code.name, "reason": e.reason_name, "detail": e.message}
        if e.reason == Reason.REASON_STALE_ROUND:  # routine (a pipelined client's missed guess), not news
            self.engine.metrics.stale_rounds.inc()
            log.debug("request refused", extra=extra | {"session": session})
            return
        self.engine.metrics.errors.labels(code=e.code.name).inc()
        log.info("request refused", extra=extra | ({"session": session} if session else {}))

    async def _abort(self, context: grpc.aio.ServicerContext, e: RequestError, what: str, session: str = ""):
        self._refused(e, what, session)
        await context.abort(e.code, e.message, status_metadata(e))

    # ---- unary RPCs -------------------------------------------------------------------------------------

    async def GetModelInfo(self, request, context) -> pb.ModelInfo:
        info = pb.ModelInfo()
        info.CopyFrom(self.engine.model_info)
        info.decode_step_s = self.engine.decoding.step_s()
        return info

    async def FetchWeights(self, request, context) -> AsyncIterator[pb.WeightChunk]:
        try:
            if request.format != pb.CLIENT_PART_TOKENIZER:  # the tokenizer alone comes from any server
                self.engine.need_drafter()
            self.engine.check.fingerprint(request.model_fingerprint)
            size = request.max_chunk_bytes or MAX_CHUNK
            if size > MAX_CHUNK:
                raise invalid(f"max_chunk_bytes above {MAX_CHUNK}")
            files, manifest = await self.engine.client_part(request.format)
            try:
                chunks = iter_chunks(files, manifest, request.resume_tensor, request.resume_offset, size)
                first = next(chunks, None)  # validates the resume point before anything is sent
            except (KeyError, ValueError):
                raise invalid("resume_tensor / resume_offset is not a point in the manifest") from None
        except RequestError as e:
            await self._abort(context, e, "fetch_weights")
        yield pb.WeightChunk(
            manifest=pb.WeightManifest(
                model_fingerprint=self.engine.model_fingerprint,
                drafter_fingerprint=self.engine.drafter_fingerprint,
                tensors=[
                    pb.TensorEntry(name=e.name, dtype=e.dtype, shape=e.shape, nbytes=e.nbytes, sha256=e.sha256)
                    for e in manifest
                ],
                format=request.format,
            )
        )
        if request.manifest_only:
            return
        sent = self.engine.metrics.bytes_out.labels(kind="weights")
        for name, offset, data in itertools.chain([first], chunks) if first is not None else ():
            sent.inc(len(data))
            yield pb.WeightChunk(chunk=pb.TensorChunk(tensor=name, offset=offset, data=data))

    async def Close(self, request, context) -> pb.CloseReply:
        try:
            session = self.engine.owned(request.session_id, CALLER.get())
            async with await self.engine.table.claim(session):
                self.engine.table.retire(session, "closed")
        except RequestError as e:
            if e.reason == Reason.REASON_SESSION_EVICTED:
                return pb.CloseReply()  # gone already: what the caller wanted
            await self._abort(context, e, "close")
        return pb.CloseReply()

    # ---- Session streams ---------------------------------------------------------------------------------

    async def Session(self, request_iterator, context) -> AsyncIterator[pb.ServerMessage]:
        caller = CALLER.get()
        messages = aiter(request_iterator)
        watch = IdleWatch(self.engine.config.stream_idle_s)  # one timer per stream, not per message
        rounds = StreamRounds(self.engine, self._refused, watch)
        inbox = CALL_INBOX.get()  # a front end's call: its rounds may start straight from their frames
        unanswered: Session | None = None  # opened here, its Opened not yet handed to gRPC
        try:
            while True:
                try:
                    watch.reading()
                    message = await anext(messages)
                    watch.read()
                except StopAsyncIteration:
                    return
                except asyncio.CancelledError:
                    if not watch.expired():
                        raise
                    e = RequestError(
                        Reason.REASON_STREAM_IDLE, f"the stream sent nothing for {watch.idle_s:g} s; reconnect"
                    )
                    await self._abort(context, e, "session", rounds.session.id if rounds.session else "")
                kind = message.WhichOneof("body")
                round_no = message.round.round if kind == "round" else 0
                session = rounds.session
                try:
                    if kind == "open":
                        if session is not None:
                            raise RequestError(Reason.REASON_OUT_OF_ORDER, "this stream already has a session")
                        session, replies = await self._open(message.open, caller)
                        rounds.bind(session)
                        unanswered = session
                    elif kind == "attach":
                        if session is not None:
                            raise RequestError(Reason.REASON_OUT_OF_ORDER, "this stream already has a session")
                        session, reply = await self._attach(message.attach, caller)
                        rounds.bind(session)
                        replies = [reply]
                    elif kind == "round":
                        replies = [await rounds.run(message.round)]
                    else:
                        raise invalid("empty client message")
                except RequestError as e:
                    self._refused(e, kind or "empty", session.id if session else "")
                    replies = [inline(e, round_no)]
                except Exception as e:  # a bug must cost one message, not the stream or the server
                    log.exception("internal error", extra={"event": "error", "session": session.id if session else ""})
                    replies = [
                        inline(RequestError(Reason.REASON_INTERNAL, f"internal error: {type(e).__name__}"), round_no)
                    ]
                for reply in replies:
                    yield reply
                unanswered = None
                if inbox is not None and rounds.session is not None:
                    inbox.take_rounds(rounds.take)
        finally:
            rounds.close()
            watch.close()
            if unanswered is not None:  # the call ended inside the yield: its client never learnt the session's id
                self.engine.table.abandon(unanswered)

    async def _open(self, req: pb.OpenSession, caller: str) -> tuple[Session, list[pb.ServerMessage]]:
        c = self.engine.config
        self.engine.need_drafter()
        self.engine.check.fingerprint(req.model_fingerprint)
        prompt = self.engine.check.tokens(req.prompt, "prompt", c.max_prompt_tokens)
        if not prompt:
            raise invalid("empty prompt")
        self.engine.check.sampling(req.sampling)
        codec = pick_codec(req.delta_codec, req.accept_codecs)
        if len(req.request_id) > 128:
            raise invalid("request_id is longer than 128 characters")
        self.engine.check.fits_pool(len(prompt), "prompt")
        capacity = self.engine.capacity(len(prompt), self.engine.config.max_new(req.max_new_tokens))
        session, claim = await self.engine.table.create(caller, req.sampling, codec, capacity)
        async with claim:
            try:
                first, delta = await self.engine.in_thread(session.verifier.open, prompt, claim=claim, stoppable=True)
                parts = await self.engine.in_thread(self.engine.delta_parts, delta, codec)
            except (ValueError, PoolExhausted) as e:
                raise RequestError(
                    Reason.REASON_CAPACITY, f"no KV memory for the prompt: {e}", retry_after_s=POOL_RETRY_S
                ) from None
            session.root = first
            claim.keep()
        self.engine.metrics.opened.inc()
        log.info(
            "session opened",
            extra={
                "event": "open",
                "session": session.id,
                "key": caller[:12],
                "prompt_tokens": len(prompt),
                "temperature": req.sampling.temperature,
            },
        )
        opened = pb.Opened(
            request_id=req.request_id,
            session_id=session.id,
            resume_token=session.resume_token,
            first_token=first,
            delta=parts[0],
            delta_parts=len(parts) - 1,
        )
        if reported := taken_logprobs(session.verifier, 1):
            opened.first_logprob.CopyFrom(reported[0])
        return session, [pb.ServerMessage(opened=opened)] + [pb.ServerMessage(delta=p) for p in parts[1:]]

    async def _attach(self, req: pb.AttachSession, caller: str) -> tuple[Session, pb.ServerMessage]:
        """A new stream takes over a held session (after a reconnect): rounds continue where it stands. Returns the
        session and the reply."""
        self.engine.need_drafter()
        session = self.engine.owned(req.session_id, caller)
        self.engine.check_resume_token(session, req.resume_token)
        async with await self.engine.table.claim(session):
            attached = pb.Attached(
                session_id=session.id,
                verified_length=session.verifier.length,
                root=session.root,
                last_round=session.last_round,
            )
        return session, pb.ServerMessage(attached=attached)

    # ---- Resync and Generate --------------------------------------------------------------------------------

    async def Resync(self, request: pb.ResyncRequest, context) -> pb.ResyncReply:
        try:
            reply = await resync(self.engine, request, CALLER.get())
        except RequestError as e:
            await self._abort(context, e, "resync", request.session_id if is_session_id(request.session_id) else "")
        self.engine.metrics.resyncs.labels(outcome="rebuilt" if reply.rebuilt else "extended").inc()
        log.info(
            "session resynced",
            extra={
                "event": "resync",
                "session": reply.session_id,
                "rebuilt": reply.rebuilt,
                "offline_tokens": len(request.offline_tokens),
                "first_disagreement": reply.first_disagreement,
                "verified_length": reply.verified_length,
            },
        )
        return reply

    async def Generate(self, request: pb.OpenSession, context) -> AsyncIterator[pb.GeneratedTokens]:
        """Server-only decoding, streamed: plain, or drafted here with --server-draft (engine.decoding)."""
        try:
            self.engine.check.fingerprint(request.model_fingerprint)
            prompt = self.engine.decoding.check_generation(request.prompt, request.sampling)
        except RequestError as e:
            await self._abort(context, e, "generate")
        top = requested_logprobs(request.sampling)  # checked by check_generation
        reported = None if top is None else []
        chunks = self.engine.decoding.decode(
            prompt,
            request.sampling,
            request.max_new_tokens,
            logprobs=reported,
            stop_ids=self.engine.decoding.stop_ids(request.sampling),
            top_logprobs=top or 0,
        )
        try:
            async with contextlib.aclosing(chunks):
                async for chunk in chunks:
                    self.engine.metrics.bytes_out.labels(kind="tokens").inc(4 * len(chunk))
                    entries = wire_logprobs(reported[-len(chunk) :]) if reported is not None else ()
                    yield pb.GeneratedTokens(tokens=chunk, logprobs=entries)
        except RequestError as e:
            await self._abort(context, e, "generate")
