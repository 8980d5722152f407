"""The edge client's generation loop: draft, get verified over the tether, keep going alone when it snaps.

States (docs/ARCHITECTURE.md, section 7): CONNECTING -> ONLINE -> OFFLINE -> RESYNCING -> ONLINE ... -> DONE.
- CONNECTING: `pair()`: GetModelInfo, then the client part from the weight cache or the server, in the form the
  backend drafts with: ONNX graphs for onnxruntime (the default; tether.client.onnx_pairing, no torch anywhere on
  that path), or tensors for the torch drafter (tether.client.pairing, imported only by that backend); then open
  the session with the prompt, or go on from the session file (tether.client.session_file).
- ONLINE: each round drafts k tokens after the root (the last token the target decided), sends them, and on
  the verdict adopts the verified states (KV delta) and emits the accepted drafts and the bonus token, tagged
  "verified". A round unanswered within `round_timeout_s`, or a broken stream, means OFFLINE.
- OFFLINE: the drafter goes on alone from what it holds (SA over its own tokens, CA over the last verified
  LSA vectors, TLI layers with their own KV cache); each token is emitted tagged "offline". Reconnection is
  tried with exponential backoff and jitter (tether.client.transport.Backoff, which also paces the connect loop
  and the weight download's retries), failing over along `--server`'s replicas.
- RESYNCING: Resync sends the verified length and the tokens produced since (the root first). Policy `keep`:
  the target absorbs them all. Policy `rewind`: it keeps those before the first one it disagrees with, the
  rest are retracted, and the text then equals what the target alone would have produced (greedy). A server
  that lost the session (restart, eviction, another replica) gets the full verified history and rebuilds it.
  Then a new stream attaches to the session and rounds go on.
Every emitted token is final except offline ones, which `rewind` may retract (Event "retract"). The client
never depends on the server's memory to keep its text: tokens, tags and the verified length are its own.
A server that does not offer the ONNX part in the precision asked: FormatNotOffered (use `--backend torch`).

    result = generate(ClientConfig(server="127.0.0.1:50051", max_new_tokens=64), "def f(x):", on_event=print)
    result.text, result.tags, result.stats

Tests: tests/e2e (test_backends, test_chaos, test_failover, test_capacity, test_client_restart, ...),
tests/client/test_session_file.py, tests/test_client_install.py (the onnx backend in a virtualenv without torch).
"""

from __future__ import annotations

import json
import random
import secrets
import time
from collections.abc import Callable

import grpc
import numpy as np

from tether.client.delta_gate import DeltaGate, DeltaLayout, WireDelta
from tether.client.errors import Problem, ServerDataError
from tether.client.onnx_pairing import FORMATS, fetch_onnx_part
from tether.client.pairing_checks import check_model_info
from tether.client.refusals import Refusal
from tether.client.session_file import SessionRecord, load_record, save_record
from tether.client.session_types import (
    CODECS,
    ClientConfig,
    Event,
    Paired,
    Result,
    State,
    Stats,
)
from tether.client.transport import (
    Backoff,
    BadMessage,
    FormatNotOffered,
    LinkDown,
    Replicas,
    ServerError,
    SessionLost,
    SessionStream,
    rpc_error,
)
from tether.shared.ids import is_session_id
from tether.v1 import tether_pb2 as pb
from tether.v1 import tether_pb2_grpc

AFFINITY_HEADER = "x-tether-affinity"  # per-generation key for load balancers' session affinity
DOWNLOAD_ATTEMPTS = 20  # a download a flaky link breaks resumes where the cache stops, this many times in a row


def _delta(kv: pb.KVDelta) -> WireDelta:
    """A delta as it arrived; the drafter's gate (tether.client.delta_gate) checks it before decoding it."""
    return WireDelta(start=kv.start, tokens=list(kv.tokens), payload=kv.payload)


class EdgeSession:
    """One generation: owns the channel, the drafter and the text. See the module docstring."""

    def __init__(self, cfg: ClientConfig, on_event: Callable[[Event], None] | None = None):
        cfg.check()
        self.cfg = cfg
        self.on_event = on_event or (lambda e: None)
        # A random key of this generation, sent with every call: a load balancer hashing it (Envoy ring hash)
        # keeps the session on one replica. It also picks this client's first endpoint, which spreads clients.
        self.affinity = secrets.token_hex(8)
        self.replicas = _replicas(cfg, first=int(self.affinity, 16))
        auth = (("authorization", f"Bearer {cfg.api_key}"),) if cfg.api_key else ()
        self.metadata = (*auth, (AFFINITY_HEADER, self.affinity))
        self.stats = Stats()
        self.backoff = Backoff(cfg.backoff_initial_s, cfg.backoff_max_s, cfg.backoff_jitter, random.Random(cfg.seed))
        self.state = State.CONNECTING
        self.models: Paired | None = None  # set by pair(); the CLI and the demo read its tokenizer
        self.stream: SessionStream | None = None
        self.session_id = self.resume_token = ""
        self.prompt: list[int] = []
        self.tokens: list[int] = []  # generated, emitted tokens (the root included)
        self.tags: list[str] = []
        self.verified = 0  # positions whose verified states the drafter holds (prompt included)
        self.round = 0
        self.offline_run = 0
        self._last_emit = 0.0

    # ---- events and bookkeeping ------------------------------------------------------------------------

    def _set_state(self, state: State, detail: str = "") -> None:
        if state != self.state:
            self.state = state
            self.on_event(Event("state", state=state, detail=detail))

    def _emit(self, tokens: list[int], tag: str) -> None:
        room = self.cfg.max_new_tokens - len(self.tokens)
        tokens = tokens[:room]
        eos = self.models.tokenizer.eos_id
        if eos is not None and eos in tokens:
            tokens = tokens[: tokens.index(eos) + 1]
        if not tokens:
            return
        if self.cfg.pace_tokens_per_s > 0:
            for t in tokens:
                wait = self._last_emit + 1.0 / self.cfg.pace_tokens_per_s - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                self._last_emit = time.monotonic()
                self._append([t], tag)
        else:
            self._append(tokens, tag)

    def _append(self, tokens: list[int], tag: str) -> None:
        self.tokens += tokens
        self.tags += [tag] * len(tokens)
        self._save()
        self.on_event(Event("tokens", tokens=tokens, tag=tag))

    # ---- the session file: what a restarted client needs to go on (tether.client.session_file) ------------------

    def _save(self, done: bool = False) -> None:
        # Only consistent points: the root (position `verified`) emitted, i.e. not halfway through a paced round.
        if not self.cfg.session_file or len(self.sequence) <= self.verified:
            return
        record = SessionRecord(self.cfg.server, self.info.model_fingerprint, self.session_id, self.resume_token,
                               self.prompt, self.tokens, self.tags, self.verified, done)  # fmt: skip
        save_record(self.cfg.session_file, record)

    def _restore(self, record: SessionRecord) -> None:
        """Go on from a saved session: a new server session over the verified history gives the drafter its
        states back; the loop then resyncs the root and any offline tail from there, as after an outage."""
        self.prompt, self.tokens, self.tags = list(record.prompt), list(record.tokens), list(record.tags)
        self.verified = record.verified
        if record.session_id:
            try:
                self.stub.Close(pb.CloseRequest(session_id=record.session_id), metadata=self.metadata, timeout=2.0)
            except grpc.RpcError:
                pass  # gone already (or unreachable): nothing is lost, it held only what we re-send now
        self.stream = SessionStream(self.stub, self.metadata)
        history = self.sequence[: self.verified]
        open_ = pb.OpenSession(prompt=history, sampling=self._sampling(), max_new_tokens=self.cfg.max_new_tokens,
                               delta_codec=CODECS[self.cfg.codec],
                               model_fingerprint=self.info.model_fingerprint)  # fmt: skip
        self.stats.bytes_up += 4 * len(history)
        o = self._opened(self.stream.request(pb.ClientMessage(open=open_), self.cfg.connect_timeout_s))
        self.session_id, self.resume_token = o.session_id, o.resume_token
        self._begin(o)
        self.stream.close()
        self.stream = None
        self.on_event(Event("info", detail=f"resumed a saved session: {len(self.tokens)} tokens"))
        self._set_state(State.OFFLINE, "restored")

    @property
    def done(self) -> bool:
        eos = self.models.tokenizer.eos_id if self.models else None
        return len(self.tokens) >= self.cfg.max_new_tokens or (eos is not None and eos in self.tokens[-1:])

    @property
    def sequence(self) -> list[int]:
        return self.prompt + self.tokens

    def _sampling(self) -> pb.SamplingParams:
        return pb.SamplingParams(temperature=self.cfg.temperature, top_p=self.cfg.top_p, seed=self.cfg.seed)

    def _count_down(self, kv: pb.KVDelta) -> None:
        self.stats.bytes_down += len(kv.payload)

    def _bad_message(self, problem: Problem, message: str) -> ServerDataError:
        """The error for a server message refused as invalid: a lost round once generating (the loop goes offline
        and resyncs), the end while opening (nothing to draft from yet, and retrying would loop)."""
        self.stats.bad_messages += 1
        if self.state == State.CONNECTING:
            return ServerDataError(problem, message)
        self.on_event(Event("info", detail=f"refused an invalid {problem.value} from the server: {message}"))
        return BadMessage(problem, message)

    # ---- connecting ----------------------------------------------------------------------------------

    @property
    def stub(self) -> tether_pb2_grpc.TetherStub:
        return self.replicas.stub

    def pair(self) -> Paired:
        """Learn the server's model and get the client part (cached on disk by hash) in the form the backend
        drafts with; builds the drafter. Waits up to `connect_timeout_s` for a server that is not up yet."""
        cfg = self.cfg
        backoff = self.backoff.fresh()
        deadline = time.monotonic() + cfg.connect_timeout_s

        def model_info() -> pb.ModelInfo:
            return self.stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=self.metadata,
                                          timeout=max(0.1, deadline - time.monotonic()))  # fmt: skip

        info = backoff.retry(model_info, deadline=deadline,
                             give_up=lambda e: ServerError(e.code(), f"{cfg.server}: {e.details()}"))  # fmt: skip
        model_cfg, drafter_cfg = check_model_info(info)  # before anything is downloaded or allocated
        if cfg.backend == "onnx" and FORMATS[cfg.precision] not in info.client_part_formats:
            raise FormatNotOffered(f"{cfg.server} does not offer the ONNX client part in {cfg.precision} (a server "
                                   "older than this client): pass --backend torch, or upgrade the server")  # fmt: skip

        def interrupted(e: Exception) -> None:
            self.on_event(Event("info", detail=f"weight download interrupted ({e}); resuming"))

        self.models = backoff.retry(lambda: self._fetch_part(info), attempts=DOWNLOAD_ATTEMPTS, on_retry=interrupted)
        self.stats.weights_bytes = self.models.nbytes
        # Every delta the server sends is checked against this session before it is decoded: it may cover only
        # the client's own tokens after the verified ones (those it has, plus a round's drafts in flight).
        self._drafts: list[int] = []
        self.drafter = DeltaGate(self.models.drafter, DeltaLayout.for_config(model_cfg, drafter_cfg),
                                 coverable=lambda start: self.sequence[start:] + self._drafts,
                                 refuse=lambda message: self._bad_message(Problem.DELTA, message))  # fmt: skip
        self.info = info
        return self.models

    def _fetch_part(self, info: pb.ModelInfo) -> Paired:
        """The client part for the backend, and the random stream its drafter samples with."""
        cfg = self.cfg
        if cfg.backend == "onnx":
            part = fetch_onnx_part(self.stub, info, cfg.cache_dir, precision=cfg.precision, metadata=self.metadata,
                                   max_bytes=cfg.max_weights_mb << 20)  # fmt: skip
            self._draft_rng = np.random.default_rng(cfg.seed)
            return Paired(info, part.tokenizer, part.drafter, part.nbytes)
        # The torch backend (kept to compare against) is the only part of the client that imports torch.
        import torch

        from tether.client.pairing import build_client_models, fetch_client_part

        tensors = fetch_client_part(self.stub, info, cfg.cache_dir, metadata=self.metadata,
                                    max_bytes=cfg.max_weights_mb << 20)  # fmt: skip
        models = build_client_models(info, tensors)
        self._draft_rng = torch.Generator().manual_seed(cfg.seed)
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        return Paired(info, models.tokenizer, models.drafter, nbytes)

    def _open(self) -> None:
        cfg = self.cfg
        self.stream = SessionStream(self.stub, self.metadata)
        open_ = pb.OpenSession(prompt=self.prompt, sampling=self._sampling(), max_new_tokens=cfg.max_new_tokens,
                               delta_codec=CODECS[cfg.codec],
                               model_fingerprint=self.info.model_fingerprint)  # fmt: skip
        self.stats.bytes_up += 4 * len(self.prompt)
        reply = self.stream.request(pb.ClientMessage(open=open_), cfg.connect_timeout_s)
        o = self._opened(reply)
        self.session_id, self.resume_token = o.session_id, o.resume_token
        self._begin(o)
        self.verified = len(self.prompt)
        self._set_state(State.ONLINE)
        self._emit([o.first_token], "verified")

    def _opened(self, reply: pb.ServerMessage) -> pb.Opened:
        """The reply to an open, if it is one this session can take: ids of the server's shape, a first token in
        the vocabulary, no more delta parts than positions left to cover."""
        if reply.WhichOneof("body") != "opened":
            raise self._bad_message(Problem.VERDICT, f"an open was answered by a {reply.WhichOneof('body')} message")
        o = reply.opened
        self._check_ids(o.session_id, o.resume_token)
        self._check_token(o.first_token, "first token")
        if o.delta_parts >= max(1, len(self.sequence[: self.verified or len(self.prompt)])):
            raise self._bad_message(Problem.DELTA, f"{o.delta_parts} more delta parts announced for a short prompt")
        return o

    def _check_ids(self, session_id: str, resume_token: str) -> None:
        if not (is_session_id(session_id) and is_session_id(resume_token)):
            raise self._bad_message(Problem.SESSION_ID, "not 32 lowercase hex digits")

    def _check_token(self, token: int, what: str) -> None:
        if not 0 <= token < self.drafter.layout.vocab_size:
            raise self._bad_message(Problem.TOKEN, f"{what} {token} is outside the vocabulary")

    def _begin(self, o: pb.Opened) -> None:
        """Start the drafter from the prompt's delta, which a long prompt sends in several parts."""
        self._count_down(o.delta)
        self.drafter.begin(_delta(o.delta), capacity=self._capacity())
        for _ in range(o.delta_parts):
            part = self.stream.receive(self.cfg.connect_timeout_s).delta
            self._count_down(part)
            self.drafter.commit(_delta(part))

    def _capacity(self) -> int:
        return len(self.prompt) + self.cfg.max_new_tokens + self.cfg.k + 2

    # ---- online ----------------------------------------------------------------------------------------

    def _round(self) -> None:
        cfg = self.cfg
        root = self.tokens[-1]
        k = max(0, min(cfg.k, cfg.max_new_tokens - len(self.tokens) - 1, self.info.max_draft_tokens))
        drafts, q_ids, q_probs = self.drafter.draft(root, k, temperature=cfg.temperature, top_p=cfg.top_p,
                                                    generator=self._draft_rng)  # fmt: skip
        msg = pb.DraftRound(round=self.round + 1, root=root, tokens=drafts)
        if q_ids is not None:
            rows = zip(q_ids.tolist(), q_probs.tolist(), strict=True)
            msg.q.extend(pb.SparseDistribution(ids=i, probs=p) for i, p in rows)
        self.stats.bytes_up += 4 * (1 + len(drafts)) + (8 * int(np.prod(q_ids.shape)) if q_ids is not None else 0)
        try:
            reply = self.stream.request(pb.ClientMessage(round=msg), cfg.round_timeout_s)
            v = self._verdict(reply, msg)
            self._count_down(v.delta)
            self._drafts = drafts
            try:
                self.drafter.commit(_delta(v.delta))
            finally:
                self._drafts = []
        except BaseException:
            self.drafter.discard_drafts()  # the round is lost: drafting goes on after the verified positions
            raise
        self.round += 1
        self.stats.rounds += 1
        self.stats.drafted += len(drafts)
        self.stats.accepted += v.accepted
        self.verified = v.delta.start + len(v.delta.tokens)
        self._emit(drafts[: v.accepted] + [v.bonus], "verified")

    def _verdict(self, reply: pb.ServerMessage, sent: pb.DraftRound) -> pb.Verdict:
        """The reply's verdict if it answers the round sent (the gate checks its delta), else BadMessage."""
        body = reply.WhichOneof("body")
        if body != "verdict":
            raise self._bad_message(Problem.VERDICT, f"round {sent.round} was answered by a {body} message")
        v = reply.verdict
        if v.round != sent.round or v.accepted > len(sent.tokens) or len(v.delta.tokens) != v.accepted + 1:
            raise self._bad_message(
                Problem.VERDICT,
                f"round {v.round} (sent {sent.round}): {v.accepted} of {len(sent.tokens)} drafts accepted, "
                f"a delta of {len(v.delta.tokens)} positions",
            )
        self._check_token(v.bonus, f"bonus token of round {v.round}")
        return v

    # ---- offline and resync --------------------------------------------------------------------------

    def _offline_step(self) -> None:
        if self.cfg.max_offline_tokens and self.offline_run >= self.cfg.max_offline_tokens:
            time.sleep(0.05)  # hold the text; keep trying to reconnect
            return
        tokens, _, _ = self.drafter.draft(self.tokens[-1], 1, temperature=self.cfg.temperature, top_p=self.cfg.top_p,
                                          generator=self._draft_rng)  # fmt: skip
        self.offline_run += 1
        self.stats.offline_tokens += 1
        self._emit(tokens, "offline")

    def _resync(self) -> None:
        """Resync from the verified length, then attach a new stream. The offline tokens go in pieces of at most
        `resync_piece_tokens` (a reply carries the KV delta of what it absorbed, ~1 KB a token), halved while the
        server says a reply would pass its message limit; each piece starts where the server's verified length
        now ends. Under rewind a piece that disagrees with the target, inside or at its first token (the target's
        token after the piece before), ends the resync there: exactly what one Resync of all of them would keep."""
        self._set_state(State.RESYNCING)
        t0 = time.monotonic()
        rebuilt = False
        size = max(1, self.cfg.resync_piece_tokens)
        while True:
            offline = self.sequence[self.verified :]  # the root (the target's last token) first, then our drafts
            piece = offline[:size]
            try:
                reply = self._resync_piece(piece)
            except ServerError as e:
                if e.reason != pb.REASON_REPLY_TOO_LARGE or len(piece) == 1:
                    raise
                size = len(piece) // 2  # the reply would pass the server's message limit: halve and retry
                continue
            rebuilt |= reply.rebuilt
            kept = len(reply.delta.tokens)
            rest = offline[len(piece) :]
            disagrees = kept < len(piece) or (self.cfg.policy == "rewind" and rest and rest[0] != reply.target_token)
            if rest and not disagrees:
                continue
            if kept < len(offline):  # rewind: retract what the target would not have written
                n = len(offline) - kept
                del self.tokens[len(self.tokens) - n :]
                del self.tags[len(self.tags) - n :]
                self.stats.retracted += n
                self.on_event(Event("retract", count=n))
            break
        self.offline_run = 0
        self.stats.resyncs += 1
        self.stats.rebuilt += int(rebuilt)
        # The target's next token is decided now, whatever happens to the link next: were the attach to fail and
        # the client draft on from the last absorbed token instead, the next resync would hand the server a
        # drafted token as its own root (under rewind, a token the target never chose kept in the text).
        self._emit([reply.target_token], "verified")
        self._attach()
        self.round = 0
        self.stats.resync_s.append(time.monotonic() - t0)
        self._set_state(State.ONLINE, "rebuilt" if rebuilt else "")

    def _resync_piece(self, piece: list[int]) -> pb.ResyncReply:
        """One Resync call absorbing `piece` (the server's last token first); on a lost session it is sent again
        with the whole verified history. Commits the reply's delta."""
        cfg = self.cfg
        V = self.verified
        req = pb.ResyncRequest(session_id=self.session_id, resume_token=self.resume_token, verified_length=V,
                               offline_tokens=piece, sampling=self._sampling(), delta_codec=CODECS[cfg.codec],
                               model_fingerprint=self.info.model_fingerprint,
                               rewind=cfg.policy == "rewind")  # fmt: skip
        try:
            reply = self.stub.Resync(req, metadata=self.metadata, timeout=cfg.connect_timeout_s)
        except grpc.RpcError as e:
            if Refusal.of_rpc_error(e).reason != pb.REASON_HISTORY_REQUIRED:
                raise rpc_error(e) from None
            req.history.extend(self.sequence[:V])  # the server lost the session: it rebuilds from the whole history
            self.stats.bytes_up += 4 * V
            try:
                reply = self.stub.Resync(req, metadata=self.metadata, timeout=cfg.connect_timeout_s)
            except grpc.RpcError as e2:
                raise rpc_error(e2) from None
        self.stats.bytes_up += 4 * len(piece)
        self.stats.resync_bytes.append((4 * len(piece) + (4 * V if len(req.history) else 0), len(reply.delta.payload)))
        self._count_down(reply.delta)
        self._check_resync_reply(reply, V, piece)
        self.session_id, self.resume_token = reply.session_id, reply.resume_token  # a rebuilt session has a new id
        self.drafter.commit(_delta(reply.delta))
        self.verified = reply.verified_length
        return reply

    def _check_resync_reply(self, reply: pb.ResyncReply, V: int, piece: list[int]) -> None:
        """A reply this resync can take, else a lost call (BadMessage): it absorbs a prefix of the piece, all of it
        under keep (keep never retracts), from the client's verified length, and names a next token in the
        vocabulary and ids of the server's shape. The delta itself is the drafter's gate's to check."""
        kept = list(reply.delta.tokens)
        if not 1 <= len(kept) <= len(piece) or kept != piece[: len(kept)]:
            raise self._bad_message(Problem.DELTA, "a resync reply absorbed tokens that were not the piece sent")
        if self.cfg.policy == "keep" and len(kept) != len(piece):
            raise self._bad_message(Problem.DELTA, "a resync under keep dropped offline tokens")
        if reply.delta.start != V or reply.verified_length != V + len(kept):
            raise self._bad_message(Problem.DELTA, f"a resync reply from {V} claims {reply.verified_length} positions")
        self._check_ids(reply.session_id, reply.resume_token)
        self._check_token(reply.target_token, "next token")

    def _attach(self) -> None:
        if self.stream is not None:
            self.stream.close()
        self.stream = SessionStream(self.stub, self.metadata)
        att = pb.AttachSession(session_id=self.session_id, resume_token=self.resume_token)
        reply = self.stream.request(pb.ClientMessage(attach=att), self.cfg.connect_timeout_s)
        if reply.attached.verified_length != self.verified:
            raise ServerError(grpc.StatusCode.INTERNAL, "the server's verified length differs after resync")

    # ---- the loop --------------------------------------------------------------------------------------

    def run(self, prompt_text: str) -> Result:
        t0 = time.monotonic()
        self.backoff.reset()
        # Nothing to draft from before the first verified delta: wait for the server (until it refuses for good).
        finished = self.backoff.retry(
            lambda: self._connect(prompt_text),
            transient=(LinkDown, SessionLost),
            on_retry=lambda e: self.on_event(Event("info", detail=f"connecting: {e}")),
        )
        if finished:
            return self._result(t0)
        next_try = 0.0
        self.backoff.reset()
        give_up = None  # when generation ended offline under rewind: how long to wait for the link
        while True:
            # Done online, or done with every token verified (a resync absorbed the whole tail and the stream
            # after it could not attach): there is nothing left to resync.
            if self.done and (self.state == State.ONLINE or self.verified >= len(self.sequence)):
                break
            if self.done and (self.cfg.policy == "keep" or (give_up is not None and time.monotonic() > give_up)):
                if self.cfg.policy == "rewind":
                    self.on_event(Event("info", detail="gave up waiting for the server: offline tokens stand"))
                break
            if self.done and give_up is None:
                give_up = time.monotonic() + self.cfg.final_resync_s
            try:
                if self.state == State.ONLINE:
                    self._round()
                elif time.monotonic() >= next_try:
                    self._resync()
                    self.backoff.reset()
                    give_up = None
                elif not self.done:
                    self._offline_step()
                else:
                    time.sleep(min(0.05, max(0.0, next_try - time.monotonic())))
            except (LinkDown, SessionLost) as e:
                lost = isinstance(e, SessionLost)
                if self.state == State.ONLINE:
                    self.stats.outages += int(not lost)
                    if self.stream is not None:
                        self.stream.close()
                        self.stream = None
                    self._set_state(State.OFFLINE, str(e))
                    # A lost session answers at once: resync now. A dead link or a full server: draft alone, try
                    # again soon (a full server says when).
                    next_try = time.monotonic() + (0.0 if lost else self.backoff.wait(e))
                else:
                    self._set_state(State.OFFLINE, str(e))
                    if len(self.replicas.addresses) > 1 and not lost:
                        self._next_endpoint()  # its replica is unreachable or full: fail over (a full-history resync)
                    next_try = time.monotonic() + self.backoff.failed(e)
        self._finish()
        self._save(done=True)
        return self._result(t0)

    def _result(self, t0: float) -> Result:
        self.stats.wall_s = time.monotonic() - t0
        return Result(self.prompt, self.tokens, self.tags, self.models.tokenizer.decode(self.tokens), self.stats)

    def _connect(self, prompt_text: str) -> bool:
        """Pair, then open the session, or go on from the session file; True when that file's generation is done."""
        if self.models is None:
            self.pair()
        record = load_record(self.cfg.session_file, self.info.model_fingerprint) if self.cfg.session_file else None
        if record is not None and record.done:
            self.prompt, self.tokens, self.tags = record.prompt, record.tokens, record.tags
            self._set_state(State.DONE, "already finished")
            return True
        if record is not None:
            self._restore(record)
            return False
        if not self.prompt:
            self.prompt = self.models.tokenizer.encode(prompt_text)
            if not self.prompt:
                raise ValueError("the prompt encodes to no tokens")
        self._open()
        return False

    def _next_endpoint(self) -> None:
        address = self.replicas.failover()
        self.stats.failovers += 1
        self.on_event(Event("info", detail=f"trying replica {address}"))

    def _finish(self) -> None:
        """Close the session if the server is reachable; the text is complete either way."""
        if self.stream is not None:
            self.stream.close()
            self.stream = None
        if self.session_id:
            try:
                self.stub.Close(pb.CloseRequest(session_id=self.session_id), metadata=self.metadata, timeout=2.0)
            except grpc.RpcError:
                pass  # an offline finish: the server evicts the idle session in time
        self._set_state(State.DONE)

    def close(self) -> None:
        self.replicas.close()


def _replicas(cfg: ClientConfig, first: int) -> Replicas:
    return Replicas(cfg.server, first, keepalive_s=cfg.keepalive_s, tls_ca=cfg.tls_ca, tls_cert=cfg.tls_cert,
                    tls_key=cfg.tls_key)  # fmt: skip


def generate(cfg: ClientConfig, prompt: str, on_event: Callable[[Event], None] | None = None) -> Result:
    """Run one generation to the end (see EdgeSession)."""
    session = EdgeSession(cfg, on_event)
    try:
        return session.run(prompt)
    finally:
        session.close()


def generate_server_only(cfg: ClientConfig, prompt: str, tokenizer) -> Result:
    """The baseline: the server decodes alone and streams its tokens; nothing is drafted on the edge, and an
    outage simply stops the text until the server can be asked again."""
    replicas = _replicas(cfg, first=0)
    stub = replicas.stub
    metadata = (("authorization", f"Bearer {cfg.api_key}"),) if cfg.api_key else ()
    stats = Stats()
    t0 = time.monotonic()
    try:
        info = stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=metadata, timeout=cfg.connect_timeout_s)
        ids = tokenizer.encode(prompt)
        req = pb.OpenSession(prompt=ids, sampling=pb.SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p,
                             seed=cfg.seed), max_new_tokens=cfg.max_new_tokens,
                             model_fingerprint=info.model_fingerprint)  # fmt: skip
        stats.bytes_up += 4 * len(ids)
        tokens: list[int] = []
        vocab = json.loads(info.model_config_json).get("vocab_size", 0) if len(info.model_config_json) < 1 << 16 else 0
        for msg in stub.Generate(req, metadata=metadata, timeout=max(60.0, cfg.connect_timeout_s)):
            if len(tokens) + len(msg.tokens) > cfg.max_new_tokens or any(t >= vocab for t in msg.tokens):
                raise ServerDataError(Problem.TOKEN, "Generate streamed tokens outside the vocabulary or the length")
            tokens += list(msg.tokens)
            stats.bytes_down += 4 * len(msg.tokens)
    finally:
        replicas.close()
    stats.wall_s = time.monotonic() - t0
    return Result(ids, tokens, ["verified"] * len(tokens), tokenizer.decode(tokens), stats)
