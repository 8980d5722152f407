"""The adaptive client end to end (tether.client.adaptive): the toy models served on loopback, the edge client over
gRPC, online modes forced and switched on events.

- greedy: the text is plain greedy decoding's in mode hybrid, stream and auto; streaming sends no rounds, the
  hybrid streams nothing;
- switches forced after given numbers of tokens, both ways, several times, some while a round is in flight and
  every one while the Generate call is still streaming: the same greedy text under keep and rewind, every token
  verified, each switch's bytes and time recorded; a sampled run switched so writes its whole length, verified;
- the link cut or stalled mid-stream, under rewind: the client writes offline, resyncs the streamed and offline
  tokens (keeping every streamed one) and streams again, ending with plain greedy's text;
- the link cut inside the catch-up Resync of a switch to the hybrid: an outage like any other, and the same text;
- a stream the server refuses for load (REASON_CAPACITY): the client drafts here instead, without an outage;
- auto's own choice on rates given (a virtual clock, the verdict wait, the open's time and the server's
  decode_step_s pinned): a stream predicted below the hybrid but within reach is probed, kept when it measures
  faster, left for the hybrid when slower (and not tried again), with plain greedy's text either way; one the server
  says is well below the hybrid is not probed; one it says is MARGIN above the hybrid's prediction at the open
  starts the generation, before any round, on the Generate sent beside the open (its repeat of the open's first
  token skipped).

Faults strike on events (tokens emitted, a Resync call answered), never on the clock; deadlines elsewhere are
generous, so a busy machine never makes a slow step look like an outage.

    .venv/bin/python -m pytest -q tests/e2e/test_adaptive_modes.py
"""

import pytest
from edge_text import run_text

from tether.client.adaptive import OnlineModes
from tether.client.mode_choice import (
    HYBRID,
    MARGIN,
    PROBE_REACH,
    STREAM,
    SWITCH_WEIGHT,
    TAU_PRIOR,
    predict_hybrid,
    predict_stream,
)
from tether.client.round_plan import Measured
from tether.client.session import ClientConfig, EdgeSession, Event, State
from tether.netsim.proxy import NetSimThread
from tether.server.errors import RequestError
from tether.v1 import tether_pb2 as pb

PROMPT = "def write_lines(path, lines):\n    "
N_NEW = 64
PATIENT = {"round_timeout_s": 120.0, "connect_timeout_s": 120.0}
FLAKY = {"round_timeout_s": 1.0, "connect_timeout_s": 5.0, "backoff_initial_s": 0.05, "backoff_max_s": 0.4,
         "final_resync_s": 60.0}  # fmt: skip
# A cut is seen at once, so its run can wait as long as a starved machine needs; a stall is seen only when a call
# times out, so its run waits long enough that no slow step on a busy machine reads as a second outage.
ROUND_TIMEOUT_S = {"cut": 120.0, "stall": 10.0}
MAX_OFFLINE = 8  # tokens the client writes alone in one outage before it waits for the link
SWITCH_AT = (6, 17, 30, 44)  # generated tokens at which the forced plan flips mode (stream first)


class Plan:
    """A forced switch plan: stream, then the other mode once the text has each of `at`'s token counts, one switch
    per count (a chunk or a round passing two makes two switches, one step apart). It counts the switches to the
    hybrid made while the Generate call still ran."""

    def __init__(self, session: EdgeSession, at=SWITCH_AT):
        self.session, self.at = session, at
        self.passed = self.mid_stream = 0

    def __call__(self) -> str:
        s = self.session
        if self.passed < len(self.at) and len(s.tokens) >= self.at[self.passed]:
            self.passed += 1
        want = (STREAM, HYBRID)[self.passed % 2]
        self.mid_stream += want == HYBRID and s.online.generation is not None
        return want


def generate(address: str, cache: str, plan: bool = False, **fields):
    session = EdgeSession(ClientConfig(server=address, max_new_tokens=N_NEW, cache_dir=cache, **PATIENT | fields))
    forced = Plan(session) if plan else None
    try:
        session.pair()  # builds the online modes, whose choice a plan replaces
        if forced is not None:
            session.online.choose = forced
        return run_text(session, PROMPT), forced
    finally:
        session.close()


@pytest.mark.parametrize("mode", ["hybrid", "stream", "auto"])
def test_greedy_text_is_plain_greedys_in_every_mode(served, cache, mode):
    result, _ = generate(served[0], cache, mode=mode)
    s = result.stats
    assert result.token_ids == served[2] and set(result.tags) == {"verified"}
    if mode == "stream":
        assert s.rounds == 0 and s.stream_tokens == len(served[2]) - 1  # all but the open's first token
        assert s.mode_switches == 1 and s.switch_bytes[0][0] > 0
    if mode == "hybrid":
        assert s.stream_tokens == 0 and s.rounds > 0 and s.mode_switches == 0


@pytest.mark.parametrize("policy", ["keep", "rewind"])
def test_switches_forced_on_events_change_no_token(served, cache, policy):
    result, plan = generate(served[0], cache, plan=True, policy=policy)
    s = result.stats
    assert result.token_ids == served[2] and set(result.tags) == {"verified"}
    assert s.mode_switches == len(SWITCH_AT) + 1 and plan.mid_stream == (len(SWITCH_AT) + 1) // 2
    assert s.stream_tokens > 0 and s.rounds > 0 and s.outages == 0 and s.resyncs == 0
    assert len(s.switch_s) == len(s.switch_bytes) == s.mode_switches
    assert all(up > 0 for up, _ in s.switch_bytes)  # every switch sends the text (Generate) or its tail (Resync)
    catch_ups = s.switch_bytes[1::2]  # stream first, so every second switch is to the hybrid
    assert all(down > 0 for _, down in catch_ups)  # the streamed tokens' KV delta
    # What the next switch is expected to cost (what a trial must be worth): the open's time, then every switch timed.
    m, expected = plan.session.online.meter, plan.session.online.meter.open_s
    for t in s.switch_s:
        expected += SWITCH_WEIGHT * (t - expected) if t > 0 else 0.0
    assert m.open_s > 0 and m.switch_s == pytest.approx(expected)


def test_switches_with_a_round_in_flight_change_no_token(served, cache):
    """Switches to streaming whenever a round is in flight (overlapping rounds, the default), until three happened."""
    session = EdgeSession(ClientConfig(server=served[0], max_new_tokens=N_NEW, cache_dir=cache, **PATIENT))
    seen = {"switched": 0}

    def choose() -> str:
        streaming = session.online.generation is not None
        if streaming and session.stats.stream_tokens >= 4:
            return HYBRID  # a few streamed tokens, then back
        if not streaming and session.rounds.inflight is not None and seen["switched"] < 3 and session.stats.rounds:
            seen["switched"] += 1
            return STREAM
        return STREAM if streaming else HYBRID

    try:
        session.pair()
        session.online.choose = choose
        result = run_text(session, PROMPT)
    finally:
        session.close()
    assert seen["switched"] >= 1 and result.token_ids == served[2] and set(result.tags) == {"verified"}


def test_a_sampled_run_switched_on_events_writes_its_whole_length(served, cache):
    result, _ = generate(served[0], cache, plan=True, temperature=0.9, seed=3, ignore_eos=True)
    assert len(result.token_ids) == N_NEW and set(result.tags) == {"verified"}
    assert result.stats.stream_tokens > 0 and result.stats.rounds > 0


class Outage:
    """One outage struck on an event (`strike()`: a cut or a stall of the proxy in front of the server) and lifted
    when the client next tries to resync having written MAX_OFFLINE tokens alone (or unable to write more); a stall
    at its first try, which comes only once its call has timed out."""

    def __init__(self, address: str, fault: str, **fields):
        self.sim = NetSimThread(("127.0.0.1", 0), ("127.0.0.1", int(address.rsplit(":", 1)[1])))
        self.sim.start()
        self.fault, self.struck, self.lifted, self.offline = fault, False, False, 0
        self.plan: Plan | None = None  # the online modes' choice, forced (None: the session's own)
        self.session = EdgeSession(ClientConfig(server=self.sim.address, max_new_tokens=N_NEW, policy="rewind",
                                                max_offline_tokens=MAX_OFFLINE, **FLAKY | fields))  # fmt: skip

    def strike(self) -> None:
        if not self.struck:
            self.struck = True
            self.sim.cut() if self.fault == "cut" else self.sim.stall()

    def on_event(self, e: Event) -> None:
        if e.kind == "tokens" and e.tag == "offline":
            self.offline += len(e.tokens)
        elif e.kind == "state" and e.state == State.RESYNCING and self.struck and not self.lifted:
            if self.fault == "stall" or self.offline >= MAX_OFFLINE or self.session.done:
                self.sim.restore()
                self.lifted = True

    def run(self, on_event=None):
        """The generation, paired over a clean link first (the fault comes with generation)."""
        try:
            self.session.pair()
            if self.plan is not None:
                self.session.online.choose = self.plan
            self.session.on_event = on_event or self.on_event
            return run_text(self.session, PROMPT)
        finally:
            self.session.close()
            self.sim.stop()


@pytest.mark.parametrize("fault", ["cut", "stall"])
def test_the_link_failing_mid_stream_writes_offline_and_ends_as_plain_greedy(served, cache, fault):
    outage = Outage(served[0], fault, cache_dir=cache, mode="stream", round_timeout_s=ROUND_TIMEOUT_S[fault])
    session, streamed_then = outage.session, []

    def on_event(e: Event) -> None:
        streaming = session.online.generation is not None
        if e.kind == "tokens" and streaming and len(session.tokens) >= 12 and not outage.struck:
            streamed_then.append(session.stats.stream_tokens + len(e.tokens))
            outage.strike()
        outage.on_event(e)

    result = outage.run(on_event)
    s = result.stats
    assert outage.lifted and s.outages == 1 and s.resyncs >= 1 and s.offline_tokens > 0
    assert s.stream_tokens > streamed_then[0]  # streamed before the outage and after it
    assert result.token_ids == served[2] and set(result.tags) == {"verified"}


@pytest.fixture(scope="module")
def hooked(start_server):
    """A server whose every answered Resync call runs the hooks in the list returned, after absorbing its piece and
    before its reply leaves: (address, hooks)."""
    hooks: list = []

    def edit(service):
        real = service.Resync

        async def resync(request, context):
            reply = await real(request, context)
            for hook in hooks:
                hook()
            return reply

        service.Resync = resync

    return start_server(edit)[0], hooks


def test_the_link_cut_inside_a_switchs_catch_up_is_an_outage_and_ends_as_plain_greedy(served, hooked, cache):
    address, hooks = hooked
    outage = Outage(address, "cut", cache_dir=cache, round_timeout_s=ROUND_TIMEOUT_S["cut"])
    outage.plan = Plan(outage.session, at=(10,))  # stream, then the hybrid from 10 tokens on
    hooks.append(outage.strike)  # the reply to the catch-up's Resync is lost
    try:
        result = outage.run()
    finally:
        hooks.clear()
    s = result.stats
    assert outage.lifted and s.outages == 1 and s.offline_tokens > 0 and s.stream_tokens >= 9
    assert result.token_ids == served[2] and set(result.tags) == {"verified"}


@pytest.fixture(scope="module")
def busy(start_server):
    """A server that refuses every Generate for load (REASON_CAPACITY, with retry advice)."""

    def full(service):
        def refuse(prompt, sampling):
            raise RequestError(pb.REASON_CAPACITY, "no room for another stream", retry_after_s=0.1)

        service.engine.plain.check_generation = refuse

    return start_server(full)[0]


@pytest.mark.parametrize("mode", ["auto", "stream"])
def test_a_stream_refused_for_load_drafts_here_instead(served, busy, cache, mode):
    result, _ = generate(busy, cache, mode=mode)
    s = result.stats
    assert result.token_ids == served[2] and set(result.tags) == {"verified"}
    assert s.stream_tokens == 0 and s.rounds > 0 and s.outages == 0


WAIT_S = 10.0  # the verdict wait the virtual runs pin: the link's real round trip is lost in it
HYBRID_S = 0.8 * WAIT_S  # the hybrid's seconds a token: a stream is predicted at 0.8x of it, under the margin


class PinnedWait(Measured):
    """The rounds' figures with the verdict wait pinned to WAIT_S (each verdict counted, its wait not taken)."""

    def __init__(self):
        super().__init__(wait_s=WAIT_S)

    def answered(self, wait_s: float | None, whole: bool) -> None:
        super().answered(None, whole)


class VirtualClock:
    """The online modes' clock (OnlineModes.clock): each step's tokens advance it by the seconds a token given for
    the mode the step ended in, so the rates the choice sees are these, however fast the machine runs."""

    def __init__(self, session: EdgeSession, stream_s: float):
        self.session, self.stream_s = session, stream_s
        self.now, self.seen = 0.0, 0

    def __call__(self) -> float:
        streaming = self.session.online.generation is not None
        tokens, self.seen = len(self.session.tokens) - self.seen, len(self.session.tokens)
        self.now += tokens * (self.stream_s if streaming else HYBRID_S)
        return self.now


@pytest.fixture(scope="module")
def pinned_pace(start_server):
    """A server whose GetModelInfo says decode_step_s is what the dict returned holds ("step_s"; 0.0: nothing, as
    an older server), and which lists each Generate call's prompt length ("generates"): (address, that dict)."""
    said = {"step_s": 0.0, "generates": []}

    def edit(service):
        service.engine.decoding.step_s = lambda: said["step_s"]
        real = service.Generate

        async def generate(request, context):
            said["generates"].append(len(request.prompt))
            async for message in real(request, context):
                yield message

        service.Generate = generate

    return start_server(edit)[0], said


def virtual_run(address: str, cache: str, stream_s: float):
    """A greedy generation under auto on the rates given (the hybrid's HYBRID_S, the stream's `stream_s` seconds a
    token of the virtual clock), the verdict wait, the open's time and pairing's pinned to WAIT_S."""
    session = EdgeSession(ClientConfig(server=address, max_new_tokens=N_NEW, cache_dir=cache, **PATIENT))
    try:
        session.pair()
        session.link.info_s = WAIT_S  # pairing's GetModelInfo took as long as the open, on the virtual clock
        session.rounds.measured = PinnedWait()
        session.online.clock = VirtualClock(session, stream_s)
        online = session.online
        session.online.opened = lambda seconds: OnlineModes.opened(online, WAIT_S)
        return run_text(session, PROMPT)
    finally:
        session.close()


@pytest.mark.parametrize(("stream_s", "kept"), [(0.1 * HYBRID_S, True), (HYBRID_S / 0.9, False)])
def test_auto_probes_a_stream_predicted_within_reach_and_keeps_it_only_if_faster(
    served, pinned_pace, cache, stream_s, kept
):
    """A stream predicted at 0.8x the hybrid (the old rule never tried it) is probed once the hybrid is judged;
    measured 10x faster it is kept to the end, measured at 0.9x the hybrid (within the margin) the hybrid comes back
    at its judgement and the stream is not tried again in the generation."""
    address, said = pinned_pace
    said["step_s"] = 0.0  # the server says nothing: the floor predicts
    assert PROBE_REACH < predict_stream(WAIT_S, 0.0) * HYBRID_S < 1.0  # within reach, below the hybrid
    result = virtual_run(address, cache, stream_s)
    s = result.stats
    assert result.token_ids == served[2] and set(result.tags) == {"verified"}
    assert s.stream_tokens > 0 and s.rounds > 0 and s.outages == 0
    assert s.mode_switches == (1 if kept else 2)  # kept: streaming to the end; else the hybrid back, for good


def test_auto_does_not_probe_a_stream_the_server_says_is_well_below_the_hybrid(served, pinned_pace, cache):
    """The floor is within reach as above, but the server says a stream's token takes 1 / 0.6 of the hybrid's (a
    loaded server): no probe, though the stream would have measured faster here."""
    address, said = pinned_pace
    said["step_s"] = HYBRID_S / 0.6
    try:
        result = virtual_run(address, cache, 0.1 * HYBRID_S)
    finally:
        said["step_s"] = 0.0
    assert result.token_ids == served[2] and set(result.tags) == {"verified"}
    assert result.stats.stream_tokens == 0 and result.stats.mode_switches == 0


@pytest.mark.parametrize("faster", [1.5, 1.1])
def test_auto_starts_streaming_at_the_open_where_the_server_says_a_stream_is_clearly_faster(
    served, pinned_pace, cache, faster
):
    """The server says a stream's token takes what makes it `faster` times the hybrid's prediction at the open (tau
    TAU_PRIOR a round of the open's time, WAIT_S): 1.5x, beyond the margin, starts the generation streaming before
    any round (the old rule always began with the hybrid's rounds); 1.1x, within it, begins with the hybrid."""
    address, said = pinned_pace
    hybrid = predict_hybrid(0.0, 0.0, WAIT_S, TAU_PRIOR)
    said["step_s"], said["generates"] = 1 / (faster * hybrid), []
    try:
        result = virtual_run(address, cache, said["step_s"])
    finally:
        said["step_s"] = 0.0
    s = result.stats
    assert result.token_ids == served[2] and set(result.tags) == {"verified"}
    prompt_len = len(result.prompt_ids)
    assert said["generates"][0] == prompt_len  # sent beside the open (greedy, the server's pace said at pairing)
    if faster > 1 + MARGIN:
        assert s.rounds == 0 and s.mode_switches == 1 and s.stream_tokens == len(served[2]) - 1
        assert said["generates"] == [prompt_len]  # that Generate taken: its repeat of the open's first token skipped
        assert s.switch_bytes[0][0] == 4 * prompt_len and len(s.switch_s) == 1  # its prompt, its first chunk
    else:
        assert s.rounds > 0  # the hybrid first, that Generate cancelled
