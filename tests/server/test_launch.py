"""serve's launch plan (tether.server.launch): which flag combinations run, and what the listening line says."""

import pytest

from tether.server.launch import LaunchPlan
from tether.server.serve_config import ServeConfig


def test_the_plan_of_the_default_flags_is_one_process():
    plan = LaunchPlan.of(ServeConfig())
    assert plan == LaunchPlan(tp=1, engines=1, frontends=0) and plan.notes() == []


def test_the_plan_names_every_process_it_adds():
    plan = LaunchPlan.of(ServeConfig(engines=3, frontends=2))
    assert plan.notes() == ["2 front-end processes", "3 engine processes"]
    assert LaunchPlan.of(ServeConfig(tp=2)).notes() == ["tensor-parallel over 2 ranks"]


@pytest.mark.parametrize(
    ("flags", "match"),
    [
        ({"tp": 0}, "--tp must be at least 1"),
        ({"frontends": -1}, "--frontends is 0"),
        ({"engines": 0}, "--engines is 1 to"),
        ({"engines": 2}, "needs --frontends N >= 1"),  # nothing would route the calls
        ({"engines": 2, "frontends": 1, "tp": 2}, "--tp 1"),
        ({"engines": 4, "frontends": 1, "kv_pool_mb": 3}, "at least E MB"),
    ],
)
def test_combinations_that_cannot_run_are_refused_before_anything_starts(flags, match):
    with pytest.raises(ValueError, match=match):
        LaunchPlan.of(ServeConfig(**flags))


def test_engines_with_the_auto_pool_split_it_among_themselves():
    assert LaunchPlan.of(ServeConfig(engines=2, frontends=1, kv_pool_mb=0)).engines == 2
