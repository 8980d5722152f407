"""The edge client's generation loop: draft, get verified over the tether, keep going alone when it snaps.

States (docs/ARCHITECTURE.md, section 7): CONNECTING -> ONLINE -> OFFLINE -> RESYNCING -> ONLINE ... -> DONE.
- CONNECTING: `pair()`: GetModelInfo, then the client part from the weight cache or the server, in the form the
  backend drafts with: ONNX graphs for onnxruntime (the default; tether.client.onnx_pairing, no torch anywhere on
  that path), or tensors for the torch drafter (tether.client.pairing, imported only by that backend); then open
  the session with the prompt, or go on from the session file (tether.client.session_file).
- ONLINE, in the mode `mode` names (tether.client.adaptive; "auto" chooses by tether.client.mode_choice): chunks
  of the server's own decoding streamed in (Generate), tagged "verified", or the hybrid's rounds. Each round
  drafts after the root (the last token the target decided) a chain of k tokens or, where the server takes them,
  a draft tree (`tree`: chain, tree, or auto from the measured round trip and acceptance), sends it, drafts the
  next round ahead while it is verified (`pipeline`), and on the verdict adopts the verified states (KV delta) and
  emits the accepted drafts and the bonus token, tagged "verified"; the round drafted ahead goes out at once when
  the verdict went as guessed (tether.client.rounds). A round unanswered within `round_timeout_s` of being sent,
  a stream silent that long, or a broken stream, means OFFLINE.
- OFFLINE: the drafter goes on alone from what it holds (SA over its own tokens, CA over the last verified
  LSA vectors, TLI layers with their own KV cache); each token is emitted tagged "offline". The state's detail is
  the reason in a few words (tether.client.outage); gRPC's own text goes to the "tether.client" log at debug.
  Reconnection is tried with exponential backoff and jitter (tether.client.transport.Backoff, which also paces the
  connect loop and the weight download's retries), failing over along `--server`'s replicas.
- RESYNCING: Resync sends the verified length and the tokens produced since (the root first). Policy `keep`:
  the target absorbs them all. Policy `rewind`: it keeps those before the first one it disagrees with, the
  rest are retracted, and the text then equals what the target alone would have produced (greedy). Either way the
  tokens it kept are tagged verified (Event "verify"), here, so every surface agrees. A server that lost the
  session (restart, eviction, another replica) gets the full verified history and rebuilds it.
  Then a new stream attaches to the session and rounds go on (tether.client.resync, with OFFLINE).
- Turns (a chat): `extend(prompt)` makes the whole conversation the next run()'s prompt; the server session held
  is extended with the new tokens (Resync, which absorbs them) when the text up to the verified length is a prefix
  of it, else a new one is opened (tether.client.resync). `keep_open` leaves the server session open after run().
Sampling: the config's rule (temperature, top_p, top_k, min_p, the penalties, logit_bias; tether.client.controls)
goes with open and Resync, and the drafter proposes from it online and offline, each drafted position processed
with its own context's counts; a server that does not apply the controls is refused by pair() (ControlsNotOffered).
A generation ends at `max_new_tokens`, at one of `stop_ids` (every end-of-text id of the model, the config's stop
token ids, and what a chat adds: its template's end of turn), at the model's context, or at `stop()`
(thread-safe); close() closes the server session if one is still held, then the channel. With `logprobs` set (the
edge's HTTP API), open and Resync ask the server for each verified token's logprobs (SamplingParams.logprobs), and
every "tokens" event carries them: the server's, checked (tether.client.logprobs), or the drafter's own offline.
A server without a drafter (ModelInfo.server_only) is refused by pair() with REASON_NO_DRAFTER: call `model_info()`
first and stream from it with tether.client.server_only. The first call (`model_info()`, `pair()`) reports an
address where no tether server answers as transport.Unreachable.
Every emitted token is final except offline ones, which `rewind` may retract (Event "retract"). The client
never depends on the server's memory to keep its text: tokens, tags and the verified length are its own.
A server that does not offer the ONNX part in the precision asked: FormatNotOffered (use `--backend torch`).

    result = generate(ClientConfig(server="127.0.0.1:50051", max_new_tokens=64), "def f(x):", on_event=print)
    result.text, result.tags, result.stats

Tests: tests/e2e (test_backends, test_chaos, test_tree_pipeline, test_failover, test_capacity, test_client_restart,
test_chat_e2e, ...), tests/client/test_session_file.py, tests/client/test_round_shape.py, tests/test_client_install.py
(the onnx backend in a virtualenv without torch).
"""

from __future__ import annotations

import logging
import random
import secrets
import threading
import time
from collections.abc import Callable

import grpc
import numpy as np

from tether.client.adaptive import Adaptive
from tether.client.controls import check_controls, sampling_params, stop_ids
from tether.client.delta_gate import DeltaGate, DeltaLayout, wire_delta
from tether.client.errors import Problem, ServerDataError
from tether.client.logprobs import server_logprobs
from tether.client.mode_choice import ModeMeter
from tether.client.onnx_pairing import FORMATS, fetch_onnx_part
from tether.client.outage import reason
from tether.client.pairing_checks import check_model_info
from tether.client.resync import Resync
from tether.client.rounds import Drafted, Measured, Rounds, lookahead_rows
from tether.client.seeds import draft_seed as _draft_seed
from tether.client.server_only import generate_server_only as generate_server_only
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
    SessionFull,
    SessionLost,
    SessionStream,
    first_contact,
)
from tether.shared.ids import is_session_id
from tether.shared.logits_processing import LogitsProcessing
from tether.shared.sampling import TokenLogprobs
from tether.v1 import tether_pb2 as pb
from tether.v1 import tether_pb2_grpc

log = logging.getLogger("tether.client")
AFFINITY_HEADER = "x-tether-affinity"  # per-generation key for load balancers' session affinity
DOWNLOAD_ATTEMPTS = 20  # a download a flaky link breaks resumes where the cache stops, this many times in a row


class EdgeSession(Resync, Rounds, Adaptive):
    """One generation: owns the channel, the drafter and the text. See the module docstring."""

    def __init__(self, cfg: ClientConfig, on_event: Callable[[Event], None] | None = None, *,
                 paired: Paired | None = None, connect_attempts: int = 0,
                 started_at: float | None = None):  # fmt: skip
        """paired: a pairing made before (one per edge endpoint, tether.client.edge_api), used instead of pairing
        again; its drafter must be this session's own. connect_attempts: tries at opening the session before run()
        raises what failed (0: until the server refuses for good). started_at: when the command began
        (time.monotonic(); default: now), for Stats.ttft_from_start_s."""
        cfg.check()
        self.started_at = time.monotonic() if started_at is None else started_at
        self.reuse, self.connect_attempts = paired, connect_attempts
        self.controls = cfg.controls()  # the sampling rule the drafter proposes from (tether.client.controls)
        self._stopping = threading.Event()  # stop(): end the generation soon, from any thread
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
        self.measured = Measured()  # the round trip, drafting time and acceptance (tether.client.rounds: tree="auto")
        self.meter = ModeMeter()  # what each online mode gave (tether.client.mode_choice: mode="auto")
        self._inflight: Drafted | None = None  # the round sent and not answered yet (rounds.py)
        self._answered_at: float | None = None  # when the last verdict arrived, until the round after it is sent
        self._queued: list = []  # overlapping rounds sent behind the one in flight, in order (rounds.Ahead)
        self._stale: list[int] = []  # overlapping rounds whose refusals as stale are still to come back (numbers)
        self._drafts_started = 0  # online chains drafted so far: the next one samples from the stream of that number
        self._drafts: list[int] = []  # a verdict's accepted tokens, while its delta is checked
        self.offline_run = 0
        self._last_emit = 0.0
        self.info: pb.ModelInfo | None = None  # GetModelInfo's answer (model_info())
        self.stop_ids: frozenset[int] | None = None  # tokens that end a generation (pair() adds end-of-text)
        # Report each token's logprob and this many top ones' (Event.logprobs; the edge's HTTP API sets it per
        # request): the server's for verified tokens, the drafter's own offline (tether.client.logprobs); None: none.
        self.logprobs: int | None = None
        self.reserve = 0  # positions the caches keep for later turns (a chat), beyond this generation's
        self.keep_open = False  # leave the server session open after run() (a chat's next turn extends it)
        self.max_positions = 0  # the model's context (pair())
        self.capacity = 0  # positions the drafter's caches hold (set when a session opens)
        self._turn = False  # extend() kept the server session: run() resyncs the new tokens in first
        self._feed_from: int | None = None  # offline, the drafter first reads the text from here (resync.py)
        self._absorb_to = 0  # a resync absorbs the text up to here whatever the policy (a restore's: _restore)
        self._t_prompt = 0.0  # when the prompt was sent (time to first token)

    # ---- events and bookkeeping ------------------------------------------------------------------------

    def _set_state(self, state: State, detail: str = "") -> None:
        if state != self.state:
            self.state = state
            self.on_event(Event("state", state=state, detail=detail))

    def _emit(self, tokens: list[int], tag: str, logprobs: list[TokenLogprobs] | None = None) -> None:
        room = self.cfg.max_new_tokens - len(self.tokens)
        tokens = tokens[:room]
        end = next((i + 1 for i, t in enumerate(tokens) if t in (self.stop_ids or ())), None)
        tokens = tokens[:end]
        if not tokens:
            return
        if self.cfg.pace_tokens_per_s > 0:
            for i, t in enumerate(tokens):
                wait = self._last_emit + 1.0 / self.cfg.pace_tokens_per_s - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                self._last_emit = time.monotonic()
                self._append([t], tag, None if logprobs is None else logprobs[i : i + 1])
        else:
            self._append(tokens, tag, None if logprobs is None else logprobs[: len(tokens)])

    def _append(self, tokens: list[int], tag: str, logprobs: list[TokenLogprobs] | None) -> None:
        self.tokens += tokens
        self.tags += [tag] * len(tokens)
        self.stats.token_emitted(len(tokens), self._t_prompt, time.monotonic(), self.started_at)
        self._save()
        self.on_event(Event("tokens", tokens=tokens, tag=tag, logprobs=logprobs))

    def _reported(self, entries, tokens: list[int]) -> list[TokenLogprobs] | None:
        """The server's logprobs of `tokens` (entries: pb.TokenLogprob), checked; None when none were asked."""
        if self.logprobs is None:
            return None
        try:
            return server_logprobs(entries, tokens, self.logprobs, self.drafter.layout.vocab_size)
        except ValueError as e:
            raise self._bad_message(Problem.LOGPROBS, str(e)) from None

    def _verify(self, start: int, end: int) -> None:
        """Positions start..end of the sequence are verified now (a resync kept them): the offline tokens among
        them are tagged verified here, the one place tags change, and each run of them is told as an Event
        "verify" (`start`: its index among the generated tokens, `count`), so every surface agrees."""
        i, end = max(start - len(self.prompt), 0), min(max(end - len(self.prompt), 0), len(self.tags))
        while i < end:
            j = i
            while j < end and self.tags[j] == "offline":
                j += 1
            if j > i:
                self.tags[i:j] = ["verified"] * (j - i)
                self.on_event(Event("verify", start=i, count=j - i))
            i = j + 1
        self._save()

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
        states back; the loop then resyncs the root and any offline tail from there, as after an outage. Under a
        penalty the new session is opened over the prompt alone and the resync absorbs the verified text first."""
        self.prompt, self.tokens, self.tags = list(record.prompt), list(record.tokens), list(record.tags)
        self.verified = record.verified
        if record.session_id:
            try:
                self.stub.Close(pb.CloseRequest(session_id=record.session_id), metadata=self.metadata, timeout=2.0)
            except grpc.RpcError:
                pass  # gone already (or unreachable): nothing is lost, it held only what we re-send now
        self._new_stream()
        # Under a penalty the server must count the generated text as generated, which an open over it would not:
        # it opens over the prompt alone, and the resync absorbs the text verified before whatever the policy.
        history = self.prompt if self.controls.penalised else self.sequence[: self.verified]
        open_ = pb.OpenSession(prompt=history, sampling=self._sampling(), max_new_tokens=self.cfg.max_new_tokens,
                               delta_codec=CODECS[self.cfg.codec],
                               model_fingerprint=self.info.model_fingerprint)  # fmt: skip
        self.stats.bytes_up += 4 * len(history)
        o = self._opened(self.stream.request(pb.ClientMessage(open=open_), self.cfg.connect_timeout_s))
        self.session_id, self.resume_token = o.session_id, o.resume_token
        self._begin(o)
        # Every token tagged verified (the verified text, its root, a stream's tokens after it) is absorbed.
        self._absorb_to = len(self.prompt) + max((i + 1 for i, t in enumerate(self.tags) if t == "verified"), default=0)
        self.verified = len(history)
        self._feed_from = self.verified  # offline, the drafter first reads the saved tail after the history
        self.stream.close()
        self.stream = None
        self.on_event(Event("info", detail=f"resumed a saved session: {len(self.tokens)} tokens"))
        self._set_state(State.OFFLINE, "restored")

    @property
    def done(self) -> bool:
        full = len(self.tokens) >= self.cfg.max_new_tokens or len(self.sequence) >= self.max_positions
        return full or bool(self.tokens and self.tokens[-1] in (self.stop_ids or ()))

    @property
    def sequence(self) -> list[int]:
        return self.prompt + self.tokens

    def _sampling(self) -> pb.SamplingParams:
        return sampling_params(self.cfg, self.info, self.logprobs)

    def _processing(self, context: list[int]) -> LogitsProcessing | None:
        """The logit_bias and penalties of the position after `context` (the text through a draft's root), which
        the drafter proposes from as the server's verifier does; None when the controls change nothing."""
        return self.controls.processing(context, len(self.prompt), self.drafter.layout.vocab_size)

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

        info = self.reuse.info if self.reuse is not None else self.model_info(deadline)
        if info.server_only:
            raise ServerError(grpc.StatusCode.FAILED_PRECONDITION, f"{self.replicas.address} runs no drafter "
                              "(server-only): stream from it with Generate", pb.REASON_NO_DRAFTER)  # fmt: skip
        model_cfg, drafter_cfg = check_model_info(info)  # before anything is downloaded or allocated
        check_controls(cfg, info, model_cfg.vocab_size)
        self.max_positions = model_cfg.max_seq_len
        if cfg.backend == "onnx" and FORMATS[cfg.precision] not in info.client_part_formats:
            raise FormatNotOffered(f"{cfg.server} does not offer the ONNX client part in {cfg.precision} (a server "
                                   "older than this client): pass --backend torch, or upgrade the server")  # fmt: skip

        def interrupted(e: Exception) -> None:
            self.on_event(Event("info", detail=f"weight download interrupted ({e}); resuming"))

        self.models = backoff.retry(lambda: self._fetch_part(info), attempts=DOWNLOAD_ATTEMPTS, on_retry=interrupted)
        self.stats.weights_bytes = self.models.nbytes
        # Every end-of-text id and the stop token ids, beside any the caller set (a chat's end of turn).
        self.stop_ids = (self.stop_ids or frozenset()) | stop_ids(cfg, info, self.models.tokenizer)
        # Every delta the server sends is checked against this session before it is decoded: it may cover only
        # the client's own tokens after the verified ones (those it has, plus a round's accepted drafts).
        self.drafter = DeltaGate(self.models.drafter, DeltaLayout.for_config(model_cfg, drafter_cfg),
                                 coverable=lambda start: self.sequence[start:] + self._drafts,
                                 refuse=lambda message: self._bad_message(Problem.DELTA, message))  # fmt: skip
        self.info = info
        return self.models

    def model_info(self, deadline: float | None = None) -> pb.ModelInfo:
        """The server's ModelInfo, asked once (transport.first_contact: a server still starting is waited for
        until `deadline`, connect_timeout_s from now by default; a wrong address is Unreachable at once)."""
        if self.info is None:
            deadline = time.monotonic() + self.cfg.connect_timeout_s if deadline is None else deadline

            def ask() -> pb.ModelInfo:
                return self.stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=self.metadata,
                                              timeout=max(0.1, deadline - time.monotonic()))  # fmt: skip

            def waiting(hint) -> None:
                self.on_event(Event("info", detail=f"{hint.value} at {self.replicas.address} yet; waiting up to "
                                                   f"{self.cfg.connect_timeout_s:g} s"))  # fmt: skip

            self.info = first_contact(ask, self.backoff.fresh(), address=self.replicas.address,
                                      tls=bool(self.cfg.tls_ca), deadline=deadline, on_wait=waiting)  # fmt: skip
        return self.info

    def _progress(self, done: int, total: int) -> None:
        self.on_event(Event("download", count=done, total=total))

    def _fetch_part(self, info: pb.ModelInfo) -> Paired:
        """The client part for the backend, and the random stream its drafter samples with."""
        cfg = self.cfg
        if self.reuse is not None and cfg.backend == "onnx":
            self._draft_rng = np.random.default_rng(_draft_seed(cfg.seed))
            self._draft_streams = lambda n: np.random.default_rng(_draft_seed(cfg.seed, n))
            return self.reuse
        if cfg.backend == "onnx":
            tree_width = 0 if cfg.tree == "chain" else cfg.tree_top_k  # a chain-only client derives no tree session
            part = fetch_onnx_part(self.stub, info, cfg.cache_dir, precision=cfg.precision, metadata=self.metadata,
                                   max_bytes=cfg.max_weights_mb << 20, on_progress=self._progress,
                                   threads=cfg.threads, tree_width=tree_width)  # fmt: skip
            self._draft_rng = np.random.default_rng(_draft_seed(cfg.seed))
            self._draft_streams = lambda n: np.random.default_rng(_draft_seed(cfg.seed, n))
            return Paired(info, part.tokenizer, part.drafter, part.nbytes)
        # The torch backend (kept to compare against) is the only part of the client that imports torch.
        import torch

        from tether.client.pairing import build_client_models, fetch_client_part

        if self.reuse is not None:
            self._draft_rng = torch.Generator().manual_seed(_draft_seed(cfg.seed))
            self._draft_streams = lambda n: torch.Generator().manual_seed(_draft_seed(cfg.seed, n))
            return self.reuse
        tensors = fetch_client_part(self.stub, info, cfg.cache_dir, metadata=self.metadata,
                                    max_bytes=cfg.max_weights_mb << 20, on_progress=self._progress)  # fmt: skip
        models = build_client_models(info, tensors)
        self._draft_rng = torch.Generator().manual_seed(_draft_seed(cfg.seed))
        self._draft_streams = lambda n: torch.Generator().manual_seed(_draft_seed(cfg.seed, n))
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        return Paired(info, models.tokenizer, models.drafter, nbytes)

    def _new_stream(self) -> None:
        """A new Session stream in place of the one held, which is closed: an open or attach that failed leaves its
        stream behind, and each would keep a gRPC thread waiting on it for good."""
        if self.stream is not None:
            self.stream.close()
        self.stream = SessionStream(self.stub, self.metadata)

    def _open(self) -> None:
        cfg = self.cfg
        self._new_stream()
        # A chat asks room for later turns too (the server caps it at its own limit; past that, turns rebuild).
        open_ = pb.OpenSession(prompt=self.prompt, sampling=self._sampling(),
                               max_new_tokens=cfg.max_new_tokens + self.reserve, delta_codec=CODECS[cfg.codec],
                               model_fingerprint=self.info.model_fingerprint)  # fmt: skip
        self.stats.bytes_up += 4 * len(self.prompt)
        self._t_prompt = time.monotonic()
        reply = self.stream.request(pb.ClientMessage(open=open_), cfg.connect_timeout_s)
        o = self._opened(reply)
        self.session_id, self.resume_token = o.session_id, o.resume_token
        self._begin(o)
        self.verified = len(self.prompt)
        self._set_state(State.ONLINE)
        first = [o.first_logprob] if o.HasField("first_logprob") else []
        self._emit([o.first_token], "verified", self._reported(first, [o.first_token]))

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
        self.capacity = self._capacity()
        self._feed_from = None
        self.drafter.begin(wire_delta(o.delta), capacity=self.capacity)
        for _ in range(o.delta_parts):
            part = self.stream.receive(self.cfg.connect_timeout_s).delta
            self._count_down(part)
            self.drafter.commit(wire_delta(part))

    def _capacity(self) -> int:
        return len(self.prompt) + self.cfg.max_new_tokens + lookahead_rows(self.cfg) + self.reserve

    # ---- the loop --------------------------------------------------------------------------------------

    def run(self, prompt_text: str | list[int] = "") -> Result:
        """Generate from a text, or from token ids (a chat its template rendered), or after extend() from the
        prompt it set; stop() ends it early."""
        t0 = self._t_prompt = time.monotonic() if not self._turn else self._t_prompt
        self.backoff.reset()
        # Nothing to draft from before the first verified delta: wait for the server (until it refuses for good).
        # After extend() kept the server session, the loop below resyncs the turn's tokens in first.
        finished = not self._turn and self.backoff.retry(
            lambda: self._connect(prompt_text),
            transient=(LinkDown, SessionLost),
            on_retry=self._retrying,
            attempts=self.connect_attempts,
        )
        self._turn = False
        if finished:
            return self._result(t0)
        next_try = 0.0
        self.backoff.reset()
        give_up = None  # when generation ended offline under rewind: how long to wait for the link
        while True:
            if self._stopping.is_set():
                self.stats.stopped = True
                break
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
                    self._online()  # a round, or a chunk of the stream (tether.client.adaptive)
                elif time.monotonic() >= next_try:
                    self._resync()
                    self.backoff.reset()
                    give_up = None
                elif not self.done:
                    self._offline_step()
                else:
                    time.sleep(min(0.05, max(0.0, next_try - time.monotonic())))
            except SessionFull:
                self._forget_session()  # no room left in the server's session: the resync rebuilds one
                if self.state == State.ONLINE:
                    self._set_state(State.RESYNCING, "the server session is full: rebuilding it")
                next_try = 0.0
            except (LinkDown, SessionLost) as e:
                lost = isinstance(e, SessionLost)
                if self.state == State.ONLINE:
                    self.stats.outages += int(not lost)
                    if self.stream is not None:
                        self.stream.close()
                        self.stream = None
                    self._offline(e)
                    # A lost session answers at once: resync now. A dead link or a full server: draft alone, try
                    # again soon (a full server says when).
                    next_try = time.monotonic() + (0.0 if lost else self.backoff.wait(e))
                else:
                    self._offline(e)
                    if len(self.replicas.addresses) > 1 and not lost:
                        self._next_endpoint()  # its replica is unreachable or full: fail over (a full-history resync)
                    next_try = time.monotonic() + self.backoff.failed(e)
        self._finish()
        self._save(done=True)
        return self._result(t0)

    def _offline(self, error: Exception) -> None:
        """OFFLINE for `error`: its reason in a few words for people (tether.client.outage), gRPC's text at debug."""
        log.debug("session %s: offline: %s", self.session_id[:8] or "-", error)
        self._set_state(State.OFFLINE, reason(error))

    def _retrying(self, error: Exception) -> None:
        log.debug("connecting to %s: %s", self.replicas.address, error)
        self.on_event(Event("info", detail=f"connecting: {reason(error)}"))

    def _result(self, t0: float) -> Result:
        self.stats.wall_s = time.monotonic() - t0
        # The text the continuation adds to its prompt (a first space kept), without the ids it ended at.
        shown = [t for t in self.tokens if t not in (self.stop_ids or ())]
        text = self.models.tokenizer.decode(shown, after=self.prompt)
        return Result(self.prompt, self.tokens, self.tags, text, self.stats)

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
            ids = prompt_text if isinstance(prompt_text, list) else self.models.tokenizer.encode(prompt_text)
            self.prompt = list(ids)
            if not self.prompt:
                raise ValueError("the prompt encodes to no tokens")
        self._open()
        return False

    def _next_endpoint(self) -> None:
        address = self.replicas.failover()
        self.stats.failovers += 1
        self.on_event(Event("info", detail=f"trying replica {address}"))

    def _finish(self) -> None:
        """Close the session if the server is reachable (unless `keep_open`); the text is complete either way."""
        self._end_stream()
        if self._inflight is not None or self._stale:
            self._drop_rounds()  # stopped with a round in flight: its answer no longer matters
        if self.stream is not None:
            self.stream.close()
            self.stream = None
        if not self.keep_open:
            self._forget_session()
        self._set_state(State.DONE)

    def stop(self) -> None:
        """End the generation soon (thread-safe): run() finishes the round or step in progress, closes the server
        session and returns the text so far."""
        self._stopping.set()

    def close(self) -> None:
        """Close the server session if one is still held (a chat's, or one a Ctrl-C left), then the channel."""
        self._forget_session()
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
