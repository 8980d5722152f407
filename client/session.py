"""The edge client's generation loop: draft, get verified over the tether, keep going alone when it snaps.

States (docs/ARCHITECTURE.md, section 7): CONNECTING -> ONLINE -> OFFLINE -> RESYNCING -> ONLINE ... -> DONE.
The session takes and yields token ids: text is its callers' (tether.client.cli, chat, edge_api), which encode the
prompt with the tokenizer pairing brings (`models.tokenizer`) and decode what it emits.
- CONNECTING: `pair()`: GetModelInfo, then the client part from the weight cache or the server, in the form the
  backend drafts with (tether.client.backend_part): ONNX graphs for onnxruntime (the default; no torch anywhere on
  that path), or tensors for the torch drafter (imported only by that backend); then open the session with the
  prompt, or go on from the session file (tether.client.session_file).
- ONLINE, in the mode `mode` names (tether.client.adaptive; "auto" chooses by tether.client.mode_choice): chunks
  of the server's own decoding streamed in (Generate), tagged "verified", or the hybrid's rounds. Each round
  drafts after the root (the last token the target decided) a chain of k tokens or, where the server takes them,
  a draft tree (`tree`: chain, tree, or auto from the measured round trip and acceptance: tether.client.round_plan),
  sends it, drafts the next round ahead while it is verified (`pipeline`), and on the verdict adopts the verified
  states (KV delta) and emits the accepted drafts and the bonus token, tagged "verified"; the round drafted ahead
  goes out at once when the verdict went as guessed (tether.client.rounds). A round unanswered within
  `round_timeout_s` of being sent, a stream silent that long, or a broken stream, means OFFLINE.
- OFFLINE: the drafter goes on alone from what it holds (SA over its own tokens, CA over the last verified
  LSA vectors, TLI layers with their own KV cache); each token is emitted tagged "offline". The state's detail is
  the reason in a few words (tether.client.outage); gRPC's own text goes to the "tether.client" log at debug.
  Reconnection is tried with exponential backoff and jitter (tether.client.transport.Backoff, which also paces the
  connect loop and the weight download's retries), failing over along `--server`'s replicas.
- RESYNCING: Resync sends the verified length and the tokens produced since (the root first). Policy `keep`:
  the target absorbs them all. Policy `rewind`: it keeps those before the first one it disagrees with, the
  rest are retracted, and the text then equals what the target alone would have produced (greedy). Either way the
  tokens it kept are tagged verified (Event "verify"), so every surface agrees. A server that lost the session
  (restart, eviction, another replica) gets the full verified history and rebuilds it. Then a new stream attaches
  to the session and rounds go on (tether.client.resync, with OFFLINE).
- Turns (a chat): `extend(prompt)` makes the whole conversation the next run()'s prompt; the server session held
  is extended with the new tokens (Resync, which absorbs them) when the text up to the verified length is a prefix
  of it, else a new one is opened. `keep_open` leaves the server session open after run().
Structure: one record of the text (`text`, tether.client.session_text: prompt, tokens, tags, verified length, and
the only writers of them), the server link (`link`, tether.client.server_link: channel, ids, stream), the output
(`output`, tether.client.session_output: emitting, events, state, Stats), and, once paired, the parts that act on
them, each an object holding references to those: `rounds` (tether.client.rounds), `resync` (offline and resync,
tether.client.resync) and `online` (the online modes, tether.client.adaptive). This class connects, opens,
restores and runs the state machine over them.
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

    session = EdgeSession(ClientConfig(server="127.0.0.1:50051", max_new_tokens=64), on_event=print)
    tokenizer = session.pair().tokenizer
    result = session.run(tokenizer.encode("def f(x):"))
    result.token_ids, result.tags, result.stats

Tests: tests/e2e (test_backends, test_chaos, test_tree_pipeline, test_failover, test_capacity, test_client_restart,
test_chat_e2e, ...), tests/client/test_session_file.py, tests/client/test_session_text.py,
tests/client/test_round_shape.py, tests/test_client_install.py (the onnx backend in a virtualenv without torch).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable

from tether.client.adaptive import OnlineModes
from tether.client.backend_part import check_pairing, draft_random, fetch_part
from tether.client.controls import sampling_params, stop_ids
from tether.client.delta_gate import DeltaGate, DeltaLayout, wire_delta
from tether.client.errors import Problem
from tether.client.outage import reason
from tether.client.reply_check import ReplyCheck
from tether.client.resync import Resync
from tether.client.round_plan import Limits, lookahead_rows
from tether.client.rounds import Rounds
from tether.client.server_link import ServerLink
from tether.client.session_file import SessionRecord, load_record, save_record
from tether.client.session_output import SessionOutput
from tether.client.session_text import SessionText
from tether.client.session_types import ClientConfig, Event, Paired, Result, State, Stats, codec_fields
from tether.client.transport import DOWNLOAD_ATTEMPTS, Backoff, LinkDown, SessionFull, SessionLost
from tether.v1 import tether_pb2 as pb

log = logging.getLogger("tether.client")


class EdgeSession:
    """One generation (a chat's turns too) over its text, link, output and parts. See the module docstring."""

    def __init__(
        self,
        cfg: ClientConfig,
        on_event: Callable[[Event], None] | None = None,
        *,
        paired: Paired | None = None,
        connect_attempts: int = 0,
        started_at: float | None = None,
    ):
        """paired: a pairing made before (one per edge endpoint, tether.client.edge_api), used instead of pairing
        again; its drafter must be this session's own. connect_attempts: tries at opening the session before run()
        raises what failed (0: until the server refuses for good). started_at: when the command began
        (time.monotonic(); default: now), for Stats.ttft_from_start_s."""
        cfg.check()
        self.cfg = cfg
        self.reuse, self.connect_attempts = paired, connect_attempts
        self.controls = cfg.controls()  # the sampling rule the drafter proposes from (tether.client.controls)
        self._stopping = threading.Event()  # stop(): end the generation soon, from any thread
        self.text = SessionText()
        started = time.monotonic() if started_at is None else started_at
        self.output = SessionOutput(cfg, self.text, on_event, started, save=self._save)
        self.link = ServerLink(cfg)
        self.backoff = Backoff(cfg.backoff_initial_s, cfg.backoff_max_s, cfg.backoff_jitter, random.Random(cfg.seed))
        self.models: Paired | None = None  # set by pair(); the CLI and the demo read its tokenizer
        self.reserve = 0  # positions the caches keep for later turns (a chat), beyond this generation's
        self.keep_open = False  # leave the server session open after run() (a chat's next turn extends it)
        self.max_positions = 0  # the model's context (pair())
        self.capacity = 0  # positions the drafter's caches hold (set when a session opens)
        self._turn = False  # extend() kept the server session: run() resyncs the new tokens in first
        # pair() builds these over the drafter it brings: the checks of what the server sends, and the parts.
        self.drafter: DeltaGate
        self.check: ReplyCheck
        self.rounds: Rounds
        self.resync: Resync
        self.online: OnlineModes

    # ---- what callers read and set: the text's, the output's, the link's -----------------------------------

    @property
    def prompt(self) -> list[int]:
        return self.text.prompt

    @property
    def tokens(self) -> list[int]:
        return self.text.tokens

    @property
    def tags(self) -> list[str]:
        return self.text.tags

    @property
    def verified(self) -> int:
        return self.text.verified

    @property
    def sequence(self) -> list[int]:
        return self.text.sequence

    @property
    def stats(self) -> Stats:
        return self.output.stats

    @property
    def state(self) -> State:
        return self.output.state

    @property
    def info(self) -> pb.ModelInfo | None:
        return self.link.info

    @property
    def on_event(self) -> Callable[[Event], None]:
        return self.output.on_event

    @on_event.setter
    def on_event(self, on_event: Callable[[Event], None]) -> None:
        self.output.on_event = on_event

    @property
    def stop_ids(self) -> frozenset[int] | None:
        """Tokens that end a generation (pair() adds every end-of-text id; a chat its end of turn)."""
        return self.output.stop_ids

    @stop_ids.setter
    def stop_ids(self, ids: frozenset[int] | None) -> None:
        self.output.stop_ids = ids

    @property
    def logprobs(self) -> int | None:
        """Report each token's logprob and this many top ones' (Event.logprobs); None: none."""
        return self.output.logprobs

    @logprobs.setter
    def logprobs(self, n: int | None) -> None:
        self.output.logprobs = n

    @property
    def done(self) -> bool:
        full = len(self.text.tokens) >= self.cfg.max_new_tokens or len(self.text.sequence) >= self.max_positions
        return full or bool(self.text.tokens and self.text.tokens[-1] in self.output.ends)

    # ---- the session file: what a restarted client needs to go on (tether.client.session_file) ------------------

    def _save(self, done: bool = False) -> None:
        # Only consistent points: the root (position `verified`) emitted, i.e. not halfway through a paced round.
        text, link = self.text, self.link
        if not self.cfg.session_file or len(text.sequence) <= text.verified:
            return
        record = SessionRecord(
            self.cfg.server,
            link.info.model_fingerprint,
            link.session_id,
            link.resume_token,
            text.prompt,
            text.tokens,
            text.tags,
            text.verified,
            done,
        )
        save_record(self.cfg.session_file, record)

    def _restore(self, record: SessionRecord) -> None:
        """Go on from a saved session: a new server session over the verified history gives the drafter its
        states back; the loop then resyncs the root and any offline tail from there, as after an outage. Under a
        penalty the new session is opened over the prompt alone and the resync absorbs the verified text first."""
        text, link = self.text, self.link
        text.restore(record.prompt, record.tokens, record.tags)
        if record.session_id:
            link.close_other(record.session_id)  # it held only what is sent again now
        stream = link.new_stream()
        # Under a penalty the server must count the generated text as generated, which an open over it would not:
        # it opens over the prompt alone, and the resync absorbs the text verified before whatever the policy.
        history = text.prompt if self.controls.penalised else text.sequence[: record.verified]
        open_ = pb.OpenSession(
            prompt=history,
            sampling=self._sampling(),
            max_new_tokens=self.cfg.max_new_tokens,
            **codec_fields(self.cfg.codec),
            model_fingerprint=link.info.model_fingerprint,
        )
        self.output.stats.bytes_up += 4 * len(history)
        o = self._opened(stream.request(pb.ClientMessage(open=open_), self.cfg.connect_timeout_s), len(history))
        link.hold(o.session_id, o.resume_token)
        self._begin(o)
        # Every token tagged verified (the verified text, its root, a stream's tokens after it) is absorbed.
        verified_tags = max((i + 1 for i, t in enumerate(text.tags) if t == "verified"), default=0)
        self.resync.absorb_through(len(text.prompt) + verified_tags)
        text.adopt(len(history))
        self.resync.behind(text.verified)  # offline, the drafter first reads the saved tail after the history
        link.drop_stream()
        self.output.tell(Event("info", detail=f"resumed a saved session: {len(text.tokens)} tokens"))
        self.output.set_state(State.OFFLINE, "restored")

    def _sampling(self) -> pb.SamplingParams:
        return sampling_params(self.cfg, self.link.info, self.output.logprobs)

    # ---- connecting ----------------------------------------------------------------------------------

    def pair(self) -> Paired:
        """Learn the server's model and get the client part (cached on disk by hash) in the form the backend
        drafts with; builds the drafter and the parts that drive it. Waits up to `connect_timeout_s` for a server
        that is not up yet."""
        cfg = self.cfg
        backoff = self.backoff.fresh()
        deadline = time.monotonic() + cfg.connect_timeout_s

        info = self.reuse.info if self.reuse is not None else self.model_info(deadline)
        model_cfg, drafter_cfg = check_pairing(cfg, info, self.link.replicas.address)
        self.max_positions = model_cfg.max_seq_len

        def interrupted(e: Exception) -> None:
            self.output.tell(Event("info", detail=f"weight download interrupted ({e}); resuming"))

        def fetch() -> Paired:  # the pairing given to the session, or one fetched now
            return self.reuse if self.reuse is not None else fetch_part(cfg, self.link, info, self._progress)

        self.models = backoff.retry(fetch, attempts=DOWNLOAD_ATTEMPTS, on_retry=interrupted)
        self.output.stats.weights_bytes = self.models.nbytes
        # Every end-of-text id and the stop token ids, beside any the caller set (a chat's end of turn).
        self.output.stop_ids = self.output.ends | stop_ids(cfg, info, self.models.tokenizer)
        self.link.info = info
        layout = DeltaLayout.for_config(model_cfg, drafter_cfg)
        self.check = ReplyCheck(self.output, layout.vocab_size)
        # Every delta the server sends is checked against this session before it is decoded: it may cover only
        # the client's own tokens after the verified ones (those it has, plus a round's accepted drafts).
        self.drafter = DeltaGate(
            self.models.drafter,
            layout,
            coverable=lambda start: self.text.sequence[start:] + self.rounds.accepted,
            refuse=lambda message: self.check.refused(Problem.DELTA, message),
        )
        rng, streams = draft_random(cfg)
        parts = (cfg, self.text, self.link, self.output, self.check)
        limits = Limits(model_cfg.max_seq_len, info.max_draft_tokens, info.max_tree_nodes)
        self.rounds = Rounds(
            *parts, self.drafter, controls=self.controls, limits=limits, streams=streams, stopping=self._stopping
        )
        self.resync = Resync(*parts, self.drafter, self.rounds, controls=self.controls, rng=rng)
        self.online = OnlineModes(*parts, self.rounds, self.resync, controls=self.controls)
        return self.models

    def model_info(self, deadline: float | None = None) -> pb.ModelInfo:
        """The server's ModelInfo, asked once (transport.first_contact: a server still starting is waited for
        until `deadline`, connect_timeout_s from now by default; a wrong address is Unreachable at once)."""
        deadline = time.monotonic() + self.cfg.connect_timeout_s if deadline is None else deadline

        def waiting(hint) -> None:
            self.output.tell(
                Event(
                    "info",
                    detail=f"{hint.value} at {self.link.replicas.address} yet; waiting up "
                    f"to {self.cfg.connect_timeout_s:g} s",
                )
            )

        return self.link.model_info(self.backoff.fresh(), deadline, waiting)

    def _progress(self, done: int, total: int) -> None:
        self.output.tell(Event("download", count=done, total=total))

    def _open(self) -> None:
        cfg, text, link, output = self.cfg, self.text, self.link, self.output
        stream = link.new_stream()
        # A chat asks room for later turns too (the server caps it at its own limit; past that, turns rebuild).
        open_ = pb.OpenSession(
            prompt=text.prompt,
            sampling=self._sampling(),
            max_new_tokens=cfg.max_new_tokens + self.reserve,
            **codec_fields(cfg.codec),
            model_fingerprint=link.info.model_fingerprint,
        )
        output.stats.bytes_up += 4 * len(text.prompt)
        self.online.speculate()  # under auto, greedy: a Generate beside the open, which the first choice may take
        self.online.ping()  # under auto: the round trip and the server's pace, beside the open (the first choice's)
        output.prompt_sent_at = time.monotonic()
        o = self._opened(stream.request(pb.ClientMessage(open=open_), cfg.connect_timeout_s), len(text.prompt))
        self.online.opened(time.monotonic() - output.prompt_sent_at)
        link.hold(o.session_id, o.resume_token)
        self._begin(o)
        text.adopt(len(text.prompt))
        output.set_state(State.ONLINE)
        first = [o.first_logprob] if o.HasField("first_logprob") else []
        output.emit([o.first_token], "verified", self.check.logprobs(first, [o.first_token]))

    def _opened(self, reply: pb.ServerMessage, positions: int) -> pb.Opened:
        """The reply to an open over `positions` tokens, if it is one this session can take: ids of the server's
        shape, a first token in the vocabulary, no more delta parts than positions left to cover."""
        if reply.WhichOneof("body") != "opened":
            raise self.check.refused(Problem.VERDICT, f"an open was answered by a {reply.WhichOneof('body')} message")
        o = reply.opened
        self.check.ids(o.session_id, o.resume_token)
        self.check.token(o.first_token, "first token")
        if o.delta_parts >= max(1, positions):
            raise self.check.refused(Problem.DELTA, f"{o.delta_parts} more delta parts announced for a short prompt")
        return o

    def _begin(self, o: pb.Opened) -> None:
        """Start the drafter from the prompt's delta, which a long prompt sends in several parts."""
        stats = self.output.stats
        stats.bytes_down += len(o.delta.payload)
        self.capacity = self._capacity()
        self.resync.behind(None)
        self.drafter.begin(wire_delta(o.delta), capacity=self.capacity)
        for _ in range(o.delta_parts):
            part = self.link.stream.receive(self.cfg.connect_timeout_s).delta
            stats.bytes_down += len(part.payload)
            self.drafter.commit(wire_delta(part))

    def _capacity(self) -> int:
        return len(self.text.prompt) + self.cfg.max_new_tokens + lookahead_rows(self.cfg) + self.reserve

    # ---- a chat's turn -----------------------------------------------------------------------------------

    def extend(self, prompt: list[int]) -> bool:
        """Make `prompt` (the conversation so far) the next run()'s prompt; True when the held server session is
        extended, False when run() opens a new one. ValueError when it does not fit the model's context.
        When the session's text up to its verified length is a prefix of it, and it fits the drafter's caches, the
        held server session is kept: run() resyncs only the new tokens in, absorbed whatever the policy (they are
        the user's, not the drafter's), and generates after them. Otherwise, and always under a penalty (which
        counts a fresh session's whole conversation as its prompt, and would count tokens absorbed as generated),
        the server session is closed and run() opens a new one over the whole prompt (Stats.reopened). Either way
        the session then holds exactly `prompt`: a greedy reply is what a fresh session over it would give."""
        if self.models is None:
            raise RuntimeError("extend() continues a session that has run")
        if len(prompt) + 1 >= self.max_positions:
            raise ValueError(
                f"the conversation ({len(prompt)} tokens) no longer fits the model's context of "
                f"{self.max_positions} tokens"
            )
        V = self.text.verified
        room = len(prompt) + self.cfg.max_new_tokens + lookahead_rows(self.cfg) <= self.capacity
        # Under a penalty the server would count the new turn's tokens, absorbed, as generated, where a fresh
        # session over the conversation counts it all as the prompt (as vLLM does): a new session then.
        kept = room and 0 < V < len(prompt) and prompt[:V] == self.text.sequence[:V] and not self.controls.penalised
        self._stopping.clear()
        self.output.new_turn(reopened=not kept)
        self.online.new_turn()
        if kept:
            self.rounds.drop()
            self.text.start(prompt, verified=V)
            self.resync.new_turn(V)  # the drafter holds the verified positions; offline it reads the rest first
            self._turn = True
        else:
            self.link.close_session()
            self.text.start(prompt)
            self.resync.new_turn(None)
            self.rounds.restart()
        self.output.set_state(State.CONNECTING)
        return kept

    # ---- the loop --------------------------------------------------------------------------------------

    def run(self, prompt: list[int] | None = None) -> Result:
        """Generate after `prompt` (token ids), or after extend() from the prompt it set; stop() ends it early."""
        output = self.output
        t0 = output.prompt_sent_at = time.monotonic() if not self._turn else output.prompt_sent_at
        self.backoff.reset()
        # Nothing to draft from before the first verified delta: wait for the server (until it refuses for good).
        # After extend() kept the server session, the loop below resyncs the turn's tokens in first.
        finished = not self._turn and self.backoff.retry(
            lambda: self._connect(prompt),
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
                output.stats.stopped = True
                break
            # Done online, or done with every token verified (a resync absorbed the whole tail and the stream
            # after it could not attach): there is nothing left to resync.
            if self.done and (output.state == State.ONLINE or self.text.verified >= len(self.text.sequence)):
                break
            if self.done and (self.cfg.policy == "keep" or (give_up is not None and time.monotonic() > give_up)):
                if self.cfg.policy == "rewind":
                    output.tell(Event("info", detail="gave up waiting for the server: offline tokens stand"))
                break
            if self.done and give_up is None:
                give_up = time.monotonic() + self.cfg.final_resync_s
            try:
                if output.state == State.ONLINE:
                    self.online.step()  # a round, or a chunk of the stream (tether.client.adaptive)
                elif time.monotonic() >= next_try:
                    self.resync.resync()
                    self.backoff.reset()
                    give_up = None
                elif not self.done:
                    self.resync.offline_step()
                else:
                    time.sleep(min(0.05, max(0.0, next_try - time.monotonic())))
            except SessionFull:
                self.link.close_session()  # no room left in the server's session: the resync rebuilds one
                if output.state == State.ONLINE:
                    output.set_state(State.RESYNCING, "the server session is full: rebuilding it")
                next_try = 0.0
            except (LinkDown, SessionLost) as e:
                lost = isinstance(e, SessionLost)
                if output.state == State.ONLINE:
                    output.stats.outages += int(not lost)
                    self.link.drop_stream()
                    self._offline(e)
                    # A lost session answers at once: resync now. A dead link or a full server: draft alone, try
                    # again soon (a full server says when).
                    next_try = time.monotonic() + (0.0 if lost else self.backoff.wait(e))
                else:
                    self._offline(e)
                    if len(self.link.replicas.addresses) > 1 and not lost:
                        self._next_endpoint()  # its replica is unreachable or full: fail over (a full-history resync)
                    next_try = time.monotonic() + self.backoff.failed(e)
        self._finish()
        self._save(done=True)
        return self._result(t0)

    def _offline(self, error: Exception) -> None:
        """OFFLINE for `error`: its reason in a few words for people (tether.client.outage), gRPC's text at debug."""
        log.debug("session %s: offline: %s", self.link.session_id[:8] or "-", error)
        self.output.set_state(State.OFFLINE, reason(error))

    def _retrying(self, error: Exception) -> None:
        log.debug("connecting to %s: %s", self.link.replicas.address, error)
        self.output.tell(Event("info", detail=f"connecting: {reason(error)}"))

    def _result(self, t0: float) -> Result:
        self.output.stats.wall_s = time.monotonic() - t0
        return Result(self.text.prompt, self.text.tokens, self.text.tags, self.output.stats)

    def _connect(self, prompt: list[int] | None) -> bool:
        """Pair, then open the session, or go on from the session file; True when that file's generation is done."""
        if self.models is None:
            self.pair()
        record = load_record(self.cfg.session_file, self.link.info.model_fingerprint) if self.cfg.session_file else None
        if record is not None and record.done:
            self.text.restore(record.prompt, record.tokens, record.tags)
            self.output.set_state(State.DONE, "already finished")
            return True
        if record is not None:
            self._restore(record)
            return False
        if not self.text.prompt:
            if not prompt:
                raise ValueError("the prompt holds no tokens")
            self.text.start(prompt)
        self._open()
        return False

    def _next_endpoint(self) -> None:
        address = self.link.replicas.failover()
        self.output.stats.failovers += 1
        self.output.tell(Event("info", detail=f"trying replica {address}"))

    def _finish(self) -> None:
        """Close the session if the server is reachable (unless `keep_open`); the text is complete either way."""
        self.online.end_stream()
        if self.rounds.inflight is not None or self.rounds.stale:
            self.rounds.drop()  # stopped with a round in flight: its answer no longer matters
        self.link.drop_stream()
        if not self.keep_open:
            self.link.close_session()
        self.output.set_state(State.DONE)

    def stop(self) -> None:
        """End the generation soon (thread-safe): run() finishes the round or step in progress, closes the server
        session and returns the text so far."""
        self._stopping.set()

    def close(self) -> None:
        """Close the server session if one is still held (a chat's, or one a Ctrl-C left), then the channel."""
        self.link.close()


def generate(cfg: ClientConfig, prompt: list[int], on_event: Callable[[Event], None] | None = None) -> Result:
    """Run one generation after `prompt` (token ids) to the end (see EdgeSession)."""
    session = EdgeSession(cfg, on_event)
    try:
        return session.run(prompt)
    finally:
        session.close()
