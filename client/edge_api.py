"""The edge's OpenAI-compatible endpoint: tether.shared.openai_app's Backend over edge sessions.

Apps on the laptop talk OpenAI's API to `tether-client serve` (tether.client.edge_serve); each request is one edge
session (tether.client.session.EdgeSession): drafted here, verified by the tether server, and still answered while
the link is down.

Contract:
- `EdgeBackend.connect(cfg)` pairs once, as `tether-client generate` does (GetModelInfo, then the client part from
  the weight cache or the server): the weights, the tokenizer and the onnxruntime sessions are loaded once and
  every request reuses them. It raises what pairing raises: ServerError or LinkDown (the server refuses or cannot
  be reached: `serve` exits 1) and ServerDataError (the server sent something invalid: exit 2).
- Its Backend fields: `model_id` (the server's, or the name given), `chat` (the chat template of
  ModelInfo.chat_format_json over the client part's tokenizer; the built-in one from a server too old to send
  one), `max_context` (the model's max_seq_len), `max_prompt_tokens` (the server's), `max_new_tokens`
  (`cfg.max_new_tokens`: the most one request may ask for), `drafts_offline` (True).
- `generate(prompt, sampling, max_tokens)` runs one EdgeSession on a worker thread of its own: its own drafter
  state over the shared weights, the request's sampling (temperature, top_p, top_k, min_p, the penalties,
  logit_bias, stop_token_ids, ignore_eos and seed: SAMPLING_FIELDS, which the drafter proposes from too, offline
  included), `max_tokens` as its max_new_tokens, and the chat format's stop ids beside every end-of-text id and
  the request's stop ids (nothing is drafted past an end of turn); under ignore_eos the request's stop ids alone
  end it, as on the server's HTTP API. A control the tether server does not apply (ModelInfo.sampling_controls
  false), or a token id outside the vocabulary, is a 400 naming it, before a session starts. Each choice of a
  request with n > 1 is a session of its own (tether.shared.openai_generation: seed + i), each counted against
  the endpoint's max_streams.
  With Sampling.logprobs every token's log-probabilities go with it (Tokens.logprobs): the server's for the
  tokens it verified (SamplingParams.logprobs; Opened.first_logprob, Verdict.logprobs, ResyncReply.target_logprob:
  the target's processed distribution, the server's HTTP API's values), the drafter's own for tokens drafted
  offline (tether.client.logprobs says why), marked Tokens.drafter_logprobs so every choice names those entries
  (`"tether": {"drafter_logprobs": [...]}`), also once a resync has kept them: it verifies tokens, not their
  values. A server too old to report logprobs leaves the first chunk without them: the request is a 400.
  The session is opened in one try: a server that is full answers 503 `overloaded` with its Retry-After, one
  that cannot be reached 503 `server_unreachable` with a Retry-After too and the reason in a few words ("server
  unreachable", "link stalled, no reply in 30.0 s": nothing can be drafted before the server has verified the
  prompt), a prompt it finds too long 400; any other refusal, and anything invalid it sends, 502.
  Once open, the session survives outages on its own (drafting alone, resyncing) and yields `Tokens` as it emits
  them:
  - policy keep: offline tokens are yielded at once, marked offline (they stay in the text, unverified);
  - policy rewind: only verified text is yielded. Offline tokens are held back until the resync that follows:
    those the target keeps (the session tags them verified: Event "verify") are yielded then, as verified;
    those it retracts were never sent. Only when the generation ends offline and the link stays down past
    `final_resync_s` are the held tokens yielded, marked offline: they stand. So the stream never has to take
    text back (`Release` decides this, event by event).
  Closing the generator (the client went away, a stop string or the token limit reached) stops the session: it
  finishes the round in flight and closes its server session. `outstanding` counts sessions still running;
  `wait_released(timeout)` waits until none is (tests, shutdown); `stop_all()` stops every one.
- `observe(session, event)`, when given, sees every session's events on its worker thread (logs, tests).
- The log ("tether.edge", INFO): one line per change of a session's link state (tether.client.outage.LinkNotes:
  "offline: server unreachable", "resyncing", "online: ..."), and one when it ends, each naming the server's
  session id (its first 8 digits; the first one the server gave, kept after the session is closed or rebuilt).
  gRPC's own text of each failure is logged at DEBUG only.

Tests: tests/client/test_edge_api.py (the held-back text under rewind, error mapping, the command line),
tests/e2e/test_edge_api_e2e.py (a real server, the openai package and raw SSE, outages through tether.netsim).

    backend = EdgeBackend.connect(ClientConfig(server="127.0.0.1:50051"))
    app = OpenAIApp(backend, HttpConfig(port=8080))
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import logging
import threading
from collections.abc import AsyncIterator, Callable

from tether.client.controls import ControlsNotOffered, check_controls, controls_set
from tether.client.errors import Problem, ServerDataError
from tether.client.outage import LinkNotes, reason
from tether.client.pairing_checks import check_model_info
from tether.client.session import ClientConfig, EdgeSession, Event, Paired
from tether.client.session_types import SAMPLING_FIELDS
from tether.client.transport import LinkDown, ServerBusy, ServerError, SessionLost
from tether.shared.chat_template import ChatFormat, ChatTemplateError
from tether.shared.logits_processing import ControlError
from tether.shared.openai_api import ApiError, ErrorKind, Sampling, Tokens
from tether.shared.sampling import TokenLogprobs
from tether.v1 import tether_pb2 as pb

log = logging.getLogger("tether.edge")

UNREACHABLE_RETRY_S = 2.0  # Retry-After when the tether server cannot be reached to open a session
# The server's refusals a request caused itself; any other is the edge's upstream failing it (502).
REQUEST_KINDS = {pb.REASON_TOO_LONG: ErrorKind.CONTEXT_LENGTH, pb.REASON_INVALID_REQUEST: ErrorKind.INVALID_REQUEST}
_END = object()  # the generation ended: no more tokens


def api_error(e: Exception, server: str) -> ApiError | None:
    """The HTTP error for what ended a session (None: not a refusal or an outage, but a bug)."""
    if isinstance(e, ServerBusy):
        return ApiError(
            ErrorKind.OVERLOADED, f"the tether server at {server} is full: {e}", retry_after_s=max(1.0, e.retry_after_s)
        )
    if isinstance(e, ServerDataError):
        return ApiError(ErrorKind.UPSTREAM, f"the tether server at {server}: {e}")
    if isinstance(e, LinkDown | SessionLost):
        log.debug("the tether server at %s cannot be reached: %s", server, e)
        return ApiError(ErrorKind.UNREACHABLE, reason(e), retry_after_s=UNREACHABLE_RETRY_S)
    if isinstance(e, ServerError):
        return ApiError(REQUEST_KINDS.get(e.reason, ErrorKind.UPSTREAM), f"the tether server at {server} refused: {e}")
    return None


def own_drafter(paired: Paired, backend: str) -> Paired:
    """The pairing with a drafter of its own for one session: the weights are shared (onnxruntime sessions, which
    run concurrently, or torch parameters); the caches, which each sequence fills, are not."""
    d = paired.drafter
    if backend == "onnx":  # `keep` holds the original drafter, and with it the weights its sessions read
        fresh = type(d)(d.manifest, d.sessions, keep=[d])
    else:  # a shallow copy of the nn.Module shares its parameters; begin() gives the copy caches of its own
        fresh = copy.copy(d)
    return dataclasses.replace(paired, drafter=fresh)


def chat_format(info: pb.ModelInfo, tokenizer) -> ChatFormat:
    """The server's chat format (ModelInfo.chat_format_json), the built-in one from a server too old to send it."""
    if not info.chat_format_json:
        return ChatFormat.builtin_for(tokenizer)
    try:
        return ChatFormat.from_json(info.chat_format_json, tokenizer)
    except ChatTemplateError as e:  # every way the text can be malformed (TemplateProblem.FORMAT)
        raise ServerDataError(Problem.MODEL_INFO, f"chat_format_json: {str(e)[:200]}") from None


class EdgeBackend:
    """An OpenAIApp backend over edge sessions (see the module docstring)."""

    drafts_offline = True

    def __init__(
        self,
        cfg: ClientConfig,
        paired: Paired,
        *,
        model_id: str = "",
        observe: Callable[[EdgeSession, Event], None] | None = None,
    ):
        self.cfg, self.paired, self.observe = cfg, paired, observe
        info = paired.info
        model_cfg, _ = check_model_info(info)
        self.model_id = model_id or info.model_id
        self.chat = chat_format(info, paired.tokenizer)
        self.max_context = model_cfg.max_seq_len
        self.max_prompt_tokens = min(info.max_prompt_tokens, model_cfg.max_seq_len - 1)
        self.max_new_tokens = cfg.max_new_tokens
        self.outstanding = 0  # sessions whose worker has not finished (any thread)
        self._released = threading.Condition()
        self._running: set[_Request] = set()

    @classmethod
    def connect(
        cls, cfg: ClientConfig, *, model_id: str = "", observe: Callable[[EdgeSession, Event], None] | None = None
    ) -> EdgeBackend:
        """Pair with the server once (see the module docstring)."""
        session = EdgeSession(cfg)
        try:
            paired = session.pair()
        finally:
            session.close()
        return cls(cfg, paired, model_id=model_id, observe=observe)

    async def generate(self, prompt: list[int], sampling: Sampling, max_tokens: int) -> AsyncIterator[Tokens]:
        loop = asyncio.get_running_loop()
        inbox: asyncio.Queue = asyncio.Queue()

        def deliver(item: object) -> None:
            try:
                loop.call_soon_threadsafe(inbox.put_nowait, item)
            except RuntimeError:  # the loop is closed (the endpoint stopped): nobody is listening
                pass

        request = _Request(self, prompt, sampling, max_tokens, deliver)
        try:
            while (item := await inbox.get()) is not _END:
                if isinstance(item, ApiError):
                    raise item
                yield item
        finally:
            request.session.stop()

    def stop_all(self) -> None:
        """Stop every running session (the endpoint is shutting down)."""
        with self._released:
            running = list(self._running)
        for request in running:
            request.session.stop()

    def wait_released(self, timeout: float) -> bool:
        """True once every session has ended and closed its server session (False after `timeout` seconds)."""
        with self._released:
            return self._released.wait_for(lambda: self.outstanding == 0, timeout)

    def _started(self, request: _Request) -> None:
        with self._released:
            self.outstanding += 1
            self._running.add(request)

    def _ended(self, request: _Request) -> None:
        with self._released:
            self.outstanding -= 1
            self._running.discard(request)
            self._released.notify_all()


class Release:
    """What of a session's tokens may be sent, and when: offline ones at once, marked, under keep; under rewind
    only once a resync has kept them (then as verified), or at the end when the link never came back (marked).
    Their logprobs go with them (`reporting`): the drafter's own for every token drafted offline, kept or not."""

    def __init__(self, rewind: bool, send: Callable[[Tokens], None], reporting: bool = False):
        self.rewind, self.send, self.reporting = rewind, send, reporting
        self.held: list[int] = []  # rewind: offline tokens not sent until a resync decides on them
        self.held_logprobs: list[TokenLogprobs] = []  # theirs, one each, when reporting

    def event(self, e: Event) -> None:
        if e.kind == "tokens" and e.tag == "offline":
            if self.rewind:
                self.held += e.tokens
                self.held_logprobs += e.logprobs or []
            else:
                self.send(
                    Tokens(
                        list(e.tokens),
                        offline=True,
                        logprobs=self._logprobs(e.logprobs),
                        drafter_logprobs=self.reporting,
                    )
                )
        elif e.kind == "tokens":
            self.send(Tokens(list(e.tokens), logprobs=self._logprobs(e.logprobs)))
        elif e.kind == "verify" and self.rewind:  # a resync kept these (the oldest held first): verified now
            kept, self.held = self.held[: e.count], self.held[e.count :]
            scores, self.held_logprobs = self.held_logprobs[: e.count], self.held_logprobs[e.count :]
            if kept:
                self.send(Tokens(kept, logprobs=self._logprobs(scores), drafter_logprobs=self.reporting))
        elif e.kind == "verify":  # keep: sent marked offline already; a resync kept them, so they count verified
            self.send(Tokens([], verified=e.count))
        elif e.kind == "retract":  # always the tail, and only offline tokens
            del self.held[max(0, len(self.held) - e.count) :]
            del self.held_logprobs[len(self.held) :]

    def end(self) -> None:
        """The generation is over: held tokens stand (rewind, the link down past final_resync_s)."""
        if self.held:
            self.send(
                Tokens(
                    self.held,
                    offline=True,
                    logprobs=self._logprobs(self.held_logprobs),
                    drafter_logprobs=self.reporting,
                )
            )
            self.held, self.held_logprobs = [], []

    def _logprobs(self, entries: list[TokenLogprobs] | None) -> tuple[TokenLogprobs, ...] | None:
        return tuple(entries) if self.reporting and entries is not None else None


class _Request:
    """One request's session on its worker thread (see the module docstring)."""

    def __init__(
        self,
        backend: EdgeBackend,
        prompt: list[int],
        sampling: Sampling,
        max_tokens: int,
        deliver: Callable[[object], None],
    ):
        self.backend, self.prompt, self.deliver = backend, prompt, deliver
        self.notes = LinkNotes()
        self.sid = "-"  # the server's session id for the log (its first 8 digits), once it has given one
        cfg = dataclasses.replace(
            backend.cfg,
            **{name: getattr(sampling, name) for name in SAMPLING_FIELDS},
            max_new_tokens=max_tokens,
            session_file="",
        )
        try:  # before a thread starts: the request is refused as a whole
            check_controls(cfg, backend.paired.info, backend.paired.tokenizer.vocab_size)
        except ControlsNotOffered as e:
            raise ApiError(
                ErrorKind.INVALID_REQUEST, f"the tether server at {cfg.server}: {e}", controls_set(cfg)[0]
            ) from None
        except ControlError as e:
            raise ApiError(ErrorKind.INVALID_REQUEST, str(e), e.control) from None
        self.release = Release(cfg.policy == "rewind", deliver, reporting=sampling.logprobs is not None)
        self.session = EdgeSession(
            cfg, self.on_event, paired=own_drafter(backend.paired, cfg.backend), connect_attempts=1
        )
        # The template's end of turn too, nothing drafted past it; neither it nor end-of-text under ignore_eos
        # (cfg.ignore_eos: the session's own stop ids are then the request's stop_token_ids alone), as the server's
        # HTTP API decodes.
        self.session.stop_ids = frozenset() if sampling.ignore_eos else backend.chat.stop_ids
        self.session.logprobs = sampling.logprobs
        backend._started(self)
        threading.Thread(target=self._work, daemon=True, name="tether-edge-request").start()

    def on_event(self, e: Event) -> None:
        if self.backend.observe is not None:
            self.backend.observe(self.session, e)
        self.release.event(e)
        if self.sid == "-" and self.session.link.session_id:
            self.sid = self.session.link.session_id[:8]
        for line in self.notes.lines(e):
            log.info("session %s: %s", self.sid, line)

    def _work(self) -> None:
        server = self.session.cfg.server
        try:
            self.session.run(self.prompt)
            self.release.end()
            self.deliver(_END)
            s = self.session.stats
            log.info(
                "session %s: %d tokens, %d drafted offline, %d of them unverified, %d retracted, tau %.2f, %d resyncs",
                self.sid,
                len(self.session.tokens),
                s.offline_tokens,
                self.session.tags.count("offline"),
                s.retracted,
                s.tau,
                s.resyncs,
            )
        except Exception as e:
            error = api_error(e, server)
            if error is None:
                log.exception("edge session failed")
                error = ApiError(ErrorKind.INTERNAL, "internal error in the edge session")
            self.deliver(error)
        finally:
            self.session.close()
            self.backend._ended(self)
