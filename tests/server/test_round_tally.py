"""RoundTally exposes what prometheus_client's own Counter and Histogram would, fed the same rounds."""

from prometheus_client import CollectorRegistry, Counter, Histogram

from tether.server.round_tally import TAU_BUCKETS, VERIFY_BUCKETS, RoundTally

ROUNDS = [(5, 3, 0.004), (5, 0, 0.001), (8, 8, 0.002), (1, 1, 2.5), (64, 64, 0.0), (3, 2, 0.05), (20, 19, 0.0105)]


def samples(registry: CollectorRegistry) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for m in registry.collect() for s in m.samples}


def test_the_tally_scrapes_as_counters_and_histograms_would():
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    tally = RoundTally()
    ours.register(tally)
    rounds = Counter("tether_rounds", "r", registry=theirs)
    drafted = Counter("tether_drafted_tokens", "d", registry=theirs)
    accepted = Counter("tether_accepted_tokens", "a", registry=theirs)
    tau = Histogram("tether_tau", "t", buckets=TAU_BUCKETS, registry=theirs)
    verify = Histogram("tether_verify_seconds", "v", buckets=VERIFY_BUCKETS, registry=theirs)
    for d, a, s in ROUNDS:  # values on a bucket's bound included (tau 1, 2, 4, 9, 20, 65; 0.001, 0.002 s)
        tally.round(d, a, s)
        rounds.inc()
        drafted.inc(d)
        accepted.inc(a)
        tau.observe(a + 1)
        verify.observe(s)
    want = {k: v for k, v in samples(theirs).items() if not k[0].endswith("_created")}
    got = samples(ours)
    assert got == want
    assert got[("tether_tau_bucket", (("le", "4.0"),))] == 4  # taus 4, 1, 2, 3: a bound counts in its own bucket
    assert got[("tether_rounds_total", ())] == len(ROUNDS)
