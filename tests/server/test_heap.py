"""tether.server.heap: start-up's heap frozen out of the collector's walks, and every collection's pause timed."""

import gc

from prometheus_client import CollectorRegistry, Histogram

from tether.server.heap import YOUNG_THRESHOLD, GCPauses, release, settle


def test_settle_freezes_what_survives_and_collection_still_reclaims_cycles():
    class Node:
        pass

    kept = [Node() for _ in range(100)]
    before = gc.get_threshold()
    frozen = settle()
    try:
        assert frozen >= len(kept) and gc.get_freeze_count() == frozen
        assert gc.get_threshold() == (YOUNG_THRESHOLD, *before[1:])
        assert settle() >= frozen and gc.get_threshold() == (YOUNG_THRESHOLD, *before[1:])  # twice: same thresholds
        a, b = Node(), Node()  # a cycle made after start-up: still the collector's to reclaim
        a.other, b.other = b, a
        marker = id(a)
        del a, b
        gc.collect()
        assert marker not in {id(o) for o in gc.get_objects() if isinstance(o, Node)}
    finally:
        release()
    assert gc.get_freeze_count() == 0 and gc.get_threshold() == before


def test_pauses_are_timed_per_generation_until_removed():
    registry = CollectorRegistry()
    hist = Histogram("pause_seconds", "test", ["generation"], registry=registry)
    pauses = GCPauses(hist).install()
    try:
        assert pauses.install() is pauses and gc.callbacks.count(pauses) == 1  # installing twice hooks once
        gc.collect(0)
        gc.collect(2)
        snap = pauses.snapshot(reset_max=True)
        assert snap["count"] == 2 and snap["total_s"] >= snap["max_s"] > 0
        assert pauses.snapshot()["max_s"] == 0.0 and pauses.snapshot()["count"] == 2  # a new window's max
        counts = {s.labels["generation"]: s.value for s in registry.collect() for s in s.samples
                  if s.name == "pause_seconds_count"}  # fmt: skip
        assert counts == {"0": 1.0, "2": 1.0}
    finally:
        pauses.remove()
    gc.collect()
    assert pauses.count == 2 and pauses not in gc.callbacks


def test_a_hook_installed_mid_collection_ignores_the_stop_it_did_not_see_start():
    pauses = GCPauses()
    pauses("stop", {"generation": 2})
    assert pauses.snapshot() == {"count": 0, "total_s": 0.0, "max_s": 0.0}
