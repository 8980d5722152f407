"""How the edge client is online: streaming the server's own decoding, or drafting here for the server to verify
(the hybrid), chosen from what the client measured. The mechanics of switching are tether.client.adaptive.

Contract:
- MODES: ClientConfig.mode's values. "stream": the Generate RPC (the server decodes alone, tokens stream in);
  "hybrid": rounds of drafts verified by the server (tether.client.rounds); "auto": whichever is faster now.
  Offline writing is neither: it is the link's state, and happens in every mode when the link is down.
- `Rate`: a mode's tokens a second, an EWMA of the seconds per token over the intervals between its emissions.
  `restart()` begins a visit: the figure stays (what the mode gave last time) until the visit's first interval
  replaces it, so a mode left is remembered at its last rate, and a visit's figure is its own (a mode measured
  again is judged on what it gives now, not on what it gave before: a hybrid speeds up as its text repeats).
- `ModeMeter`: what the session measured of both modes: their Rates, the mode now, tokens written in this visit,
  whether this visit is a trial (`trial`: the mode the open chose, a mode never measured, probed, or the mode left,
  measured again at the recheck), the link's round trip (the fastest answer to a call that costs the server no
  model work: `answered`), what the server said a token of a stream takes now (ModelInfo.decode_step_s, with that
  answer; 0: nothing said: an older server, or one that has not streamed yet), how long the open took
  (`opened`: the round trip and the server's forward over the prompt), tau (tokens a round: the session's own
  where its rounds measured it, else TAU_PRIOR), and the generation length before which streaming is barred (a
  stream refused or ended early: `bar_stream`), and what a switch costs (`switch_s`: the open's time until a
  switch is timed, then an EWMA of the switches timed, `switched`). A hybrid visit's first SETTLE_ROUNDS verdicts
  after the one that starts its clock are not timed: its first rounds are chains until tether.client.round_plan
  has measured enough to draw trees, and its pipeline fills.
  A visit is `judged` once it measured MIN_INTERVALS intervals (a trial: TRIAL_INTERVALS, which bounds what a
  trial costs), or JUDGE_TOKENS tokens over them (a stream the server decodes alone comes in chunks of 16 tokens:
  one such interval measures 16 steps).
- `choose_mode(mode, m, *, wait_s, can_stream)`: the mode for the next step, a pure function of ClientConfig.mode
  and the measured figures (tests/client/test_mode_choice.py drives it with numbers): forced modes are kept,
  "hybrid" wherever streaming is not possible. Under auto:
  - at the open (nothing measured of either mode), the mode the open's figures predict: streaming when the
    server's figure (`predict_stream`) is MARGIN above the hybrid's prediction (`predict_hybrid`, from the open's
    time, the round trip, the server's figure and tau), else the hybrid, whose session the open attached (no
    switch). Either is a trial: judged, it is measured against the other's prediction as below;
  - a mode is judged, and may be left, only once its visit is judged;
  - a mode never measured is probed (a trial visit) when its prediction is within reach of the mode now: a stream
    when the server's own figure is at least 1 / (1 + MARGIN) of it (within noise below it, or above), its floor
    (no figure said) at least PROBE_REACH of it (a stream predicted so may still be faster: only measuring it
    tells); the hybrid when predicted MARGIN faster (its prediction assumes tau, not a floor);
  - a trial, judged, is kept only if it measured at least as fast as the mode it left (no margin: it was entered
    to be measured, not because it was measured faster), else that mode is taken back at once;
  - any other visit is left only for a mode measured MARGIN faster;
  - a mode left is measured again (a trial) once the one now has written `m.recheck` tokens (doubled at each such
    check, so the checks cost a shrinking share of the text): the hybrid always (its rate follows the text's
    tau, which nothing predicts), a stream only when the server's figure, where said, is within reach (a loaded
    server's stream is not tried again while the server says so). A probe measured slower is thus tried again
    only at the recheck, and flapping is bounded: a switch away from a mode is the open's choice, a probe (once a
    session), a recheck, the end of a trial, or a mode measured MARGIN faster.
  A useless probe costs a switch each way (a Generate's prefill of the text, then a catch-up Resync: see
  docs/ARCHITECTURE.md for their measured cost) and the trial's own steps until judged. So a trial (a probe, a
  recheck; not a switch to a mode predicted or measured MARGIN faster) waits until `trial_affordable`: the visit it
  leaves has lasted 2 / TRIAL_SHARE times what a switch costs. Each switch is a call the server queues with all
  others: on an idle server it costs tens of ms, under 128 background streams on an H100 3-20 s, where a recheck
  after 96 tokens made auto slower than both modes.
- `predict_stream(wait_s, rtt_s, step_s)`: what streaming would give, before it was ever measured: a token a
  `step_s` where the server said what a token of its streams takes now; else a token a verify round's server
  time, being what the hybrid's verdict wait holds beyond the round trip. That is a floor: a decode step costs at
  most a verify round of a draft (on a loaded server the two are one batched step and cost the same; on an idle
  GPU about the same fixed time; on a CPU a decode step costs several times less than a round of a k-token chain
  or tree, which is why a stream predicted below the hybrid is still probed when within PROBE_REACH).
- `predict_hybrid(rtt_s, step_s, open_s, tau)`: what the hybrid would give, before it was ever measured: tau
  tokens a round, a round being at least the round trip and a server step, and taken as long as the open took
  (the round trip and a forward over the prompt, which for a prompt of a few rounds' tokens costs about a verify
  round; a longer prompt overstates it, and the recheck then measures the hybrid). The client's drafting is not
  counted, nor pipelining's overlap: both unknown before a round.

    m = ModeMeter()
    mode = choose_mode("auto", m, wait_s=0.0, can_stream=True)  # "hybrid": nothing measured or said yet

Importing this module imports nothing but the standard library.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MODES = ("auto", "hybrid", "stream")
STREAM, HYBRID = "stream", "hybrid"
EWMA_WEIGHT = 0.25  # weight of the newest interval in a Rate
MIN_INTERVALS = 4  # a mode is judged (and may be left) only after this many of its intervals were measured ...
TRIAL_INTERVALS = 2  # ... a trial after this many (it costs a switch each way already: judged soon, it costs less)
JUDGE_TOKENS = 16  # ... or this many tokens over them (a lone stream's chunk: tether.server.verifier.DECODE_CHUNK)
SETTLE_ROUNDS = 2  # a hybrid visit's verdicts not timed after its first: round_plan.MIN_ROUNDS chains, then trees
MARGIN = 0.2  # leave a mode only for one measured at least this much faster: a switch costs a catch-up Resync or a
# server prefill, and two figures within noise of each other must not flap
PROBE_REACH = 0.5  # probe a stream never tried when its floor is at least this share of the hybrid's rate (on a
# CPU a verify round of the default draft costs about 3-4 decode steps of the toy models, bench/link.py)
MIN_STEP_S = 0.0005  # a server step is taken to last at least this long (a verdict wait within noise of the round
# trip says little more than that the server is fast)
TAU_PRIOR = 3.0  # tokens a round of a hybrid this session never measured: below the default k = 5's (the toy pair's
# held-out tau 4.3, the compact pair's recorded 4.68), since the prediction leaves out the client's drafting, which
# on the CPU link bench takes about as long as the server's round (bench/link.py: work_ms 45-65 a round)
FIRST_RECHECK = 96  # tokens the mode now writes before the mode left is measured again; doubled at every check
TRIAL_SHARE = 0.25  # a trial (a probe, a recheck) costs a switch each way: it is made only once the visit it
# leaves has lasted 2 / TRIAL_SHARE times what a switch costs, so that cost stays within this share of the time.
# A switch is a call the server queues with every other (a Generate's prefill, a catch-up Resync): a few tens of
# ms on an idle server, 3-20 s each under 128 background streams on an H100 (bench/link.py, --load full)
SWITCH_WEIGHT = 0.5  # weight of the newest switch in what a switch costs (ModeMeter.switch_s)
BUSY_BAR_TOKENS = 256  # a stream the server refused for load is not tried again for this many tokens


@dataclass
class Rate:
    """Tokens a second of one mode (see the module docstring)."""

    per_token_s: float = 0.0  # EWMA of the seconds per token of the intervals measured
    intervals: int = 0  # intervals measured in this visit
    tokens: int = 0  # tokens over them
    total: int = 0  # intervals ever measured

    def restart(self) -> None:
        self.intervals = self.tokens = 0

    def add(self, tokens: int, seconds: float) -> None:
        """`tokens` were written `seconds` after the emission before them."""
        if tokens <= 0:
            return
        per = max(seconds, 0.0) / tokens
        first = self.intervals == 0
        self.per_token_s = per if first else self.per_token_s + EWMA_WEIGHT * (per - self.per_token_s)
        self.intervals += 1
        self.tokens += tokens
        self.total += 1

    @property
    def tokens_per_s(self) -> float:
        """0.0 before any interval was ever measured; infinite for intervals too short to time."""
        if self.per_token_s > 0:
            return 1.0 / self.per_token_s
        return float("inf") if self.total else 0.0

    @property
    def measured(self) -> bool:
        return self.total > 0

    def judged(self, trial: bool = False) -> bool:
        """This visit measured enough to be judged: MIN_INTERVALS intervals (a trial: TRIAL_INTERVALS), or
        JUDGE_TOKENS tokens over them."""
        return self.intervals >= (TRIAL_INTERVALS if trial else MIN_INTERVALS) or self.tokens >= JUDGE_TOKENS


@dataclass
class ModeMeter:
    """What the session measured of its two online modes (see the module docstring)."""

    mode: str = HYBRID  # the mode now: a session opens attached to its Session stream
    rates: dict[str, Rate] = field(default_factory=lambda: {STREAM: Rate(), HYBRID: Rate()})
    visit_tokens: int = 0  # tokens written since the mode now began
    visits: int = 0  # visits begun (enter()), the open's not counted
    trial: bool = True  # this visit measures its mode (the open's, a probe, a recheck) until its judgement
    rtt_s: float = 0.0  # the link's round trip: the fastest answer to a call without model work (a ping); 0: none
    server_step_s: float = 0.0  # a stream's token on the server now, as it last said (ModelInfo.decode_step_s)
    open_s: float = 0.0  # the open's time: from sending it to its first token (a round trip and a prefill); 0: none
    tau: float = TAU_PRIOR  # tokens a round the hybrid gives: the session's own once its rounds measured it
    recheck: int = FIRST_RECHECK  # visit_tokens after which the mode left is measured again
    stream_barred_until: int = 0  # no stream before the generation holds this many tokens
    switch_s: float = 0.0  # what a switch costs: the open's time, then an EWMA over the switches measured; 0: none
    _began_at: float | None = None  # the first emission of this visit (time.monotonic()); None: none yet
    _last_at: float | None = None  # the last emission of this visit (time.monotonic()); None: none yet
    _untimed: int = SETTLE_ROUNDS  # emissions of this visit still to come before its intervals are timed
    _kept: bool = False  # this visit was judged (a trial then kept: an ordinary visit, judged already)

    def enter(self, mode: str) -> None:
        """A new visit of `mode` begins (a switch, or the link's doing: a resync attaches the hybrid). A visit that
        lasted until the mode left was due to be measured again makes the next such check come twice as late, and
        this visit a trial; so is the first visit of a mode never measured (a probe)."""
        rechecked = self.visit_tokens >= self.recheck
        if rechecked:
            self.recheck *= 2
        self.trial = rechecked or not self.rates[mode].measured
        self.mode, self.visit_tokens, self._last_at, self._began_at = mode, 0, None, None
        self._untimed, self._kept = (SETTLE_ROUNDS if mode == HYBRID else 0), False
        self.visits += 1
        self.rates[mode].restart()

    def emitted(self, tokens: int, at: float) -> None:
        """`tokens` written at `at` (time.monotonic()) in the mode now; the first emission of a visit starts its
        clock (what came before it is the switch's cost, not the mode's rate), and so do a hybrid visit's next
        SETTLE_ROUNDS (its rounds' shape and pipeline are still settling)."""
        if tokens <= 0:
            return
        rate = self.rates[self.mode]
        if self.judged:
            self.trial, self._kept = False, True  # judged and kept: from now on an ordinary visit
        if self._last_at is not None and self._untimed > 0:
            self._untimed -= 1
        elif self._last_at is not None:
            rate.add(tokens, at - self._last_at)
        if self._began_at is None:
            self._began_at = at
        self._last_at = at
        self.visit_tokens += tokens

    @property
    def judged(self) -> bool:
        """This visit measured enough to be judged (Rate.judged, for a trial or not), or was judged already."""
        return self._kept or self.rates[self.mode].judged(self.trial)

    @property
    def visit_s(self) -> float:
        """Seconds this visit has lasted, from its first emission to its last (0.0 before its second)."""
        return self._last_at - self._began_at if self._last_at is not None and self._began_at is not None else 0.0

    def switched(self, seconds: float) -> None:
        """A switch took `seconds` (to its mode's first token): what the next one is expected to cost."""
        if seconds > 0:
            self.switch_s = seconds if self.switch_s == 0 else self.switch_s + SWITCH_WEIGHT * (seconds - self.switch_s)

    def answered(self, seconds: float, step_s: float = 0.0) -> None:
        """A call was answered `seconds` after it was made, saying a token of a stream takes `step_s` (0: nothing)."""
        if seconds > 0:
            self.rtt_s = seconds if self.rtt_s == 0 else min(self.rtt_s, seconds)
        if step_s > 0:
            self.server_step_s = step_s

    def opened(self, seconds: float, tau: float = 0.0) -> None:
        """The open's first token came `seconds` after it was sent; `tau`: the session's measured tokens a round
        (0: none measured yet, TAU_PRIOR stands)."""
        self.open_s = max(seconds, 0.0)
        self.switch_s = self.switch_s or self.open_s  # a call queued as a switch's is, before any switch is timed
        if tau > 0:
            self.tau = tau

    def bar_stream(self, until_tokens: int) -> None:
        self.stream_barred_until = max(self.stream_barred_until, until_tokens)


def predict_stream(wait_s: float, rtt_s: float, step_s: float = 0.0) -> float:
    """Tokens a second of a stream never measured yet: a token a `step_s` (the server's own figure) where it said
    one; else from the hybrid's verdict wait (`wait_s`: the round trip and the server's step for this client) and
    the link's round trip (`rtt_s`), a token a server step (a floor). 0.0 when neither was measured (nothing to go
    by: no switch)."""
    if step_s > 0:
        return 1.0 / step_s
    if wait_s <= 0:
        return 0.0
    return 1.0 / max(wait_s - rtt_s, MIN_STEP_S)


def predict_hybrid(rtt_s: float, step_s: float, open_s: float, tau: float) -> float:
    """Tokens a second of a hybrid never measured yet: `tau` tokens a round, a round the longer of the round trip
    (`rtt_s`) and a server step (`step_s`, the server's figure), and the open's time (`open_s`: the round trip and
    a forward over the prompt). 0.0 when neither the server's figure nor the open's time is known."""
    round_s = max(rtt_s + step_s, open_s)
    if step_s <= 0 and open_s <= 0:
        return 0.0
    return tau / max(round_s, MIN_STEP_S)


def predicted(mode: str, m: ModeMeter, wait_s: float) -> float:
    """`mode`'s tokens a second before it was measured (predict_stream, predict_hybrid); 0.0: nothing to go by."""
    if mode == STREAM:
        return predict_stream(wait_s, m.rtt_s, m.server_step_s)
    return predict_hybrid(m.rtt_s, m.server_step_s, m.open_s, m.tau)


def within_reach(mode: str, guess: float, rate: float, m: ModeMeter) -> bool:
    """Whether `mode`, predicted at `guess` tokens a second, is worth measuring against a mode giving `rate`: a
    stream when the server's figure is within the margin below it (the floor: within PROBE_REACH), the hybrid when
    predicted MARGIN faster."""
    if guess <= 0:
        return False
    if mode == HYBRID:
        return guess > (1 + MARGIN) * rate
    return guess >= (1 / (1 + MARGIN) if m.server_step_s > 0 else PROBE_REACH) * rate


def recheck_due(other: str, m: ModeMeter, rate: float) -> bool:
    """Whether the mode left (`other`) is measured again at a recheck, against the mode now at `rate`: the hybrid
    always (its rate follows the text's tau, which nothing predicts, so it is measured even if never tried); a
    stream where the server's figure says it is within reach, else (no figure) where it was measured before."""
    if other == HYBRID:
        return True
    if m.server_step_s > 0:
        return within_reach(STREAM, 1.0 / m.server_step_s, rate, m)
    return m.rates[STREAM].measured


def trial_affordable(m: ModeMeter) -> bool:
    """Whether a trial away from the mode now (a probe, a recheck: a switch each way) costs at most TRIAL_SHARE of
    the time: the visit has lasted 2 / TRIAL_SHARE times what a switch costs (m.switch_s; none known: any)."""
    return m.visit_s * TRIAL_SHARE >= 2 * m.switch_s


def choose_mode(mode: str, m: ModeMeter, *, wait_s: float, can_stream: bool) -> str:
    """The online mode for the next step (see the module docstring). `mode`: ClientConfig.mode; `wait_s`: the
    hybrid's verdict wait (tether.client.round_plan.Measured, 0: none measured); `can_stream`: whether Generate can take
    the text now (its prompt limit, sampling rules a restarted stream keeps exactly, not barred)."""
    if not can_stream or mode == HYBRID:
        return HYBRID
    if mode == STREAM:
        return STREAM
    now = m.mode
    other = HYBRID if now == STREAM else STREAM
    mine, theirs = m.rates[now], m.rates[other]
    if not mine.measured and not theirs.measured and m.visits == 0:  # the open: its figures predict both
        stream, hybrid = predicted(STREAM, m, 0.0), predicted(HYBRID, m, 0.0)
        return STREAM if stream > 0 and hybrid > 0 and stream > (1 + MARGIN) * hybrid else now
    if not m.judged:
        return now  # what it gives is still unknown, and leaving it costs a switch
    affordable = trial_affordable(m)
    if affordable and m.visit_tokens >= m.recheck and recheck_due(other, m, mine.tokens_per_s):
        return other  # remembered from long ago, or only predicted: measure it, where it may now be faster
    if not theirs.measured:  # never tried: predicted; a probe (not predicted MARGIN faster) only where affordable
        guess = predicted(other, m, wait_s)
        faster = guess > (1 + MARGIN) * mine.tokens_per_s
        return other if within_reach(other, guess, mine.tokens_per_s, m) and (faster or affordable) else now
    margin = 0.0 if m.trial else MARGIN
    return other if theirs.tokens_per_s > (1 + margin) * mine.tokens_per_s else now
