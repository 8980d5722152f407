"""The online mode's choice (tether.client.mode_choice), a pure function of measured figures, driven with numbers.

- forced modes are kept; nothing streams where streaming is not possible;
- auto begins with the hybrid (its session is open), judges a mode only after MIN_INTERVALS intervals of it (or
  JUDGE_TOKENS tokens over them), and leaves it only for one measured MARGIN faster;
- a stream never tried is probed when predicted within reach of the hybrid, though below it: its floor within
  PROBE_REACH, the server's own figure (ModelInfo.decode_step_s) within the margin; the probe, judged, is kept
  only if measured at least as fast as the hybrid, else the hybrid comes back at once and the stream is not tried
  again before the recheck; a probe kept is an ordinary visit after;
- the prediction is the server's figure where it said one, else a token a server step, the step what the verdict
  wait holds beyond the round trip: with the issue's H200 figures, streaming on an idle server over links of 0 to
  150 ms, drafting here on a loaded one;
- a mode left is measured again once the one now has written `recheck` tokens, which then doubles;
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
    STREAM,
    ModeMeter,
    Rate,
    choose_mode,
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
    v.visit(HYBRID, 100.0, MIN_INTERVALS + 1)  # the open's first emission starts the clock
    assert not v.m.trial and choose("auto", v.m, wait_s=wait_for(90.0)) == STREAM  # a probe
    v.visit(STREAM, 90.0, 1)
    assert v.m.trial
    for _ in range(MIN_INTERVALS - 1):
        v.visit(STREAM, 90.0, 1)
        assert choose("auto", v.m, wait_s=wait_for(90.0)) == STREAM  # not judged yet
    v.visit(STREAM, 90.0, 1)
    # Judged: 0.9x the hybrid. Within MARGIN, where the old rule stayed; a trial measured slower goes back.
    assert choose("auto", v.m, wait_s=wait_for(90.0)) == HYBRID
    v.visit(HYBRID, 100.0, 2 * MIN_INTERVALS)
    assert not v.m.trial
    for wait_s in (wait_for(90.0), wait_for(110.0), wait_for(1000.0)):  # no prediction counts once measured
        assert choose("auto", v.m, wait_s=wait_s) == HYBRID
    v.visit(HYBRID, 100.0, (FIRST_RECHECK - v.m.visit_tokens) // 4)
    assert choose("auto", v.m, wait_s=wait_for(90.0)) == STREAM  # the recheck
    v.visit(STREAM, 90.0, MIN_INTERVALS + 1)
    assert v.m.trial and v.m.recheck == 2 * FIRST_RECHECK
    assert choose("auto", v.m, wait_s=wait_for(90.0)) == HYBRID  # still slower: back, until the next check


def test_a_probe_measured_faster_is_kept_and_then_an_ordinary_visit():
    v = Visits()
    v.visit(HYBRID, 100.0, MIN_INTERVALS + 1)
    assert choose("auto", v.m, wait_s=wait_for(60.0)) == STREAM
    v.visit(STREAM, 105.0, 2, per=JUDGE_TOKENS)  # a lone stream's chunks: judged on the first interval
    assert v.m.trial and v.m.rates[STREAM].judged
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
