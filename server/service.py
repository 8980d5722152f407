"""The gRPC service `tether.v1.Tether`: model info, weight streaming, verification sessions, resync, close.

Contract (DESIGN.md section 5; the messages are in proto/tether/v1/tether.proto):
- GetModelInfo: identities (model, tokenizer and drafter fingerprints), TLI depth, codecs and limits.
- FetchWeights: the manifest of the client part (tether.shared.weights), then chunks of at most 1 MiB, from
  any (tensor, offset); FAILED_PRECONDITION when the client expects other weights.
- Session: `open` prefills and answers the first token and the prompt's KV delta; each `round` is verified
  (tether.server.verifier, batched with other sessions' rounds by tether.server.batcher) and answered with
  accepted count, bonus token and delta. Round numbers make a repeated round idempotent (the recorded
  answer is sent again); a bad message gets an inline Error with its gRPC status code and the stream goes on.
- Session `attach`: a new stream takes over a held session (session id + resume token), e.g. after a Resync.
- Resync: after a disconnection, truncate to the client's verified length, absorb its offline tokens (all of
  them under `keep`, those before the first disagreement under `rewind`) and answer the delta, the first
  disagreement and the next token; a session the server lost is rebuilt from the full history.
- Close frees a session.
- Generate: plain server-side decoding streamed token by token (no drafter): the baseline to compare with.
grpc.health.v1 health checking and server reflection are served beside it.
Every bad input gets a clear status and the server keeps serving everyone else.

With API keys configured, every call needs `authorization: Bearer KEY` metadata (UNAUTHENTICATED otherwise),
and a session is bound to the key that opened it: to other keys it does not exist.
TLS, or mutual TLS with a client CA, when certificates are given (make_server's `tls`).
Rounds from many sessions that arrive within `batch_window_s` are verified in one target forward
(tether.server.batcher). Sessions keep their K/V in one paged pool with a memory budget (tether.server.kv_pool);
when it runs short, or the session limit is reached, the least recently used idle session is evicted: its next
round answers NOT_FOUND and its next Resync rebuilds it from the client's history, never silently wrong.

    service = TetherService(target, drafter, tokenizer, ServiceConfig())
    server, port = make_server(service, "127.0.0.1:50051"); server.start()
"""

from __future__ import annotations

import hashlib
import json
import logging
import secrets
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tether.server.batcher import RoundBatcher
from tether.server.kv_pool import KVPool, PoolExhausted
from tether.server.metrics import ServiceMetrics
from tether.server.verifier import SequenceVerifier, target_states
from tether.shared.codecs import Codec, encode_many
from tether.shared.drafter import DraftDelta
from tether.shared.model import Transformer
from tether.shared.sampling import sample_token
from tether.shared.speculative import DraftTree
from tether.shared.tokenizer import Tokenizer
from tether.shared.weights import MAX_CHUNK, TOKENIZER_TENSOR, build_manifest, client_part_tensors, iter_chunks
from tether.v1 import tether_pb2 as pb
from tether.v1 import tether_pb2_grpc

PROTOCOL_VERSION = 1
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Tether"].full_name  # "tether.v1.Tether"
log = logging.getLogger("tether.server")


@dataclass(frozen=True)
class ServiceConfig:
    max_sessions: int = 256  # sessions held at once; past it the least recently used one is evicted
    max_prompt_tokens: int = 1536  # longest prompt accepted
    max_draft_tokens: int = 64  # draft tokens per round
    max_new_tokens: int = 1024  # default and upper bound of a session's generation length
    max_message_bytes: int = 4 << 20  # gRPC message limit both ways
    model_id: str = "tether-default"  # reported in ModelInfo
    api_keys: frozenset[str] = frozenset()  # accepted bearer keys; empty = no authentication (loopback use)
    max_sessions_per_key: int = 64  # sessions one key may hold at once
    batch_window_s: float = 0.002  # rounds arriving within this window are verified in one target forward
    max_batch: int = 32  # rounds per batched forward at most
    kv_pool_bytes: int = 256 << 20  # memory of the paged KV pool all sessions share
    kv_block_size: int = 16  # positions per KV block
    prefill_chunk: int = 2048  # prompt / resync-history positions per prefill forward (bounds attention memory)


class RequestError(Exception):
    """A client error with the gRPC status it maps to."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


@dataclass
class SessionState:
    verifier: SequenceVerifier
    resume_token: str
    sampling: pb.SamplingParams
    codec: Codec
    root: int  # the last decided token, which the next round must start from
    owner: str = ""  # hash of the API key that opened it ("" without authentication)
    last_round: int = 0
    last_reply: pb.ServerMessage | None = None
    last_used: float = field(default_factory=time.monotonic)  # for least-recently-used eviction
    evicted: bool = False  # set (under `lock`) when its KV blocks were given back
    lock: threading.Lock = field(default_factory=threading.Lock)


def _sha256_json(obj: dict) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


class TetherService(tether_pb2_grpc.TetherServicer):
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
    ):
        """`client_weights` and `pool` are for a tensor-parallel target (tether.server.tp_serve), whose own
        weights are sharded: the client part computed before sharding, and rank 0's mirrored pool shard."""
        self.target, self.drafter, self.tokenizer = target, drafter, tokenizer
        self.config = config or ServiceConfig()
        self.model_fingerprint = model_fingerprint
        part = client_weights if client_weights is not None else client_part_tensors(target, drafter)
        self.weights = {k: v.detach().to("cpu", torch.bfloat16 if v.is_floating_point() else v.dtype)
                        for k, v in part.items()}  # fmt: skip
        # The tokenizer travels with the weights (resumable, cached by hash): a client needs nothing but an address.
        self.weights[TOKENIZER_TENSOR] = torch.frombuffer(bytearray(tokenizer.to_json().encode()), dtype=torch.uint8)
        self.manifest = build_manifest(self.weights)
        self.drafter_fingerprint = _sha256_json(
            {"config": drafter.dcfg.to_dict(), "tensors": [e.sha256 for e in self.manifest]}
        )
        self.sessions: dict[str, SessionState] = {}
        self.sessions_lock = threading.Lock()
        self.metrics = ServiceMetrics()
        c = self.config
        self.pool = pool or KVPool.for_budget(target.cfg, c.kv_pool_bytes, c.kv_block_size, device=target.device,
                                              dtype=target.embed_tokens.weight.dtype)  # fmt: skip
        self.pool.reclaim = self._reclaim
        self.metrics.kv_blocks.set(self.pool.num_blocks)
        self.metrics.kv_blocks_used.set_function(lambda: self.pool.used_blocks)
        self.batcher = RoundBatcher(target, window_s=self.config.batch_window_s, max_batch=self.config.max_batch,
                                    on_batch=self.metrics.batch_size.observe)  # fmt: skip

    # ---- helpers ------------------------------------------------------------------------------------

    def _check_tokens(self, tokens, what: str) -> list[int]:
        ids = list(tokens)
        vocab = self.target.cfg.vocab_size
        bad = next((t for t in ids if t >= vocab), None)
        if bad is not None:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"{what}: token id {bad} is outside [0, {vocab})")
        return ids

    def _check_fingerprint(self, fingerprint: str) -> None:
        if fingerprint and fingerprint != self.model_fingerprint:
            raise RequestError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"client holds model {fingerprint[:12]}, this server runs {self.model_fingerprint[:12]}",
            )

    def _delta(self, delta: DraftDelta, codec: Codec) -> pb.KVDelta:
        tensors = {k: v.to(torch.bfloat16) for k, v in delta.tensors.items()}
        payload = encode_many(tensors, codec)
        self.metrics.bytes_out.labels(kind="kv_delta").inc(len(payload))
        return pb.KVDelta(start=delta.start, tokens=delta.tokens, payload=payload)

    def _verifier(self, sampling: pb.SamplingParams, capacity: int) -> SequenceVerifier:
        generator = torch.Generator().manual_seed(sampling.seed)
        return SequenceVerifier(self.target, self.drafter, capacity=capacity, temperature=sampling.temperature,
                                top_p=sampling.top_p or 1.0, generator=generator, pool=self.pool,
                                prefill_chunk=self.config.prefill_chunk)  # fmt: skip

    def _retire(self, session_id: str, state: SessionState, reason: str) -> None:
        """Drop a session and give its KV blocks back. The caller holds `state.lock`, so no round of it is in
        flight; a handler that fetched the state before this sees `evicted` once it gets the lock."""
        with self.sessions_lock:
            if self.sessions.get(session_id) is state:
                del self.sessions[session_id]
            self.metrics.sessions.set(len(self.sessions))
        length = state.verifier.length
        state.evicted = True
        state.verifier.release()
        if reason != "closed":
            self.metrics.evictions.labels(reason=reason).inc()
        log.info(f"session {'closed' if reason == 'closed' else 'evicted'}",
                 extra={"event": "close" if reason == "closed" else "evict", "session": session_id, "reason": reason,
                        "length": length})  # fmt: skip

    def _evict_one(self, reason: str, candidates: list[tuple[str, SessionState]]) -> bool:
        """Evict the least recently used idle session among `candidates`; False when all are busy."""
        for sid, st in sorted(candidates, key=lambda kv: kv[1].last_used):
            if st.lock.acquire(blocking=False):  # busy sessions (a round in flight) are never evicted
                try:
                    if not st.evicted:
                        self._retire(sid, st, reason)
                        return True
                finally:
                    st.lock.release()
        return False

    def _reclaim(self, missing: int) -> bool:
        """The pool's callback when `missing` more blocks are needed: evict idle sessions, oldest first."""
        goal = self.pool.free_blocks + missing
        freed = False
        while self.pool.free_blocks < goal:
            with self.sessions_lock:
                candidates = list(self.sessions.items())
            if not self._evict_one("memory", candidates):
                break
            freed = True
        return freed

    def _check_room(self, caller: str) -> None:
        """Refuse a key over its own session limit; at the global limit, evict the least recently used session
        (clients that vanish without Close must not lock everyone out). An evicted session answers NOT_FOUND
        and is rebuilt from the client's history on its next Resync, never silently wrong."""
        c = self.config
        with self.sessions_lock:
            mine = sum(1 for s in self.sessions.values() if s.owner == caller)
            if caller and mine >= c.max_sessions_per_key:
                msg = f"this key holds {mine} sessions, the limit is {c.max_sessions_per_key}"
                raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED, msg)
        while True:
            with self.sessions_lock:
                if len(self.sessions) < c.max_sessions:
                    return
                candidates = list(self.sessions.items())
            if not self._evict_one("sessions", candidates):
                raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"all {c.max_sessions} sessions are busy")

    def _codec(self, value: int) -> Codec:
        try:
            return Codec(value)
        except ValueError:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"unknown delta codec {value}") from None

    def _capacity(self, prompt_len: int, max_new: int) -> int:
        return prompt_len + max_new + self.config.max_draft_tokens + 1

    def _caller(self, context) -> str:
        """The caller's identity: a hash of its bearer key (UNAUTHENTICATED without a valid one), or ""."""
        if not self.config.api_keys:
            return ""
        meta = dict(context.invocation_metadata())
        auth = meta.get("authorization", "")
        key = auth.removeprefix("Bearer ").strip() if auth.startswith("Bearer ") else ""
        if not any(secrets.compare_digest(key, k) for k in self.config.api_keys):
            raise RequestError(grpc.StatusCode.UNAUTHENTICATED, "missing or unknown API key (authorization: Bearer)")
        return hashlib.sha256(key.encode()).hexdigest()

    def _owned(self, state: SessionState | None, caller: str) -> SessionState | None:
        """Sessions are bound to the key that opened them; to anyone else they do not exist."""
        return state if state is not None and secrets.compare_digest(state.owner, caller) else None

    def _session(self, session_id: str, resume_token: str | None = None) -> SessionState:
        with self.sessions_lock:
            state = self.sessions.get(session_id)
        if state is None:
            raise RequestError(grpc.StatusCode.NOT_FOUND, f"unknown session {session_id!r}")
        if resume_token is not None and not secrets.compare_digest(resume_token, state.resume_token):
            raise RequestError(grpc.StatusCode.PERMISSION_DENIED, "wrong resume token for this session")
        return state

    # ---- RPCs ----------------------------------------------------------------------------------------

    def GetModelInfo(self, request, context):
        try:
            self._caller(context)
        except RequestError as e:
            context.abort(e.code, e.message)
        c = self.config
        return pb.ModelInfo(
            protocol_version=PROTOCOL_VERSION,
            model_id=c.model_id,
            model_config_json=json.dumps(self.target.cfg.to_dict()),
            model_fingerprint=self.model_fingerprint,
            tokenizer_sha256=self.tokenizer.sha256,
            drafter_config_json=json.dumps(self.drafter.dcfg.to_dict()),
            drafter_fingerprint=self.drafter_fingerprint,
            tli_layers=self.drafter.dcfg.tli,
            codecs=[pb.CODEC_RAW, pb.CODEC_FP16_SHUFFLE_ZSTD, pb.CODEC_INT8_ZSTD],
            max_prompt_tokens=c.max_prompt_tokens,
            max_draft_tokens=c.max_draft_tokens,
            max_message_bytes=c.max_message_bytes,
        )

    def FetchWeights(self, request, context) -> Iterator[pb.WeightChunk]:
        try:
            self._caller(context)
            self._check_fingerprint(request.model_fingerprint)
            size = request.max_chunk_bytes or MAX_CHUNK
            if size > MAX_CHUNK:
                raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"max_chunk_bytes above {MAX_CHUNK}")
            chunks = iter_chunks(self.weights, self.manifest, request.resume_tensor, request.resume_offset, size)
            first = next(chunks, None)  # validates the resume point before anything is sent
        except (KeyError, ValueError) as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except RequestError as e:
            context.abort(e.code, e.message)
        yield pb.WeightChunk(
            manifest=pb.WeightManifest(
                model_fingerprint=self.model_fingerprint,
                drafter_fingerprint=self.drafter_fingerprint,
                tensors=[
                    pb.TensorEntry(name=e.name, dtype=e.dtype, shape=e.shape, nbytes=e.nbytes, sha256=e.sha256)
                    for e in self.manifest
                ],  # fmt: skip
            )
        )
        if request.manifest_only:
            return
        sent = self.metrics.bytes_out.labels(kind="weights")
        if first is not None:
            sent.inc(len(first[2]))
            yield pb.WeightChunk(chunk=pb.TensorChunk(tensor=first[0], offset=first[1], data=first[2]))
        for name, offset, data in chunks:
            sent.inc(len(data))
            yield pb.WeightChunk(chunk=pb.TensorChunk(tensor=name, offset=offset, data=data))

    def Session(self, request_iterator, context) -> Iterator[pb.ServerMessage]:
        try:
            caller = self._caller(context)
        except RequestError as e:
            context.abort(e.code, e.message)
        session_id: str | None = None
        for message in request_iterator:
            kind = message.WhichOneof("body")
            try:
                if kind == "open":
                    if session_id is not None:
                        raise RequestError(grpc.StatusCode.FAILED_PRECONDITION, "this stream already opened a session")
                    session_id, replies = self._open(message.open, caller)
                elif kind == "attach":
                    if session_id is not None:
                        raise RequestError(grpc.StatusCode.FAILED_PRECONDITION, "this stream already has a session")
                    session_id, reply = self._attach(message.attach, caller)
                    replies = [reply]
                elif kind == "round":
                    if session_id is None:
                        raise RequestError(grpc.StatusCode.FAILED_PRECONDITION, "open a session before rounds")
                    replies = [self._round(self._session(session_id), message.round)]
                else:
                    raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, "empty client message")
            except RequestError as e:
                replies = [self._error(message, e.code, e.message)]
            except Exception as e:  # a bug must cost one message, not the stream or the server
                log.exception("internal error", extra={"event": "error", "session": session_id})
                replies = [self._error(message, grpc.StatusCode.INTERNAL, f"internal error: {type(e).__name__}")]
            yield from replies

    def _error(self, message: pb.ClientMessage, code: grpc.StatusCode, text: str) -> pb.ServerMessage:
        self.metrics.errors.labels(code=code.name).inc()
        log.info("request refused", extra={"event": "refused", "code": code.name, "detail": text})
        round_no = message.round.round if message.WhichOneof("body") == "round" else 0
        return pb.ServerMessage(error=pb.Error(code=code.value[0], message=text, round=round_no))

    def _open(self, req: pb.OpenSession, caller: str) -> tuple[str, list[pb.ServerMessage]]:
        c = self.config
        self._check_fingerprint(req.model_fingerprint)
        prompt = self._check_tokens(req.prompt, "prompt")
        if not prompt:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, "empty prompt")
        if len(prompt) > c.max_prompt_tokens:
            msg = f"prompt of {len(prompt)} tokens exceeds the limit of {c.max_prompt_tokens}"
            raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED, msg)
        if not 0 <= req.sampling.temperature <= 100 or not 0 <= req.sampling.top_p <= 1:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, "temperature must be >= 0 and top_p in [0, 1]")
        self._check_room(caller)
        codec = self._codec(req.delta_codec)
        max_new = min(req.max_new_tokens or c.max_new_tokens, c.max_new_tokens)
        capacity = min(self._capacity(len(prompt), max_new), self.target.cfg.max_seq_len)
        verifier = self._verifier(req.sampling, capacity)
        try:
            first, delta = verifier.open(prompt)
        except (ValueError, PoolExhausted) as e:
            verifier.release()
            raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)) from None
        state = SessionState(verifier, secrets.token_hex(16), req.sampling, codec, root=first, owner=caller)
        session_id = secrets.token_hex(16)  # random 128 bits
        with self.sessions_lock:
            self.sessions[session_id] = state
            self.metrics.sessions.set(len(self.sessions))
        self.metrics.opened.inc()
        log.info(
            "session opened",
            extra={
                "event": "open",
                "session": session_id,
                "key": caller[:12],
                "prompt_tokens": len(prompt),
                "temperature": req.sampling.temperature,
            },
        )
        # A long prompt's delta goes in parts, each well under the message limit.
        parts = [self._delta(d, codec) for d in delta.split(self.config.max_message_bytes // 4)]
        opened = pb.Opened(request_id=req.request_id, session_id=session_id, resume_token=state.resume_token,
                           first_token=first, delta=parts[0], delta_parts=len(parts) - 1)  # fmt: skip
        return session_id, [pb.ServerMessage(opened=opened)] + [pb.ServerMessage(delta=p) for p in parts[1:]]

    def _attach(self, req: pb.AttachSession, caller: str) -> tuple[str, pb.ServerMessage]:
        """A new stream takes over a held session (after a reconnect): rounds continue where it stands."""
        with self.sessions_lock:
            state = self._owned(self.sessions.get(req.session_id), caller)
        if state is None:
            raise RequestError(grpc.StatusCode.NOT_FOUND, f"unknown session {req.session_id!r}: resync with history")
        if not secrets.compare_digest(req.resume_token, state.resume_token):
            raise RequestError(grpc.StatusCode.PERMISSION_DENIED, "wrong resume token for this session")
        with state.lock:
            if state.evicted:
                raise RequestError(grpc.StatusCode.NOT_FOUND, "session evicted: resync with the full history")
            state.last_used = time.monotonic()
            attached = pb.Attached(session_id=req.session_id, verified_length=state.verifier.length, root=state.root,
                                   last_round=state.last_round)  # fmt: skip
        return req.session_id, pb.ServerMessage(attached=attached)

    def _round(self, state: SessionState, req: pb.DraftRound) -> pb.ServerMessage:
        with state.lock:
            if state.evicted:
                raise RequestError(grpc.StatusCode.NOT_FOUND, "session evicted: resync with the full history")
            state.last_used = time.monotonic()
            if req.round == state.last_round and state.last_reply is not None:
                return state.last_reply  # a round sent again after a reconnect: same answer, no second run
            if req.round != state.last_round + 1:
                raise RequestError(grpc.StatusCode.FAILED_PRECONDITION,
                                   f"round {req.round} out of order: expected {state.last_round + 1}")  # fmt: skip
            if req.root != state.root:
                raise RequestError(grpc.StatusCode.INVALID_ARGUMENT,
                                   f"round root {req.root} is not the last decided token {state.root}")  # fmt: skip
            drafts = self._check_tokens(req.tokens, "draft")
            if len(drafts) > self.config.max_draft_tokens:
                raise RequestError(grpc.StatusCode.INVALID_ARGUMENT,
                                   f"{len(drafts)} draft tokens exceed {self.config.max_draft_tokens}")  # fmt: skip
            q_ids = q_probs = None
            if req.q:
                if len(req.q) != len(drafts) or len({len(d.ids) for d in req.q}) != 1:
                    raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, "q needs one equal-sized row per draft")
                q_ids = torch.tensor([list(d.ids) for d in req.q], dtype=torch.long)
                q_probs = torch.tensor([list(d.probs) for d in req.q], dtype=torch.float32)
            try:
                tree = DraftTree.chain(req.root, drafts, q_ids, q_probs)
                with self.metrics.verify_seconds.time():
                    verdict, delta = self.batcher.submit(state.verifier, tree).result()
            except ValueError as e:
                raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
            except PoolExhausted as e:
                raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)) from None
            m = self.metrics
            m.rounds.inc()
            m.drafted.inc(len(drafts))
            m.accepted.inc(verdict.accepted)
            m.tau.observe(verdict.tau)
            state.root = verdict.bonus
            state.last_round = req.round
            state.last_reply = pb.ServerMessage(
                verdict=pb.Verdict(
                    round=req.round,
                    accepted=verdict.accepted,
                    bonus=verdict.bonus,
                    delta=self._delta(delta, state.codec),
                )  # fmt: skip
            )
            return state.last_reply

    def Resync(self, request, context):
        try:
            reply = self._resync(request, self._caller(context))
        except RequestError as e:
            self.metrics.errors.labels(code=e.code.name).inc()
            log.info(
                "resync refused",
                extra={"event": "refused", "session": request.session_id, "code": e.code.name, "detail": e.message},
            )
            context.abort(e.code, e.message)
        self.metrics.resyncs.labels(outcome="rebuilt" if reply.rebuilt else "extended").inc()
        log.info(
            "session resynced",
            extra={
                "event": "resync",
                "session": request.session_id,
                "rebuilt": reply.rebuilt,
                "offline_tokens": len(request.offline_tokens),
                "first_disagreement": reply.first_disagreement,
                "verified_length": reply.verified_length,
            },
        )
        return reply

    def _resync(self, req: pb.ResyncRequest, caller: str) -> pb.ResyncReply:
        self._check_fingerprint(req.model_fingerprint)
        offline = self._check_tokens(req.offline_tokens, "offline tokens")
        if not offline:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, "resync needs at least the root token")
        with self.sessions_lock:
            held = self.sessions.get(req.session_id)
        if held is not None and self._owned(held, caller) is None:
            raise RequestError(grpc.StatusCode.PERMISSION_DENIED, "this session belongs to another key")
        state = held
        rebuilt = state is None or not secrets.compare_digest(req.resume_token, state.resume_token)
        if state is not None and rebuilt:
            raise RequestError(grpc.StatusCode.PERMISSION_DENIED, "wrong resume token for this session")
        V = req.verified_length
        if rebuilt:
            history = self._check_tokens(req.history, "history")
            if len(history) != V or V == 0:
                raise RequestError(grpc.StatusCode.FAILED_PRECONDITION,
                                   "session not held here: resend with the full verified history")  # fmt: skip
            if V > self.config.max_prompt_tokens + self.config.max_new_tokens:
                raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"history of {V} tokens is too long")
            max_new = self.config.max_new_tokens
            capacity = min(self._capacity(V + len(offline), max_new), self.target.cfg.max_seq_len)
            verifier = self._verifier(req.sampling, capacity)
            try:
                verifier.open(history)
            except (ValueError, PoolExhausted) as e:
                verifier.release()
                raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)) from None
            codec = self._codec(req.delta_codec)
            state = SessionState(verifier, secrets.token_hex(16), req.sampling, codec, root=0, owner=caller)
            self._check_room(caller)
            with self.sessions_lock:
                self.sessions[req.session_id] = state
                self.metrics.sessions.set(len(self.sessions))
            self.metrics.opened.inc()
        with state.lock:
            if state.evicted:
                raise RequestError(grpc.StatusCode.FAILED_PRECONDITION,
                                   "session evicted meanwhile: resend with the full verified history")  # fmt: skip
            state.last_used = time.monotonic()
            ver = state.verifier
            if V > ver.length:
                raise RequestError(grpc.StatusCode.FAILED_PRECONDITION,
                                   f"client claims {V} verified positions, the server holds {ver.length}")  # fmt: skip
            if len(offline) > ver.cache.capacity - V:
                raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many offline tokens for this session")
            ver.cache.truncate(V)
            try:
                disagreement, next_token, delta = self._absorb(ver, offline, rewind=req.rewind)
            except PoolExhausted as e:
                raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)) from None
            state.root = next_token
            state.last_round, state.last_reply = 0, None  # round numbering restarts after a resync
            reply = pb.ResyncReply(session_id=req.session_id, resume_token=state.resume_token, rebuilt=rebuilt,
                                   first_disagreement=disagreement, target_token=next_token,
                                   verified_length=ver.length, delta=self._delta(delta, state.codec))  # fmt: skip
            # Refused here rather than failing in gRPC's send: a client that retries from its verified length with
            # fewer tokens gets the same state (the cache is truncated to that length first).
            if reply.ByteSize() > self.config.max_message_bytes - 1024:
                raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                   f"the reply for {len(offline)} offline tokens would take {reply.ByteSize()} bytes, "
                                   f"over the {self.config.max_message_bytes}-byte message limit: resync them in "
                                   "smaller pieces (tether-client --resync-piece-tokens)")  # fmt: skip
            return reply

    @torch.inference_mode()
    def _absorb(self, ver: SequenceVerifier, offline: list[int], *, rewind: bool) -> tuple[int, int, DraftDelta]:
        """Run the offline tokens through the target as one chain; keep all (keep) or the agreed prefix
        (rewind). offline[0] is the root, the target's own token, so at least it is always kept."""
        start = ver.length
        ids = torch.tensor([offline], device=self.target.device)
        out = self.target.verify(ids, ver.cache, hidden_layers=(self.target.cfg.n_layers,), return_kv=True)
        greedy = out.logits[0].argmax(-1).tolist()  # greedy[i]: the target's token after offline[i]
        disagreement = next((i for i in range(1, len(offline)) if offline[i] != greedy[i - 1]), len(offline))
        kept = disagreement if rewind else len(offline)
        ver.cache.accept(list(range(kept)))
        next_token = ver.sample(out.logits[0, kept - 1])
        states = target_states(out).select(list(range(kept)))
        return disagreement, next_token, self.drafter.server_delta(states, start, offline[:kept])

    def Generate(self, request: pb.OpenSession, context) -> Iterator[pb.GeneratedTokens]:
        """Plain decoding on the server, streamed token by token (the baseline tether's drafting competes with)."""
        try:
            self._caller(context)
            self._check_fingerprint(request.model_fingerprint)
            prompt = self._check_tokens(request.prompt, "prompt")
            if not prompt or len(prompt) > self.config.max_prompt_tokens:
                raise RequestError(grpc.StatusCode.INVALID_ARGUMENT,
                                   f"the prompt must hold 1 to {self.config.max_prompt_tokens} tokens")  # fmt: skip
        except RequestError as e:
            context.abort(e.code, e.message)
        s = request.sampling
        n = min(request.max_new_tokens or self.config.max_new_tokens, self.config.max_new_tokens)
        n = min(n, self.target.cfg.max_seq_len - len(prompt))
        generator = torch.Generator().manual_seed(s.seed)
        # Through the paged pool (and so through a tensor-parallel target too), given back when the stream ends.
        cache = self.pool.sequence(len(prompt) + n)
        dev = self.target.device
        try:
            with torch.inference_mode():
                logits = self.target.prefill(torch.tensor([prompt], device=dev), cache, last_only=True).logits
                for _ in range(n):
                    token = sample_token(logits[0, -1], temperature=s.temperature, top_p=s.top_p or 1.0,
                                         generator=generator)  # fmt: skip
                    self.metrics.bytes_out.labels(kind="tokens").inc(4)
                    yield pb.GeneratedTokens(tokens=[token])
                    if not context.is_active() or cache.length >= cache.capacity:
                        return
                    logits = self.target.prefill(torch.tensor([[token]], device=dev), cache).logits
        except PoolExhausted as e:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        finally:
            cache.release()

    def Close(self, request, context):
        try:
            caller = self._caller(context)
        except RequestError as e:
            context.abort(e.code, e.message)
        with self.sessions_lock:
            state = self._owned(self.sessions.get(request.session_id), caller)
        if state is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown session {request.session_id!r}")
        with state.lock:
            self._retire(request.session_id, state, "closed")
        return pb.CloseReply()


def health_servicer_for(server: grpc.Server) -> health.HealthServicer:
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    return servicer


@dataclass(frozen=True)
class TLSFiles:
    cert: str  # PEM certificate chain of this server
    key: str  # PEM private key
    client_ca: str = ""  # PEM CA bundle: when given, clients must present a certificate it signed (mTLS)

    def credentials(self) -> grpc.ServerCredentials:
        from pathlib import Path

        pair = [(Path(self.key).read_bytes(), Path(self.cert).read_bytes())]
        ca = Path(self.client_ca).read_bytes() if self.client_ca else None
        return grpc.ssl_server_credentials(pair, root_certificates=ca, require_client_auth=ca is not None)


def make_server(
    service: TetherService, address: str, *, workers: int = 0, tls: TLSFiles | None = None
) -> tuple[grpc.Server, int]:
    """A gRPC server for `service` listening on `address` ("host:0" picks a free port), over TLS when `tls` is
    given; returns it and its port. `workers` = 0 sizes the thread pool from max_sessions."""
    limit = service.config.max_message_bytes
    options = [
        ("grpc.max_receive_message_length", limit),
        ("grpc.max_send_message_length", limit),
        # Edge clients ping every few seconds to notice dead links (tether.client.session keepalive_s); accept
        # that instead of answering GOAWAY "too_many_pings", and ping idle clients ourselves to reap dead ones.
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 1000),
        ("grpc.http2.max_ping_strikes", 0),
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
    ]
    # Every open Session stream holds a worker thread for its whole life: size the pool for a full house of
    # sessions plus headroom, or health checks and new calls queue behind the streams (and probes fail).
    workers = workers or service.config.max_sessions + 32
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers), options=options)
    tether_pb2_grpc.add_TetherServicer_to_server(service, server)
    # grpc.health.v1 (load balancers and Kubernetes probes ask it) and reflection (grpcurl, grpcui).
    health = health_servicer_for(server)
    health.set("", health_pb2.HealthCheckResponse.SERVING)
    health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection((SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                                         reflection.SERVICE_NAME), server)  # fmt: skip
    port = server.add_secure_port(address, tls.credentials()) if tls else server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"cannot listen on {address}")
    return server, port
