"""The per-round Prometheus series, summed as plain numbers and turned into metric families only when scraped.

Why: a round is counted five times (rounds, drafted and accepted tokens, tau, its latency), on the engine's event
loop, thousands of times a second. prometheus_client's Counter.inc and Histogram.observe take a lock and a few
attribute lookups each, and Histogram.time() builds a context manager: about 20 us a round on the CPU VM, a third
of the event loop's share of a round. Here a round is one call that adds to a few ints under one lock.

Contract: `RoundTally()` is a prometheus_client collector; register it in a registry and call `round(drafted,
accepted, seconds)` once per round answered. Scrapes see the same series the Counter / Histogram objects exposed:
`tether_rounds_total`, `tether_drafted_tokens_total`, `tether_accepted_tokens_total`, the histograms `tether_tau`
(tokens gained per round: accepted + 1) and `tether_verify_seconds` (request to verdict), with the buckets of
TAU_BUCKETS and VERIFY_BUCKETS. Thread-safe.

    tally = RoundTally(); registry.register(tally)
    tally.round(drafted=5, accepted=3, seconds=0.004)
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Iterator, Sequence

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric

TAU_BUCKETS = (1, 2, 3, 4, 5, 6, 8, 10, 14, 20, 33, 65)
VERIFY_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2)


class _Buckets:
    """One histogram's counts: counts[i] observations in (bounds[i-1], bounds[i]], the last past every bound."""

    def __init__(self, bounds: Sequence[float]):
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0

    def add(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1  # a value on a bound counts in its bucket (le)
        self.sum += value

    def family(self, name: str, documentation: str) -> HistogramMetricFamily:
        cumulative, total = [], 0
        for bound, n in zip((*map(str, map(float, self.bounds)), "+Inf"), self.counts, strict=True):
            total += n
            cumulative.append((bound, total))
        return HistogramMetricFamily(name, documentation, buckets=cumulative, sum_value=self.sum)


class RoundTally:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.rounds = 0  # rounds answered
        self.drafted = 0  # draft tokens received in them
        self.accepted = 0  # draft tokens the target accepted
        self._tau = _Buckets(TAU_BUCKETS)
        self._verify = _Buckets(VERIFY_BUCKETS)

    def round(self, drafted: int, accepted: int, seconds: float) -> None:
        with self._lock:
            self.rounds += 1
            self.drafted += drafted
            self.accepted += accepted
            self._tau.add(accepted + 1)
            self._verify.add(seconds)

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            counts = self.rounds, self.drafted, self.accepted
            tau = self._tau.family("tether_tau", "tokens gained per round (accepted + 1)")
            verify = self._verify.family("tether_verify_seconds", "round latency: batching wait + forward + verdict")
        for (name, documentation), value in zip(
            (
                ("tether_rounds", "verification rounds answered"),
                ("tether_drafted_tokens", "draft tokens received"),
                ("tether_accepted_tokens", "draft tokens the target accepted"),
            ),
            counts,
            strict=True,
        ):
            yield CounterMetricFamily(name, documentation, value=value)
        yield tau
        yield verify
