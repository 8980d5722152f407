"""The online mode's choice (tether.client.mode_choice), a pure function of measured figures, driven with numbers.

- forced modes are kept; nothing streams where streaming is not possible;
- auto begins in the mode the open's figures predict: streaming where the server's figure (decode_step_s) is MARGIN
  above the hybrid's prediction (tau over the open's time, or the round trip and a server step), else the hybrid,
  whose session is open; a stream so begun is left for a hybrid predicted MARGIN faster than it measured;
- auto judges a mode only after MIN_INTERVALS intervals of it (a trial: TRIAL_INTERVALS; or JUDGE_TOKENS tokens
  over them), and leaves it only for one measured MARGIN faster; a hybrid visit's first SETTLE_ROUNDS verdicts
  after its clock started are not timed;
- a stream never tried is probed when predicted within reach of the hybrid, though below it: its floor within
  PROBE_REACH, the server's own figure (ModelInfo.decode_step_s) within the margin; the probe, judged, is kept
  only if measured at least as fast as the hybrid, else the hybrid comes back at once and the stream is not tried
  again before the recheck; a probe kept is an ordinary visit after;
- the prediction is the server's figure where it said one, else a token a server step, the step what the verdict
  wait holds beyond the round trip: with the issue's H200 figures, streaming on an idle server over links of 0 to
  150 ms, drafting here on a loaded one;
- a mode left is measured again once the one now has written `recheck` tokens, which then doubles: the hybrid
  (even one never tried) on its own visit's figures, so one that sped up since it was left is kept; a stream only
  while the server's figure says it is within reach;
- Rate and ModeMeter average and count as documented; the stream seeds differ by position and from the drafter's;
  mode stream is refused where a restarted stream would change what penalties count.

    .venv/bin/python -m pytest -q tests/client/test_mode_choice.py
"""

import pytest

from tether.client.mode_choice import (
    EWMA_WEIGHT,
    FIRST_RECHECK,
    HYBRID,
    JUDGE_TOKENS,
    MARGIN,
    MIN_INTERVALS,
    MIN_STEP_S,
    PROBE_REACH,
    SETTLE_ROUNDS,
    STREAM,
    SWITCH_WEIGHT,
    TAU_PRIOR,
    TRIAL_INTERVALS,
    TRIAL_SHARE,
    ModeMeter,
    Rate,
    choose_mode,
    predict_hybrid,
    predict_stream,
)
from tether.client.seeds import draft_seed, stream_seed
from tether.client.session_types import ClientConfig

FIGURES = {"wait_s": 0.0, "can_stream": True}


def meter(
    now: str, rates: dict[str, float], intervals: int = MIN_INTERVALS, visit: int = 32, tokens: int = 10
) -> ModeMeter:
    """A meter in mode `now` after `intervals` intervals of `tokens` tokens of it, each mode at its rate (tokens/s;
    absent: never), in an ordinary visit (not a trial)."""
    m = ModeMeter()
    for mode, rate in rates.items():
        if mode != now:
            m.enter(mode)
            m.rates[mode].add(tokens, tokens / rate)
    m.enter(now)
    for _ in range(intervals if now in rates else 0):
        m.rates[now].add(tokens, tokens / rates[now])
    m.visit_tokens, m.trial = visit, False
    return m


class Visits:
    """A session's emissions on a clock of its own: each visit's tokens `per` an emission at the rate given."""

    def __init__(self):
        self.m, self.at = ModeMeter(), 0.0

    def visit(self, mode: str, rate: float, emissions: int, per: int = 4) -> ModeMeter:
        if mode != self.m.mode:
            self.m.enter(mode)
        for _ in range(emissions):
            self.at += per / rate
            self.m.emitted(per, self.at)
        return self.m


def wait_for(rate: float, rtt_s: float = 0.0) -> float:
    """The verdict wait that predicts a stream of `rate` tokens/s over a link of `rtt_s`."""
    return rtt_s + 1 / rate


def choose(mode: str, m: ModeMeter, **figures) -> str:
    return choose_mode(mode, m, **FIGURES | figures)


def test_forced_modes_are_kept_and_nothing_streams_where_it_cannot():
    slow_stream = meter(STREAM, {STREAM: 10.0, HYBRID: 500.0})
    fast_stream = meter(HYBRID, {STREAM: 5000.0, HYBRID: 10.0})
    assert choose(STREAM, slow_stream) == STREAM
    assert choose(HYBRID, fast_stream) == HYBRID
    for mode in ("auto", STREAM, HYBRID):
        assert choose(mode, fast_stream, can_stream=False) == HYBRID


def test_auto_begins_with_the_hybrid_and_judges_after_enough_intervals():
    fresh = ModeMeter()
    assert choose("auto", fresh, wait_s=0.001) == HYBRID  # its session is open: nothing measured, no switch
    # A hybrid that a predicted stream would beat many times over is still measured for MIN_INTERVALS intervals,
    # or JUDGE_TOKENS tokens over fewer (a lone stream's chunk of 16 measures 16 steps).
    young = meter(HYBRID, {HYBRID: 1.0}, intervals=MIN_INTERVALS - 1, tokens=1)
    assert choose("auto", young, wait_s=0.001) == HYBRID
    assert choose("auto", meter(HYBRID, {HYBRID: 1.0}, intervals=1, tokens=JUDGE_TOKENS - 1), wait_s=0.001) == HYBRID
    assert choose("auto", meter(HYBRID, {HYBRID: 1.0}, intervals=1, tokens=JUDGE_TOKENS), wait_s=0.001) == STREAM
    assert choose("auto", meter(HYBRID, {HYBRID: 1.0}), wait_s=0.001) == STREAM
    assert choose("auto", meter(HYBRID, {HYBRID: 1.0}), wait_s=0.0) == HYBRID  # no wait measured: no guess


IDLE_STEP_S, LOADED_STEP_S = 1 / 70, 1 / 4  # the toy target's stream on the 2-core CPU (bench/link.py, 64 tokens)
SERVER_S = 0.025  # ... and its forward over bench/link.py's prompt (the open's time less the round trip)


def opened(rtt_s: float, step_s: float, server_s: float = SERVER_S, tau: float = 0.0) -> ModeMeter:
    """A fresh meter after the open: its ping answered over a link of `rtt_s` with the server's `step_s` (0: none
    said), the open's first token a round trip and `server_s` after it was sent."""
    m = ModeMeter()
    m.answered(rtt_s, step_s)
    m.opened(rtt_s + server_s, tau)
    return m


@pytest.mark.parametrize(
    ("rtt_s", "step_s", "want"),
    [
        (0.150, IDLE_STEP_S, STREAM),  # an idle server far away: the hybrid's rounds wait on the round trip
        (0.050, IDLE_STEP_S, STREAM),  # 70 tok/s against TAU_PRIOR (3) over 75 ms: 40
        (0.010, IDLE_STEP_S, HYBRID),  # 86: the hybrid, measured before a stream is probed
        (0.000, IDLE_STEP_S, HYBRID),
        (0.150, LOADED_STEP_S, HYBRID),  # a loaded server: a stream's token a batched step
        (0.050, LOADED_STEP_S, HYBRID),
        (0.010, LOADED_STEP_S, HYBRID),
        (0.000, LOADED_STEP_S, HYBRID),
        (0.150, 0.0, HYBRID),  # nothing said (an older server, or none streamed yet): nothing predicts a stream
        (0.150, 0.0012, STREAM),  # the H200, idle: 3-7x the hybrid at any round trip
        (0.050, 0.0012, STREAM),
    ],
)
def test_the_open_starts_in_the_mode_its_figures_predict(rtt_s, step_s, want):
    """Before any round: the server's figure against tau (TAU_PRIOR) over the open's time; the old rule always
    began with the hybrid and could leave it only once it was judged."""
    assert choose("auto", opened(rtt_s, step_s)) == want


def test_the_open_streams_only_where_the_stream_is_clearly_faster_and_takes_a_measured_tau():
    rtt_s, server_s = 0.050, SERVER_S
    hybrid = predict_hybrid(rtt_s, 0.0, rtt_s + server_s, TAU_PRIOR)
    assert hybrid == pytest.approx(TAU_PRIOR / (rtt_s + server_s))
    assert choose("auto", opened(rtt_s, 1 / ((1 + MARGIN) * hybrid * 1.01))) == STREAM
    assert choose("auto", opened(rtt_s, 1 / ((1 + MARGIN) * hybrid * 0.99))) == HYBRID  # within the margin
    # The session's own tau (a chat's later turn) replaces the prior: a drafter accepted twice as often keeps it.
    assert choose("auto", opened(rtt_s, 1 / ((1 + MARGIN) * hybrid * 1.5), tau=2 * TAU_PRIOR)) == HYBRID
    assert predict_hybrid(0.0, 0.0, 0.0, TAU_PRIOR) == 0.0  # nothing measured: no prediction
    assert predict_hybrid(0.050, 0.010, 0.0, 4.0) == pytest.approx(4.0 / 0.060)  # a round trip and a step at least


def test_a_stream_begun_at_the_open_is_left_for_a_hybrid_predicted_clearly_faster():
    """The stream measured far slower than the server said (it filled since): the hybrid, never measured, is
    probed once its prediction is MARGIN above the stream's measured rate; the old rule never left such a stream
    before its recheck."""
    m = opened(0.150, IDLE_STEP_S)
    assert choose("auto", m) == STREAM
    hybrid = predict_hybrid(m.rtt_s, m.server_step_s, m.open_s, m.tau)  # 23 tok/s
    v = Visits()
    v.m = m
    v.visit(STREAM, hybrid, 1 + TRIAL_INTERVALS, per=1)  # as fast as predicted: kept
    assert choose("auto", v.m) == STREAM
    v.visit(STREAM, hybrid / (1 + MARGIN) / 2, 16, per=1)
    assert choose("auto", v.m) == HYBRID


def test_a_hybrid_left_is_measured_again_on_its_own_visit_and_kept_once_it_sped_up():
    """The toy hybrid speeds up after its first rounds (trees, then tau 5-8 over repeating text): left for a stream
    measured faster than its first figures, it is measured again within 96 tokens of the stream (the old rule: 512),
    judged on that visit's timed rounds alone (its two settling rounds untimed, two intervals a trial's), and kept."""
    assert FIRST_RECHECK <= 96 and SETTLE_ROUNDS == 2 and TRIAL_INTERVALS == 2
    v = Visits()
    v.visit(HYBRID, 50.0, 8)  # the open's hybrid, judged at 50 tok/s
    assert choose("auto", v.m, wait_s=wait_for(70.0)) == STREAM  # a stream within reach: probed
    v.visit(STREAM, 70.0, 3, per=JUDGE_TOKENS)
    assert choose("auto", v.m, wait_s=wait_for(70.0)) == STREAM  # measured faster: kept
    v.visit(STREAM, 70.0, 96 // JUDGE_TOKENS - 4, per=JUDGE_TOKENS)
    assert choose("auto", v.m, wait_s=wait_for(70.0)) == STREAM  # not yet
    v.visit(STREAM, 70.0, 1, per=JUDGE_TOKENS)
    assert choose("auto", v.m, wait_s=wait_for(70.0)) == HYBRID  # the recheck
    v.visit(HYBRID, 30.0, 3, per=5)  # the catch-up's first rounds: chains, slow; the clock's start, then settling
    assert v.m.trial and choose("auto", v.m, wait_s=wait_for(70.0)) == HYBRID
    v.visit(HYBRID, 150.0, 1, per=8)
    assert choose("auto", v.m, wait_s=wait_for(70.0)) == HYBRID  # not judged yet
    v.visit(HYBRID, 150.0, 1, per=8)
    assert v.m.rates[HYBRID].tokens_per_s == pytest.approx(150.0)
    assert choose("auto", v.m, wait_s=wait_for(70.0)) == HYBRID  # judged faster: kept
    v.visit(HYBRID, 150.0, 4, per=8)
    assert not v.m.trial and choose("auto", v.m, wait_s=wait_for(70.0)) == HYBRID


def test_a_hybrid_never_tried_is_measured_at_the_recheck_once_the_visit_outlasted_its_cost():
    """Due after FIRST_RECHECK tokens, and made once the stream's visit has lasted 2 / TRIAL_SHARE times what a switch
    costs (here the open's time, 175 ms: 1.4 s, 98 tokens at 70 tok/s)."""
    m = opened(0.150, IDLE_STEP_S)
    v = Visits()
    v.m = m
    v.visit(STREAM, 70.0, FIRST_RECHECK // JUDGE_TOKENS - 1, per=JUDGE_TOKENS)
    assert choose("auto", v.m) == STREAM
    v.visit(STREAM, 70.0, 1, per=JUDGE_TOKENS)
    assert v.m.visit_s * TRIAL_SHARE < 2 * v.m.switch_s and choose("auto", v.m) == STREAM  # due, not yet affordable
    v.visit(STREAM, 70.0, 2, per=JUDGE_TOKENS)
    assert v.m.visit_s * TRIAL_SHARE >= 2 * v.m.switch_s and choose("auto", v.m) == HYBRID


LOADED_OPEN_S, LOADED_SWITCH_S = 15.0, 14.0  # an H100 under 128 background streams: an open, a catch-up Resync


def test_under_a_server_that_queues_every_call_a_recheck_waits_until_it_costs_a_share_of_the_visit():
    """An H100 under 128 background streams (bench/link.py --load full): the open took 15 s, and the stream it
    started gives 22 tok/s. The old rule measured the hybrid again after 96 tokens (4.4 s): a catch-up Resync of
    14 s, then a Generate of 5-8 s back, slower than both modes. Now the recheck waits until the visit has lasted
    2 / TRIAL_SHARE switches (120 s here)."""
    m = ModeMeter()
    m.answered(0.150, 1 / 22.0)
    m.opened(LOADED_OPEN_S)
    assert m.switch_s == LOADED_OPEN_S and choose("auto", m) == STREAM  # the hybrid predicted at tau / 15 s
    v = Visits()
    v.m = m
    v.visit(STREAM, 22.0, 1 + 2 * FIRST_RECHECK // JUDGE_TOKENS, per=JUDGE_TOKENS)
    assert v.m.visit_tokens >= v.m.recheck and choose("auto", v.m) == STREAM  # due, not affordable
    v.visit(STREAM, 22.0, int(2 * LOADED_OPEN_S / TRIAL_SHARE * 22.0 / JUDGE_TOKENS), per=JUDGE_TOKENS)
    assert choose("auto", v.m) == HYBRID  # the visit outlasted 2 / TRIAL_SHARE switches: measured again


def test_what_a_switch_costs_is_the_opens_time_then_the_switches_measured():
    m = ModeMeter()
    assert m.switch_s == 0.0
    m.opened(0.2)
    assert m.switch_s == 0.2
    m.switched(LOADED_SWITCH_S)
    assert m.switch_s == pytest.approx(0.2 + SWITCH_WEIGHT * (LOADED_SWITCH_S - 0.2))
    m.opened(0.1)  # a later turn's open: the switches measured stand
    m.switched(0.0)  # nothing timed: nothing changes
    assert m.switch_s == pytest.approx(0.2 + SWITCH_WEIGHT * (LOADED_SWITCH_S - 0.2))


def test_a_probe_waits_until_it_costs_a_share_of_the_visit_but_a_mode_predicted_faster_is_taken_at_once():
    """A stream within reach but not predicted faster is a probe: under a server whose calls queue for seconds it
    is not made after the hybrid's first judgement (the old rule made it); a stream predicted MARGIN faster is."""
    v = Visits()
    v.m.opened(LOADED_OPEN_S)
    v.visit(HYBRID, 10.0, 1 + SETTLE_ROUNDS + MIN_INTERVALS)
    v.m.answered(0.050, 1 / 9.5)  # the server's figure: within the margin below the hybrid
    assert v.m.judged and choose("auto", v.m) == HYBRID
    v.m.answered(0.050, 1 / (10.0 * (1 + MARGIN) * 1.1))  # predicted clearly faster: no trial, a switch
    assert choose("auto", v.m) == STREAM
    v.m.answered(0.050, 1 / 9.5)
    v.visit(HYBRID, 10.0, int(2 * LOADED_OPEN_S / TRIAL_SHARE * 10.0 / 4))
    assert choose("auto", v.m) == STREAM  # the visit outlasted 2 / TRIAL_SHARE switches: probed
    idle = Visits()
    idle.m.opened(0.05)
    idle.visit(HYBRID, 10.0, 1 + SETTLE_ROUNDS + MIN_INTERVALS)
    idle.m.answered(0.050, 1 / 9.5)
    assert choose("auto", idle.m) == STREAM  # a cheap switch: probed after the first judgement


def test_a_stream_is_measured_again_at_the_recheck_only_while_the_server_says_it_is_within_reach():
    remembered = {HYBRID: 100.0, STREAM: 90.0}
    m = meter(HYBRID, remembered, visit=FIRST_RECHECK)
    m.answered(0.050, 1 / 25.0)  # loaded now: a quarter of the hybrid
    assert choose("auto", m) == HYBRID  # the old rule measured it again whatever the server said
    m.answered(0.050, 1 / 90.0)  # idle again
    assert choose("auto", m) == STREAM
    assert choose("auto", meter(HYBRID, remembered, visit=FIRST_RECHECK)) == STREAM  # nothing said: measured again


def test_a_mode_is_left_only_for_one_margin_faster():
    just_under = (1 + MARGIN) * 100.0 * 0.99
    just_over = (1 + MARGIN) * 100.0 * 1.01
    assert choose("auto", meter(STREAM, {STREAM: 100.0, HYBRID: just_under})) == STREAM
    assert choose("auto", meter(STREAM, {STREAM: 100.0, HYBRID: just_over})) == HYBRID
    assert choose("auto", meter(HYBRID, {HYBRID: 100.0, STREAM: just_under})) == HYBRID
    assert choose("auto", meter(HYBRID, {HYBRID: 100.0, STREAM: just_over})) == STREAM


@pytest.mark.parametrize(
    ("hybrid_rate", "rtt_s", "step_s", "want"),
    [
        (325.0, 0.0005, 0.0012, STREAM),  # the H200 figures, an idle server: streaming 3-7x the hybrid
        (322.0, 0.010, 0.0012, STREAM),
        (162.0, 0.050, 0.0012, STREAM),
        (92.0, 0.150, 0.0012, STREAM),
        (110.0, 0.050, 0.050, HYBRID),  # a loaded server: a token a step for a stream, tau a step drafting here
        (110.0, 0.010, 0.050, HYBRID),
    ],
)
def test_a_stream_never_tried_is_predicted_from_the_verdict_wait_and_the_round_trip(hybrid_rate, rtt_s, step_s, want):
    m = meter(HYBRID, {HYBRID: hybrid_rate})
    m.answered(rtt_s)
    assert choose("auto", m, wait_s=rtt_s + step_s) == want


def test_a_stream_never_tried_is_probed_when_predicted_within_reach_below_the_margin():
    """The prediction is a floor (a decode step costs at most a verify round): one predicted slower than the hybrid,
    but within PROBE_REACH of it, is measured once; one predicted further below is not (a loaded server)."""
    m = meter(HYBRID, {HYBRID: 100.0})
    m.answered(0.050)
    assert choose("auto", m, wait_s=wait_for(90.0, 0.050)) == STREAM  # 0.9x: the old rule (1.2x) never tried it
    assert choose("auto", m, wait_s=wait_for(100.0 * PROBE_REACH * 1.01, 0.050)) == STREAM
    assert choose("auto", m, wait_s=wait_for(100.0 * PROBE_REACH * 0.99, 0.050)) == HYBRID
    assert choose("auto", m, wait_s=wait_for(18.0, 0.050)) == HYBRID  # the loaded server's figures below
    assert choose("auto", meter(HYBRID, {HYBRID: 100.0}, intervals=1, tokens=1), wait_s=0.011) == HYBRID  # unjudged


def test_a_probe_measured_slower_goes_back_and_is_tried_again_only_at_the_recheck():
    v = Visits()
    v.visit(HYBRID, 100.0, 1 + SETTLE_ROUNDS + MIN_INTERVALS)  # the first emission starts the clock, then settling
    assert not v.m.trial and choose("auto", v.m, wait_s=wait_for(90.0)) == STREAM  # a probe
    v.visit(STREAM, 90.0, 1)
    assert v.m.trial
    for _ in range(TRIAL_INTERVALS - 1):
        v.visit(STREAM, 90.0, 1)
        assert choose("auto", v.m, wait_s=wait_for(90.0)) == STREAM  # not judged yet
    v.visit(STREAM, 90.0, 1)
    # Judged (a trial: after TRIAL_INTERVALS): 0.9x the hybrid. Within MARGIN, where the old rule stayed; a trial
    # measured slower goes back.
    assert choose("auto", v.m, wait_s=wait_for(90.0)) == HYBRID
    v.visit(HYBRID, 100.0, 1 + SETTLE_ROUNDS + 2 * MIN_INTERVALS)
    assert not v.m.trial
    for wait_s in (wait_for(90.0), wait_for(110.0), wait_for(1000.0)):  # no prediction counts once measured
        assert choose("auto", v.m, wait_s=wait_s) == HYBRID
    v.visit(HYBRID, 100.0, (FIRST_RECHECK - v.m.visit_tokens) // 4)
    assert choose("auto", v.m, wait_s=wait_for(90.0)) == STREAM  # the recheck
    v.visit(STREAM, 90.0, TRIAL_INTERVALS + 1)
    assert v.m.trial and v.m.recheck == 2 * FIRST_RECHECK
    assert choose("auto", v.m, wait_s=wait_for(90.0)) == HYBRID  # still slower: back, until the next check


def test_a_probe_measured_faster_is_kept_and_then_an_ordinary_visit():
    v = Visits()
    v.visit(HYBRID, 100.0, 1 + SETTLE_ROUNDS + MIN_INTERVALS)
    assert choose("auto", v.m, wait_s=wait_for(60.0)) == STREAM
    v.visit(STREAM, 105.0, 2, per=JUDGE_TOKENS)  # a lone stream's chunks: judged on the first interval
    assert v.m.trial and v.m.rates[STREAM].judged(trial=True)
    assert choose("auto", v.m, wait_s=wait_for(60.0)) == STREAM  # measured faster (by less than MARGIN): kept
    v.visit(STREAM, 90.0, 8, per=1)  # kept, it is left only for a hybrid MARGIN faster
    assert not v.m.trial and v.m.rates[STREAM].tokens_per_s < 100.0
    assert choose("auto", v.m, wait_s=wait_for(60.0)) == STREAM
    v.visit(STREAM, 70.0, 16, per=1)
    assert choose("auto", v.m, wait_s=wait_for(60.0)) == HYBRID


def test_the_servers_own_figure_predicts_a_stream_and_is_probed_only_within_the_margin():
    """Where the server says what a token of its streams takes, that is the prediction: a loaded server's stream at
    0.6x the hybrid is not probed (its floor would have been), one within the margin below it is."""
    floor = wait_for(60.0, 0.050)  # what the verdict wait alone says: a stream at 0.6x
    m = meter(HYBRID, {HYBRID: 100.0})
    m.answered(0.050)
    assert choose("auto", m, wait_s=floor) == STREAM
    m.answered(0.060, step_s=1 / 60.0)
    assert m.server_step_s == pytest.approx(1 / 60.0) and m.rtt_s == 0.050
    assert choose("auto", m, wait_s=floor) == HYBRID
    m.answered(0.050, step_s=(1 + MARGIN) / 100.0 * 0.99)  # within the margin below the hybrid
    assert choose("auto", m, wait_s=floor) == STREAM
    m.answered(0.050, step_s=1 / 700.0)  # an idle server on a CPU: a decode step a fraction of a verify round
    assert choose("auto", m, wait_s=wait_for(20.0, 0.050)) == STREAM
    m.answered(0.050)  # an answer without the figure keeps the last one said
    assert m.server_step_s == pytest.approx(1 / 700.0)


def test_the_prediction_is_a_token_a_server_step():
    assert predict_stream(0.060, 0.010) == pytest.approx(20.0)
    assert predict_stream(0.010, 0.0) == pytest.approx(100.0)  # no round trip measured: the whole wait a step
    assert predict_stream(0.010, 0.012) == pytest.approx(1 / MIN_STEP_S)  # a wait within noise of the round trip
    assert predict_stream(0.0, 0.010) == 0.0
    assert predict_stream(0.060, 0.010, step_s=0.004) == pytest.approx(250.0)  # the server's own figure first
    assert predict_stream(0.0, 0.0, step_s=0.004) == pytest.approx(250.0)


def test_a_mode_left_is_measured_again_after_recheck_tokens_and_the_next_check_doubles():
    remembered_slow = {HYBRID: 100.0, STREAM: 10.0}
    assert choose("auto", meter(HYBRID, remembered_slow, visit=FIRST_RECHECK - 1)) == HYBRID
    m = meter(HYBRID, remembered_slow, visit=FIRST_RECHECK)
    assert choose("auto", m) == STREAM
    m.enter(STREAM)
    assert m.recheck == 2 * FIRST_RECHECK
    m.enter(HYBRID)  # a short visit: the next check stays where it is
    assert m.recheck == 2 * FIRST_RECHECK


def test_rate_and_meter_average_and_count_as_documented():
    r = Rate()
    assert not r.measured and r.tokens_per_s == 0.0
    r.add(10, 0.1)
    r.add(10, 0.3)
    assert r.per_token_s == pytest.approx(0.01 + EWMA_WEIGHT * (0.03 - 0.01))
    r.restart()  # a new visit: the figure stays until its first interval replaces it
    assert r.measured and r.intervals == 0 and r.total == 2
    r.add(5, 0.5)
    assert r.per_token_s == pytest.approx(0.1) and r.intervals == 1
    r.add(0, 1.0)  # nothing written: nothing to learn
    assert r.intervals == 1

    m = ModeMeter()
    m.enter(STREAM)
    m.emitted(3, at=10.0)  # the visit's first emission starts its clock: the switch's time is no rate
    assert m.rates[STREAM].intervals == 0 and m.visit_tokens == 3
    m.emitted(4, at=10.5)
    assert m.rates[STREAM].per_token_s == pytest.approx(0.125) and m.visit_tokens == 7
    m.answered(0.2)
    m.answered(0.05)
    m.answered(0.3)
    assert m.rtt_s == 0.05
    m.bar_stream(100)
    m.bar_stream(40)
    assert m.stream_barred_until == 100


def test_stream_seeds_differ_by_position_and_from_the_drafters():
    seeds = {stream_seed(7, p) for p in range(50)}
    assert len(seeds) == 50 and draft_seed(7) not in seeds and all(0 <= s < 2**63 for s in seeds)


def test_mode_stream_is_refused_with_penalties_that_count_generated_tokens():
    ClientConfig(mode="stream", repetition_penalty=1.2).check()  # prompt and text alike: a restart changes nothing
    for penalty in ("presence_penalty", "frequency_penalty"):
        with pytest.raises(ValueError, match="mode stream"):
            ClientConfig(mode="stream", **{penalty: 0.5}).check()
    with pytest.raises(ValueError, match="mode must be one of"):
        ClientConfig(mode="fast").check()
