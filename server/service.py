"""The gRPC service `tether.v1.Tether`: model info, weight streaming, verification sessions, resync, close.

Contract (the messages are in proto/tether/v1/tether.proto):
- GetModelInfo: identities (model, tokenizer and drafter fingerprints), TLI depth, codecs, limits, chat format.
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
- Close frees a session. Generate: plain server-side decoding streamed token by token (the baseline;
  tether.server.plain_decoding, which the OpenAI-compatible HTTP API decodes through too).
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

Threads: handlers are coroutines on the server's event loop; prefill, resync absorbs, Generate steps and delta
encoding run on `model_threads` threads, rounds on the batcher's thread, so the loop only routes messages. Work
whose caller has gone never starts (a long prefill stops between chunks), and a caller has at most
`max_model_calls_per_caller` calls waiting for the model threads (tether.server.model_work).

    service = TetherService(target, drafter, tokenizer, ServiceConfig(), model_fingerprint=fp)
    server, port = make_server(service, "127.0.0.1:50051"); server.start()  # tether.server.rpc_server
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import logging
import os
import secrets
import weakref
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import torch

from tether.server.auth import CALLER
from tether.server.batcher import RoundBatcher
from tether.server.client_export import FORMATS, ClientExporter, ExportError
from tether.server.errors import Reason, RequestError, inline, status_metadata
from tether.server.idle_watch import IdleWatch
from tether.server.kv_pool import KVPool, PoolExhausted
from tether.server.logprob_wire import taken_logprobs
from tether.server.metrics import ServiceMetrics
from tether.server.model_work import ModelWork
from tether.server.plain_decoding import POOL_RETRY_S, PlainDecoding
from tether.server.resync import Resyncing
from tether.server.sessions import Claim, Session, SessionTable, TableLimits
from tether.server.validation import Checks, check_codec, check_id, invalid, requested_logprobs, sampling_controls
from tether.server.verifier import SequenceVerifier
from tether.shared import wire
from tether.shared.chat_template import ChatFormat
from tether.shared.codecs import Codec, CodecError, encode_many
from tether.shared.drafter import DraftDelta
from tether.shared.drafter_config import ArrayDelta
from tether.shared.model import Transformer
from tether.shared.tokenizer import Tokenizer
from tether.shared.weights import (
    MAX_CHUNK,
    TOKENIZER_TENSOR,
    build_manifest,
    client_part_tensors,
    drafter_fingerprint,
    iter_chunks,
    tokenizer_part,
    tokenizer_tensor,
)
from tether.v1 import tether_pb2 as pb
from tether.v1 import tether_pb2_grpc

PROTOCOL_VERSION = 1
log = logging.getLogger("tether.server")


@dataclass(frozen=True)
class ServiceConfig:
    max_sessions: int = 256  # sessions held at once; past it the least recently used idle one is evicted
    max_prompt_tokens: int = 1536  # longest prompt accepted
    max_draft_tokens: int = 64  # draft tokens per round
    max_new_tokens: int = 1024  # default and upper bound of a session's generation length
    max_message_bytes: int = 4 << 20  # gRPC message limit both ways
    model_id: str = "tether-default"  # reported in ModelInfo
    api_keys: frozenset[str] = frozenset()  # accepted bearer keys; empty = no authentication (loopback use)
    max_sessions_per_key: int = 64  # sessions one key may hold at once
    max_calls_per_key: int = 512  # calls one key may have in flight at once (with api_keys)
    max_streams: int = 4096  # Session and Generate streams open at once, over all callers
    session_lease_s: float = 300.0  # a session idle this long expires: its quota and KV go back
    stream_idle_s: float = 120.0  # a Session stream that sends nothing this long is closed (its session stays)
    batch_window_s: float = 0.0  # extra wait for more rounds before each step (0: continuous batching)
    max_batch: int = 128  # rounds per step at most (the largest step bucket)
    kv_pool_bytes: int = 256 << 20  # memory of the paged KV pool all sessions share
    kv_block_size: int = 16  # positions per KV block
    prefill_chunk: int = 2048  # prompt / resync-history positions per prefill forward (bounds attention memory)
    model_threads: int = 2  # threads for prefills, resync absorbs and Generate steps
    max_model_calls_per_caller: int = 128  # calls of one key (or, without keys, one host) waiting for those threads
    engine: int | None = None  # with serve --engines: this process's index, written into its session ids


class TetherService(PlainDecoding, Resyncing, tether_pb2_grpc.TetherServicer):
    def __init__(
        self,
        target: Transformer,
        drafter,
        tokenizer: Tokenizer,
        config: ServiceConfig | None = None,
        *,
        model_fingerprint: str,
        client_weights: dict[str, torch.Tensor] | None = None,
        pool: KVPool | None = None,
        export_dir: str | os.PathLike | None = None,
        chat_format: ChatFormat | None = None,
    ):
        """`drafter` None serves without one (server-only decoding). `client_weights` and `pool` are for a
        tensor-parallel target (tether.server.tp_serve), whose own weights are sharded: the client part computed
        before sharding, and rank 0's mirrored pool shard. `export_dir` keeps the ONNX client part's exports across
        restarts (None: a temporary directory). `chat_format`: the model's chat template (None: the built-in one)."""
        self.target, self.drafter, self.tokenizer = target, drafter, tokenizer
        self.chat_format = chat_format or ChatFormat.builtin_for(tokenizer)
        self.config = c = config or ServiceConfig()
        self.model_fingerprint = model_fingerprint
        # The tokenizer alone, for clients that decode with Generate, drafter or not: named by the tokenizer's hash.
        self.tokenizer_files, self.tokenizer_manifest = tokenizer_part(tokenizer.to_json())
        if self.tokenizer_manifest[0].sha256 != tokenizer.sha256:  # both hash the same canonical JSON
            raise RuntimeError("the tokenizer part's sha256 is not the tokenizer's (shared/weights.py, tokenizer.py)")
        # Without a drafter (`serve --drafter none`) there is no client part: only Generate and the HTTP API decode.
        self.weights: dict[str, torch.Tensor] = {}
        self.manifest: list = []
        self.drafter_fingerprint = ""
        self.exporter: ClientExporter | None = None
        if drafter is not None:
            part = client_weights if client_weights is not None else client_part_tensors(target, drafter)
            self.weights = {k: v.detach().to("cpu", torch.bfloat16 if v.is_floating_point() else v.dtype)
                            for k, v in part.items()}  # fmt: skip
            # The tokenizer travels with the weights (resumable, cached by hash): a client needs only an address.
            self.weights[TOKENIZER_TENSOR] = tokenizer_tensor(tokenizer.to_json())
            self.manifest = build_manifest(self.weights)
            self.drafter_fingerprint = drafter_fingerprint(drafter.dcfg.to_dict(), self.manifest)
            self.exporter = ClientExporter(target.cfg, drafter.dcfg, self.weights, self.drafter_fingerprint,
                                           export_dir)  # fmt: skip
        drafting = [pb.CLIENT_PART_TENSORS, *FORMATS] if drafter is not None else []
        # Every id that ends a generation: the tokenizer's (config.json / generation_config.json lists, its own
        # end-of-text) and the chat format's generation_config ids, first one first.
        self.eos_ids = tuple(dict.fromkeys([*tokenizer.eos_ids, *self.chat_format.extra_stop_ids]))
        self.model_info = pb.ModelInfo(
            protocol_version=PROTOCOL_VERSION,
            model_id=c.model_id,
            model_config_json=json.dumps(target.cfg.to_dict()),
            model_fingerprint=model_fingerprint,
            tokenizer_sha256=tokenizer.sha256,
            drafter_config_json=json.dumps(drafter.dcfg.to_dict()) if drafter is not None else "",
            drafter_fingerprint=self.drafter_fingerprint,
            tli_layers=drafter.dcfg.tli if drafter is not None else 0,
            codecs=[pb.CODEC_RAW, pb.CODEC_FP16_SHUFFLE_ZSTD, pb.CODEC_INT8_ZSTD],
            max_prompt_tokens=c.max_prompt_tokens,
            max_draft_tokens=c.max_draft_tokens,
            max_message_bytes=c.max_message_bytes,
            client_part_formats=[*drafting, pb.CLIENT_PART_TOKENIZER],  # the tokenizer alone from any server
            server_only=drafter is None,
            chat_format_json=self.chat_format.to_json(),
            max_tree_nodes=c.max_draft_tokens if drafter is not None else 0,  # a tree's nodes take a chain's room
            eos_id=self.eos_ids[0] if self.eos_ids else None,  # None leaves it unset
            overlapping_rounds=drafter is not None,
            eos_ids=self.eos_ids,
            clean_up_tokenization_spaces=tokenizer.clean_up_spaces,  # an edge decodes as the model folder asks
            sampling_controls=True,
        )  # what GetModelInfo answers: built once (the tokenizer's hash alone takes milliseconds)
        self.metrics = ServiceMetrics()
        self.pool = pool or KVPool.for_budget(target.cfg, c.kv_pool_bytes, c.kv_block_size, device=target.device,
                                              dtype=target.embed_tokens.weight.dtype)  # fmt: skip
        limits = TableLimits(c.max_sessions, c.max_sessions_per_key, c.session_lease_s, c.engine)
        self.table = SessionTable(self.pool, self._verifier, limits, metrics=self.metrics)
        self.check = Checks(target.cfg.vocab_size, model_fingerprint, self.pool)
        self.metrics.kv_blocks.set(self.pool.num_blocks)
        # Weakly: the batcher's threads reach this gauge, and would hold the pool and the service through it.
        pool = weakref.ref(self.pool)
        self.metrics.kv_blocks_used.set_function(lambda: p.used_blocks if (p := pool()) is not None else 0)
        self.batcher = RoundBatcher(target, window_s=c.batch_window_s, max_batch=c.max_batch,
                                    on_batch=self.metrics.observe_batch)  # fmt: skip
        self.work = ModelWork(c.model_threads, c.max_model_calls_per_caller)
        # A service dropped without close() (an embedding program's, a test's) still ends its threads, and so frees its
        # KV pool; close() is the orderly way.
        # Not at interpreter exit, though: the threads are daemons then, and ending them midway aborts the process.
        for done in (weakref.finalize(self, RoundBatcher.close, self.batcher),
                     weakref.finalize(self, self.work.close, False)):  # fmt: skip
            done.atexit = False
        self._generating = 0  # Generate streams decoding now

    @property
    def sessions(self) -> dict[str, Session]:
        """The sessions held now, by id (a snapshot)."""
        return self.table.snapshot()

    # ---- lifecycle (tether.server.rpc_server) -----------------------------------------------------------

    async def housekeeping(self) -> None:
        """Expire idle sessions' leases now and then, for the server's lifetime."""
        period = min(max(self.config.session_lease_s / 4, 0.05), 10.0)
        while True:
            await asyncio.sleep(period)
            self.table.expire()

    def stop_work(self) -> None:
        self.work.stop_work()

    def release_all(self) -> None:
        self.table.close_all()

    def close(self) -> None:
        """End the service's threads (the process is stopping)."""
        self.batcher.close()
        self.work.close()
        if self.exporter is not None:
            self.exporter.close()

    # ---- work off the event loop (tether.server.model_work) --------------------------------------------------

    async def _in_thread(self, fn, *args, claim: Claim | None = None, stoppable: bool = False):
        return await self.work.wait(self.work.submit(fn, *args, stoppable=stoppable), claim)

    def _max_new(self, requested: int) -> int:
        return min(requested or self.config.max_new_tokens, self.config.max_new_tokens)

    def _capacity(self, length: int, max_new: int) -> int:
        return min(length + max_new + self.config.max_draft_tokens + 1, self.target.cfg.max_seq_len)

    def _verifier(self, sampling: pb.SamplingParams, capacity: int) -> SequenceVerifier:
        """A session's verifier; `sampling` was checked (Checks.sampling) before."""
        generator = torch.Generator().manual_seed(sampling.seed)
        return SequenceVerifier(self.target, self.drafter, capacity=capacity, controls=sampling_controls(sampling),
                                generator=generator, pool=self.pool, prefill_chunk=self.config.prefill_chunk,
                                logprobs=requested_logprobs(sampling))  # fmt: skip

    def _need_drafter(self) -> None:
        if self.drafter is None:
            raise RequestError(Reason.REASON_NO_DRAFTER,
                               "this server runs no drafter (serve --drafter none): decode with Generate")  # fmt: skip

    def _owned(self, session_id: str, caller: str) -> Session:
        check_id(session_id, "session_id")
        session = self.table.lookup(session_id, caller)
        if session is None:
            raise RequestError(Reason.REASON_UNKNOWN_SESSION, "unknown session: resync with the full history")
        return session

    @staticmethod
    def _check_token(session: Session, token: str) -> None:
        check_id(token, "resume_token")
        if not secrets.compare_digest(token.encode(), session.resume_token.encode()):
            raise RequestError(Reason.REASON_WRONG_RESUME_TOKEN, "wrong resume token for this session")

    def _delta(self, delta: DraftDelta | ArrayDelta, codec: Codec) -> pb.KVDelta:
        """A delta on the wire, in bfloat16: torch tensors (prefills, absorbs), or the batcher's numpy arrays of
        bfloat16 bits (tether.server.rounds.slice_deltas), which go to the wire format as they are."""
        if isinstance(delta, ArrayDelta):
            payload = wire.encode_bf16_bundle(delta.tensors, codec)
        else:
            tensors = {k: v if v.dtype == torch.bfloat16 else v.to(torch.bfloat16) for k, v in delta.tensors.items()}
            payload = encode_many(tensors, codec)
        self.metrics.kv_delta_bytes.inc(len(payload))
        return pb.KVDelta(start=delta.start, tokens=delta.tokens, payload=payload)

    def _refused(self, e: RequestError, what: str, session: str = "") -> None:
        extra = {"event": "refused", "call": what, "code": e.code.name, "reason": e.reason_name, "detail": e.message}
        if e.reason == Reason.REASON_STALE_ROUND:  # routine (a pipelined client's missed guess), not news
            self.metrics.stale_rounds.inc()
            log.debug("request refused", extra=extra | {"session": session})
            return
        self.metrics.errors.labels(code=e.code.name).inc()
        log.info("request refused", extra=extra | ({"session": session} if session else {}))

    async def _abort(self, context: grpc.aio.ServicerContext, e: RequestError, what: str, session: str = ""):
        self._refused(e, what, session)
        await context.abort(e.code, e.message, status_metadata(e))

    # ---- unary RPCs -------------------------------------------------------------------------------------

    async def GetModelInfo(self, request, context) -> pb.ModelInfo:
        return self.model_info

    async def FetchWeights(self, request, context) -> AsyncIterator[pb.WeightChunk]:
        try:
            if request.format != pb.CLIENT_PART_TOKENIZER:  # the tokenizer alone comes from any server
                self._need_drafter()
            self.check.fingerprint(request.model_fingerprint)
            size = request.max_chunk_bytes or MAX_CHUNK
            if size > MAX_CHUNK:
                raise invalid(f"max_chunk_bytes above {MAX_CHUNK}")
            files, manifest = await self._client_part(request.format)
            try:
                chunks = iter_chunks(files, manifest, request.resume_tensor, request.resume_offset, size)
                first = next(chunks, None)  # validates the resume point before anything is sent
            except (KeyError, ValueError):
                raise invalid("resume_tensor / resume_offset is not a point in the manifest") from None
        except RequestError as e:
            await self._abort(context, e, "fetch_weights")
        yield pb.WeightChunk(
            manifest=pb.WeightManifest(
                model_fingerprint=self.model_fingerprint,
                drafter_fingerprint=self.drafter_fingerprint,
                tensors=[
                    pb.TensorEntry(name=e.name, dtype=e.dtype, shape=e.shape, nbytes=e.nbytes, sha256=e.sha256)
                    for e in manifest
                ],  # fmt: skip
                format=request.format,
            )
        )
        if request.manifest_only:
            return
        sent = self.metrics.bytes_out.labels(kind="weights")
        for name, offset, data in itertools.chain([first], chunks) if first is not None else ():
            sent.inc(len(data))
            yield pb.WeightChunk(chunk=pb.TensorChunk(tensor=name, offset=offset, data=data))

    async def _client_part(self, fmt: int) -> tuple[dict, list]:
        """(entries by name, manifest) in format `fmt`; ONNX ones are exported on the exporter's thread."""
        if fmt == pb.CLIENT_PART_TOKENIZER:
            return self.tokenizer_files, self.tokenizer_manifest
        if fmt == pb.CLIENT_PART_TENSORS:
            return self.weights, self.manifest
        if fmt not in FORMATS:
            raise invalid(f"unknown client part format {fmt}")
        try:
            part = await self.exporter.part_async(FORMATS[fmt])
        except ExportError as e:
            raise RequestError(Reason.REASON_INTERNAL, str(e)) from None
        return part.files, list(part.manifest)

    async def Close(self, request, context) -> pb.CloseReply:
        try:
            session = self._owned(request.session_id, CALLER.get())
            async with await self.table.claim(session):
                self.table.retire(session, "closed")
        except RequestError as e:
            if e.reason == Reason.REASON_SESSION_EVICTED:
                return pb.CloseReply()  # gone already: what the caller wanted
            await self._abort(context, e, "close")
        return pb.CloseReply()

    # ---- Session streams ---------------------------------------------------------------------------------

    async def Session(self, request_iterator, context) -> AsyncIterator[pb.ServerMessage]:
        caller = CALLER.get()
        session: Session | None = None
        epoch = 0  # the session's resync count when this stream opened or attached it
        messages = aiter(request_iterator)
        watch = IdleWatch(self.config.stream_idle_s)  # one timer per stream, not per message
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
                    e = RequestError(Reason.REASON_STREAM_IDLE,
                                     f"the stream sent nothing for {watch.idle_s:g} s; reconnect")  # fmt: skip
                    await self._abort(context, e, "session", session.id if session else "")
                kind = message.WhichOneof("body")
                round_no = message.round.round if kind == "round" else 0
                try:
                    if kind == "open":
                        if session is not None:
                            raise RequestError(Reason.REASON_OUT_OF_ORDER, "this stream already has a session")
                        session, replies = await self._open(message.open, caller)
                        epoch, unanswered = session.resyncs, session
                    elif kind == "attach":
                        if session is not None:
                            raise RequestError(Reason.REASON_OUT_OF_ORDER, "this stream already has a session")
                        session, epoch, reply = await self._attach(message.attach, caller)
                        replies = [reply]
                    elif kind == "round":
                        if session is None:
                            raise RequestError(Reason.REASON_OUT_OF_ORDER, "open or attach a session before rounds")
                        replies = [await self._round(session, message.round, epoch)]
                    else:
                        raise invalid("empty client message")
                except RequestError as e:
                    self._refused(e, kind or "empty", session.id if session else "")
                    replies = [inline(e, round_no)]
                except Exception as e:  # a bug must cost one message, not the stream or the server
                    log.exception("internal error", extra={"event": "error", "session": session.id if session else ""})
                    replies = [inline(RequestError(Reason.REASON_INTERNAL, f"internal error: {type(e).__name__}"),
                                      round_no)]  # fmt: skip
                for reply in replies:
                    yield reply
                unanswered = None
        finally:
            watch.close()
            if unanswered is not None:  # the call ended inside the yield: its client never learnt the session's id
                self.table.abandon(unanswered)

    async def _open(self, req: pb.OpenSession, caller: str) -> tuple[Session, list[pb.ServerMessage]]:
        c = self.config
        self._need_drafter()
        self.check.fingerprint(req.model_fingerprint)
        prompt = self.check.tokens(req.prompt, "prompt", c.max_prompt_tokens)
        if not prompt:
            raise invalid("empty prompt")
        self.check.sampling(req.sampling)
        codec = check_codec(req.delta_codec)
        if len(req.request_id) > 128:
            raise invalid("request_id is longer than 128 characters")
        self.check.fits_pool(len(prompt), "prompt")
        capacity = self._capacity(len(prompt), self._max_new(req.max_new_tokens))
        session, claim = await self.table.create(caller, req.sampling, codec, capacity)
        async with claim:
            try:
                first, delta = await self._in_thread(session.verifier.open, prompt, claim=claim, stoppable=True)
                parts = await self._in_thread(self._delta_parts, delta, codec)
            except (ValueError, PoolExhausted) as e:
                raise RequestError(Reason.REASON_CAPACITY, f"no KV memory for the prompt: {e}",
                                   retry_after_s=POOL_RETRY_S) from None  # fmt: skip
            session.root = first
            claim.keep()
        self.metrics.opened.inc()
        log.info("session opened", extra={"event": "open", "session": session.id, "key": caller[:12],
                                           "prompt_tokens": len(prompt),
                                           "temperature": req.sampling.temperature})  # fmt: skip
        opened = pb.Opened(request_id=req.request_id, session_id=session.id, resume_token=session.resume_token,
                           first_token=first, delta=parts[0], delta_parts=len(parts) - 1)  # fmt: skip
        if reported := taken_logprobs(session.verifier, 1):
            opened.first_logprob.CopyFrom(reported[0])
        return session, [pb.ServerMessage(opened=opened)] + [pb.ServerMessage(delta=p) for p in parts[1:]]

    def _delta_parts(self, delta: DraftDelta, codec: Codec) -> list[pb.KVDelta]:
        """A long prompt's delta goes in parts, each well under the message limit."""
        return [self._delta(d, codec) for d in delta.split(self.config.max_message_bytes // 4)]

    async def _attach(self, req: pb.AttachSession, caller: str) -> tuple[Session, int, pb.ServerMessage]:
        """A new stream takes over a held session (after a reconnect): rounds continue where it stands. Returns the
        session, its resync count (the stream's epoch) and the reply."""
        self._need_drafter()
        session = self._owned(req.session_id, caller)
        self._check_token(session, req.resume_token)
        async with await self.table.claim(session):
            attached = pb.Attached(session_id=session.id, verified_length=session.verifier.length,
                                   root=session.root, last_round=session.last_round)  # fmt: skip
            epoch = session.resyncs
        return session, epoch, pb.ServerMessage(attached=attached)

    async def _round(self, session: Session, req: pb.DraftRound, epoch: int) -> pb.ServerMessage:
        c = self.config
        claim = await self.table.claim(session)
        async with claim as s:
            if epoch != s.resyncs:
                # Round numbers restart after a resync: a late round from a stream attached before it must not be
                # taken (or recorded) as the new numbering's round.
                raise RequestError(Reason.REASON_OUT_OF_ORDER, "the session was resynced since this stream attached")
            if req.round == s.last_round and s.last_reply is not None:
                return s.last_reply  # a round sent again after a reconnect: same answer, no second run
            stands = (s.last_round + 1, s.root, s.verifier.length)
            if req.after_length and (req.round, req.root, req.after_length) != stands:
                # Sent before the verdict of the round before it, on a guess of that verdict which did not hold.
                raise RequestError(Reason.REASON_STALE_ROUND,
                                   f"round {req.round} assumed {req.after_length} verified positions and root "
                                   f"{req.root}; the session stands at {s.verifier.length}, root {s.root}")  # fmt: skip
            if req.round != s.last_round + 1:
                raise RequestError(Reason.REASON_OUT_OF_ORDER,
                                   f"round {req.round} out of order: expected {s.last_round + 1}")  # fmt: skip
            if req.root != s.root:
                raise RequestError(Reason.REASON_OUT_OF_ORDER,
                                   f"round root {req.root} is not the last decided token {s.root}")  # fmt: skip
            tree = self.check.draft_tree(req, c.max_draft_tokens)
            if len(tree) > s.verifier.room:
                raise RequestError(Reason.REASON_SESSION_FULL,
                                   f"{len(tree)} tokens do not fit the {s.verifier.room} positions left")  # fmt: skip
            try:
                with self.metrics.verify_seconds.time():
                    # The reply is encoded on the batcher's thread, straight after the step.
                    finish = functools.partial(self._verdict_reply, req.round, s.codec, bool(req.parents), s.verifier)
                    work, here = self.batcher.submit_here(s.verifier, tree, finish)
                    verdict, message = await self.work.wait(work, claim, here)
            except ValueError as e:
                raise invalid(str(e)) from None
            except PoolExhausted:
                raise RequestError(Reason.REASON_CAPACITY, "the KV pool is full; try again shortly",
                                   retry_after_s=POOL_RETRY_S) from None  # fmt: skip
            m = self.metrics
            m.rounds.inc()
            m.drafted.inc(len(tree) - 1)
            m.accepted.inc(verdict.accepted)
            m.tau.observe(verdict.tau)
            s.root, s.last_round, s.last_reply = verdict.bonus, req.round, message
            return message

    def _verdict_reply(self, round_no: int, codec: Codec, tree_round: bool, verifier: SequenceVerifier,
                       result: tuple) -> tuple:  # fmt: skip
        """(verdict, its ServerMessage) from a round's (verdict, delta). A tree round's reply names the accepted
        nodes (`path`, the root left out); a chain round's is what it has always been. With logprobs asked, the
        round's emitted tokens' entries go with it."""
        verdict, delta = result
        try:
            payload = self._delta(delta, codec)
        except CodecError as e:  # the session's codec was checked at open: this is the server's fault, not the call's
            raise RuntimeError(f"encoding a round's delta failed: {e}") from e
        v = pb.Verdict(round=round_no, accepted=verdict.accepted, bonus=verdict.bonus, delta=payload,
                       path=verdict.path[1:] if tree_round else (),
                       logprobs=taken_logprobs(verifier, verdict.accepted + 1))  # fmt: skip
        return verdict, pb.ServerMessage(verdict=v)
