"""The edge session ONLINE in either mode: the server's own decoding streamed in, or drafts verified by the server
(the hybrid), switched between mid-generation without losing or repeating a token.

`OnlineModes` is an object EdgeSession (tether.client.session) composes, over the session's text, link and output,
its rounds (the hybrid) and its resync (the catch-up); the choice itself is tether.client.mode_choice, a pure
function of what this measures (ClientConfig.mode: auto, hybrid, stream). `step()` is one online step in the mode
chosen: a chunk of the stream, or a round's verdict.
- Every generation opens its server session as the hybrid does (the prompt's delta gives the drafter its states,
  the open its first token), so the drafter can write offline from the first token on, whatever the mode.
- Streaming (`_to_stream`): the rounds in flight are dropped and the Session stream closed (the server session
  stays held: a held idle session is the first the server evicts when it needs room, and a catch-up rebuilds it
  from the history then); a Generate call over the whole text so far streams the target's tokens, emitted tagged
  verified as they come. The drafter is not fed them: it still holds the verified positions it held, and the
  streamed tokens are caught up lazily, by the next Resync (or fed to it by the first offline step).
- Under auto the session pings the server (`ping`, a GetModelInfo in the background) as it sends the open: the
  link's round trip, which the choice subtracts from the hybrid's verdict wait to predict a stream it has not
  tried, and what the server says a token of a stream takes now (ModelInfo.decode_step_s), which predicts it
  better where given. The open's own time (`opened`) and tau (the session's, once measured) predict the hybrid.
  With that answer the choice may start the generation streaming, before any round (or after the first rounds,
  should it come late). It pings again as each recheck comes due, so a recheck of the stream goes by what the
  server says now.
- Greedy under auto, where pairing's figures (its GetModelInfo's time, the pace it said) already choose the
  stream, a Generate over the prompt goes out beside the open (`speculate`), and the first step waits for the
  ping's answer (up to the open's time again: it costs the server no model work, so it normally comes first). A
  first choice that streams takes it, so a start in the stream costs no second round trip and prefill (its first
  chunk repeats the open's first token, which is skipped: a repeat that disagrees sends the generation to the
  hybrid); any other first choice cancels it.
- Back to the hybrid (`_to_hybrid`, the catch-up): the Generate call is cancelled (chunks not yet taken are dropped:
  the text is what was emitted), and a Resync absorbs every token after the verified length (tether.client.resync,
  `quiet`: no outage is told or counted), which gives the drafter their exact states in its delta and the target's
  next token, emitted verified; then a stream attaches and rounds go on. Its bytes and time are Stats.switch_bytes
  and switch_s (a switch to streaming: its prompt's bytes and the time to its first chunk).
- The link down while streaming (the call broken, or no chunk within round_timeout_s; connect_timeout_s for the
  first): OFFLINE as after a lost round. The drafter first steps over the streamed tokens (Resync.offline_step,
  Resync.behind), then writes alone; the resync after it absorbs the streamed tokens whatever the policy (they
  are the target's: Resync.absorb_through) and judges only those written offline. It ends attached, in the hybrid:
  the choice then decides whether to stream again.
- A stream the server refuses for load (ServerBusy) falls back to the hybrid, streaming barred for
  BUSY_BAR_TOKENS tokens; one it will not run at all (ServerError: a text past its prompt limit) or that ends before
  the client's generation does (the server's own length limit), for the rest of the generation.
- Greedy text is the target's in every mode and across any number of switches: every emitted token is the target's
  (a verdict's, a stream's, or a resync's next token), decided after exactly the text before it. Sampled text
  follows the target's law: each restarted stream draws from a seed of its own (tether.client.seeds.stream_seed).
  Streaming is not offered under presence or frequency penalties: a stream restarted over the text would count the
  tokens generated before it as prompt (ClientConfig.check refuses --mode stream with them).
- `choose()` is the seam tests replace to force switches on events (after N tokens, mid-call), and `clock` the one
  they replace to give the modes rates of their choosing (the meter's timestamps, time.monotonic by default), so
  the session's own choice runs on figures that events, not the machine's speed, decide; `end_stream()` cancels a
  Generate call still running (the generation ends), `new_turn()` lifts a bar for the next one.

Tests: tests/client/test_mode_choice.py (the rule), tests/e2e/test_adaptive_modes.py (the same greedy text for
hybrid, stream and forced switches; a link cut or stalled mid-stream and mid-catch-up; a refused stream; auto
probing a stream it predicted slower, and keeping it or coming back as measured; auto starting the generation
streaming where the server said a stream is clearly faster than the hybrid's prediction at the open).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from tether.client.controls import sampling_params
from tether.client.generation_stream import GenerationStream
from tether.client.mode_choice import BUSY_BAR_TOKENS, HYBRID, STREAM, ModeMeter, choose_mode
from tether.client.reply_check import ReplyCheck
from tether.client.resync import Resync
from tether.client.rounds import Rounds
from tether.client.seeds import stream_seed
from tether.client.server_link import ServerLink
from tether.client.session_output import SessionOutput
from tether.client.session_text import SessionText
from tether.client.session_types import ClientConfig, Event
from tether.client.transport import ServerBusy, ServerError
from tether.shared.logits_processing import SamplingControls
from tether.v1 import tether_pb2 as pb


class OnlineModes:
    """The session's online steps, streamed or drafted (see the module docstring)."""

    def __init__(
        self,
        cfg: ClientConfig,
        text: SessionText,
        link: ServerLink,
        output: SessionOutput,
        check: ReplyCheck,
        rounds: Rounds,
        resync: Resync,
        *,
        controls: SamplingControls,
    ):
        self.cfg, self.text, self.link, self.output, self.check = cfg, text, link, output, check
        self.rounds, self.resync, self.controls = rounds, resync, controls
        self.meter = ModeMeter()  # what each online mode gave (tether.client.mode_choice: mode="auto")
        self.generation: GenerationStream | None = None  # the Generate call while streaming; None: the hybrid
        self._early: GenerationStream | None = None  # a Generate sent beside the open (speculate): the first choice
        self._skip = 0  # tokens the stream's first chunk repeats (an early stream's: the open's first token)
        self._answered: threading.Event | None = None  # set once the last ping was answered; None: none sent
        self._first_wait_s: float | None = None  # the first step waits this long for the open's ping; None: done
        self._pinged_visit = -1  # the meter's visit whose recheck was pinged for (one ping a recheck)
        self._switch_bytes = (0, 0)  # the last switch to streaming's bytes (up, down), told with its first chunk
        self.clock: Callable[[], float] = time.monotonic  # the meter's timestamps (a seam: see the module docstring)

    def choose(self) -> str:
        """The mode of the next online step: tether.client.mode_choice over this session's figures."""
        wait_s = self.rounds.measured.wait_s
        return choose_mode(self.cfg.mode, self.meter, wait_s=wait_s, can_stream=self._can_stream())

    def new_turn(self) -> None:
        """A chat's next turn: a bar on streaming counted in the last turn's tokens is lifted."""
        self.meter.stream_barred_until = 0

    def ping(self) -> None:
        """Time one GetModelInfo on the channel the session uses (under auto; the session calls this as it sends
        the open): the link's round trip, which the server answers without model work (what a verdict's wait holds
        beyond it is the server's step), and what a token of a stream takes there now. In the background: its
        answer is taken whenever it comes (`_answered` is set once it came or failed)."""
        if self.cfg.mode != "auto":
            return
        t0, self._answered = time.monotonic(), threading.Event()
        answered = self._answered

        def done(future) -> None:
            try:
                if future.exception() is None:
                    self.meter.answered(time.monotonic() - t0, future.result().decode_step_s)
            finally:
                answered.set()

        call = self.link.stub.GetModelInfo.future(
            pb.GetModelInfoRequest(), metadata=self.link.metadata, timeout=self.cfg.connect_timeout_s
        )
        call.add_done_callback(done)

    def speculate(self) -> None:
        """Under auto, greedy, where the server said at pairing what a token of its streams takes: a Generate over
        the prompt sent beside the open, so that a generation the open's figures start streaming does not wait a
        round trip and a prefill more for it (its first token is the open's first token, which it repeats). Sent only
        where pairing's figures (its GetModelInfo's time and pace) already choose the stream; cancelled at the first
        choice unless that is the stream: a prefill and a few steps of the server's, wasted."""
        cfg, m = self.cfg, self.meter
        if cfg.mode != "auto" or cfg.temperature > 0 or self.output.logprobs or not self.link.info.decode_step_s:
            return
        if not m.server_step_s:  # nothing said since pairing (a chat's later turn has a fresher figure)
            m.answered(self.link.info_s, self.link.info.decode_step_s)
        if self.choose() == STREAM:
            self._early = self._generate(cfg.max_new_tokens)

    def opened(self, seconds: float) -> None:
        """The open's first token came `seconds` after it was sent: with tau, the hybrid's prediction. Where a
        Generate went out early, the first step waits for the ping sent with the open up to as long again."""
        stats = self.output.stats
        self.meter.opened(seconds, stats.tau if stats.rounds else 0.0)
        self._first_wait_s = seconds

    def _recheck_ping(self) -> None:
        """A fresh figure for each recheck that comes due (one ping a visit), so it goes by the server's load now."""
        m = self.meter
        if m.visit_tokens >= m.recheck and self._pinged_visit != m.visits:
            self._pinged_visit = m.visits
            self.ping()

    def _can_stream(self) -> bool:
        """Whether a Generate call can continue the text now, exactly."""
        c, text = self.controls, self.text
        return (
            not (c.presence_penalty or c.frequency_penalty)
            and len(text.tokens) >= self.meter.stream_barred_until
            and len(text.sequence) <= self.link.info.max_prompt_tokens
        )

    def step(self) -> None:
        """One online step in the mode chosen: a chunk of the stream, or a round's verdict."""
        if self._first_wait_s is not None and self._answered is not None and self._early is not None:
            self._answered.wait(self._first_wait_s)  # the early stream waits on the open's figures, all of them
        self._first_wait_s = None
        if self.cfg.mode == "auto" and self._answered is None:
            self.ping()  # a session that did not open here (restored from its file): its figures, late
        elif self.cfg.mode == "auto":
            self._recheck_ping()
        now = STREAM if self.generation is not None else HYBRID
        if now != self.meter.mode:
            self.meter.enter(now)  # the link's doing: a resync attached the hybrid
        want = self.choose()
        if self._early is not None and want != STREAM:
            self._early.close()  # the open's figures chose the hybrid
            self._early = None
        if want == HYBRID and self.generation is not None:
            self._to_hybrid()  # its next token, emitted: the switch's, not the hybrid's rate
            return
        if want == STREAM and self.generation is None:
            self._to_stream()
        before = len(self.text.tokens)
        if self.generation is not None:
            self._stream_step()
        else:
            self.rounds.step()
        self.meter.emitted(len(self.text.tokens) - before, self.clock())

    # ---- streaming -----------------------------------------------------------------------------------------

    def _to_stream(self) -> None:
        """Leave the hybrid: the server decodes the rest alone and streams it (the early stream where one was sent
        beside the open: it repeats the open's first token, skipped)."""
        stats = self.output.stats
        self.rounds.drop()  # a round in flight is forgotten: the text goes on from the tokens emitted
        self.link.drop_stream()
        self.resync.behind(self.text.verified)  # offline, the drafter first steps over what was streamed
        if self._early is not None:
            self.generation, self._early, self._skip = self._early, None, len(self.text.tokens)
        else:
            self.generation, self._skip = self._generate(self.cfg.max_new_tokens - len(self.text.tokens)), 0
        self.meter.enter(STREAM)
        stats.mode_switches += 1
        self.output.tell(Event("mode", detail=STREAM))

    def _generate(self, max_new_tokens: int) -> GenerationStream:
        """A Generate call over the whole text so far, for `max_new_tokens` more; its prompt's bytes counted."""
        cfg, stats, sequence = self.cfg, self.output.stats, self.text.sequence
        sampling = sampling_params(cfg, self.link.info, self.output.logprobs)
        if cfg.temperature > 0:
            sampling.seed = stream_seed(cfg.seed, len(sequence))
        req = pb.OpenSession(
            prompt=sequence,
            sampling=sampling,
            model_fingerprint=self.link.info.model_fingerprint,
            max_new_tokens=max_new_tokens,
        )
        stats.bytes_up += 4 * len(sequence)
        self._switch_bytes = (4 * len(sequence), 0)
        return GenerationStream(self.link.stub, req, self.link.metadata)

    def _stream_step(self) -> None:
        """The stream's next chunk, emitted; a refusal, or an end before the client's, goes back to the hybrid."""
        g, cfg, stats = self.generation, self.cfg, self.output.stats
        try:
            msg = g.receive(cfg.round_timeout_s if g.chunks else cfg.connect_timeout_s)
            if msg is not None:
                chunk = list(msg.tokens)
                for t in chunk:
                    self.check.token(t, "streamed token")
                repeated = self._repeated(chunk)
                chunk = chunk[max(repeated, 0) :]
                reported = self.check.logprobs(msg.logprobs, chunk) if repeated >= 0 else []
        except ServerBusy:  # the server is full for streams now: draft here instead for a while
            self.meter.bar_stream(len(self.text.tokens) + BUSY_BAR_TOKENS)
            self._to_hybrid()
            return
        except ServerError:  # the server will not stream this text: draft here to the end
            self.meter.bar_stream(cfg.max_new_tokens)
            self._to_hybrid()
            return
        except BaseException:
            self.end_stream()  # the link: the run loop goes offline
            raise
        if msg is not None and repeated < 0:  # the early stream went another way: the hybrid goes on from the text
            self._to_hybrid()
            return
        if msg is None:  # ended before this generation did (the server's own limit): the hybrid goes on
            self.meter.bar_stream(cfg.max_new_tokens)
            self._to_hybrid()
            return
        if g.chunks == 1:
            stats.switch_s.append(g.arrived_at - g.started_at)
            self.meter.switched(stats.switch_s[-1])
            stats.switch_bytes.append(self._switch_bytes)
        if not chunk:
            return  # the open's first token again, alone: nothing new
        stats.bytes_down += 4 * len(chunk)
        before = len(self.text.tokens)
        self.output.emit(chunk, "verified", reported)
        stats.stream_tokens += len(self.text.tokens) - before

    def _repeated(self, chunk: list[int]) -> int:
        """How many tokens at the chunk's head repeat the text's (an early stream's: the open's first token); -1
        where they disagree (a greedy step decided otherwise, as numerics under another batch may)."""
        n = min(self._skip, len(chunk))
        if chunk[:n] != self.text.tokens[len(self.text.tokens) - self._skip :][:n]:
            return -1
        self._skip -= n
        return n

    def end_stream(self) -> None:
        """Cancel the Generate call, if one runs. The tokens it streamed are the target's: a resync absorbs them
        whatever the policy."""
        if self._early is not None:
            self._early.close()
            self._early = None
        if self.generation is None:
            return
        self.generation.close()
        self.generation = None
        self.resync.absorb_through(len(self.text.sequence))

    # ---- back to drafting here -----------------------------------------------------------------------------

    def _to_hybrid(self) -> None:
        """The catch-up: the streamed tokens resynced in, the target's next token emitted, a stream attached."""
        self.end_stream()
        stats = self.output.stats
        t0, up, down = time.monotonic(), stats.bytes_up, stats.bytes_down
        self.resync.resync(quiet=True)
        self.meter.enter(HYBRID)
        stats.mode_switches += 1
        stats.switch_s.append(time.monotonic() - t0)
        self.meter.switched(stats.switch_s[-1])
        stats.switch_bytes.append((stats.bytes_up - up, stats.bytes_down - down))
        self.output.tell(Event("mode", detail=HYBRID))
