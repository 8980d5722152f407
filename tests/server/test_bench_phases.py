"""Smoke test of bench/phases.py: a tiny CPU run, checking the phases' call counts against the rounds served and that
the wrapping is undone (never the timings)."""

import pytest
from bench_modules import load_bench
from toy_models import toy_model_flags

from tether.server import rounds, stream_rounds


@pytest.fixture(scope="module")
def bench():
    return load_bench("phases")


def test_phases_count_every_step_and_round_and_unwrap(bench):
    real_verify, real_reply = rounds.verify_batch, stream_rounds.StreamRounds._verdict_reply
    record = bench.main(["--", "--device", "cpu", "--clients", "2", "--rounds", "3", "--warmup-rounds", "1",
                         "--k", "3", "--prompt-len", "16", "--client-procs", "1", "--timeout", "120",
                         *toy_model_flags()])  # fmt: skip
    assert record["bench"] == "phases" and record["server"]["rows"][0]["rounds"] == 2 * 3
    on_batcher = {r["phase"]: r for r in record["phases"] if r["thread"] == bench.BATCHER}
    steps = record["steps"]
    assert 1 <= steps <= 2 * (3 + 1) and on_batcher["verify_batch"]["calls"] == steps
    assert on_batcher["_finish"]["calls"] == steps and on_batcher["RoundBatcher._batch"]["calls"] == steps
    assert on_batcher["StreamRounds._verdict_reply"]["calls"] == 2 * (3 + 1)  # every round, warm-up included
    for r in on_batcher.values():
        assert r["calls"] > 0 and r["wall_s"] >= 0 and r["cpu_s"] >= 0 and r["wall_ms_per_step"] is not None
    opened = [r for r in record["phases"] if r["thread"].startswith("tether-model")]
    assert sum(r["calls"] for r in opened if r["phase"] == "SequenceVerifier.open") == 2  # each client's session
    assert sum(r["calls"] for r in opened if r["phase"] == "Engine.delta_parts") == 2
    assert rounds.verify_batch is real_verify and stream_rounds.StreamRounds._verdict_reply is real_reply
    assert record["hops"] == []  # in process: no front ends to time


def test_with_front_ends_every_verdict_is_timed_hop_by_hop_and_the_hops_add_up(bench):
    record = bench.main(["--", "--device", "cpu", "--clients", "2", "--rounds", "3", "--warmup-rounds", "1",
                         "--k", "3", "--prompt-len", "16", "--client-procs", "1", "--timeout", "120",
                         "--frontends", "1", *toy_model_flags()])  # fmt: skip
    hops = {r["hop"]: r for r in record["hops"]}
    names = ["arrival -> round starts", "round (claim, batcher)", "verdict -> reply queued", "in the engine"]
    assert list(hops) == names
    assert all(r["rounds"] == 2 * (3 + 1) for r in hops.values())  # every round's verdict, warm-up included
    assert record["taken_from_frames"] == 2 * (3 + 1)  # one round at a time: each started straight from its frame
    parts = sum(hops[h]["mean_ms"] for h in list(hops)[:3])
    assert parts == pytest.approx(hops["in the engine"]["mean_ms"]) and all(r["mean_ms"] >= 0 for r in hops.values())
    assert record["steps"] >= 1


def test_a_phase_that_moved_is_an_error(bench):
    with pytest.raises(AttributeError):
        bench.Phases().install([("tether.server.rounds", "no_such_phase")])


def test_one_client_count_and_an_in_process_server_only(bench):
    with pytest.raises(SystemExit, match="one --clients count"):
        bench.main(["--", "--device", "cpu", "--clients", "1", "2"])
