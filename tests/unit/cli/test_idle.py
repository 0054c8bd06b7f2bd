"""herd up's scale to zero: the pure decision and the idle clock, table-driven."""

from __future__ import annotations

import pytest

from herd.api.demand import ModelDemand
from herd.cli.idle import Action, IdleClock, next_action


@pytest.mark.parametrize(
    ("is_running", "demand", "idle_s", "action"),
    [
        (True, ModelDemand(), 10.0, "stop"),
        (True, ModelDemand(), 9.9, None),
        (True, ModelDemand(num_in_flight=1), 60.0, None),
        (False, ModelDemand(num_held=1, num_in_flight=1), 0.0, "start"),
        (False, ModelDemand(), 60.0, None),
        (True, ModelDemand(num_held=2, num_in_flight=2), 0.0, None),
    ],
    ids=[
        "idle-long-enough",
        "idle-not-yet",
        "in-flight",
        "held-at-zero",
        "quiet-at-zero",
        "held-while-running",
    ],
)
def test_next_action(is_running: bool, demand: ModelDemand, idle_s: float, action: Action | None) -> None:
    assert next_action(is_running=is_running, demand=demand, idle_s=idle_s, after_s=10.0) == action


def test_the_idle_clock_restarts_on_any_use_seen_between_reads() -> None:
    clock = IdleClock(last_active=0.0)
    assert clock.idle_seconds(ModelDemand(), now=5.0) == 5.0
    assert clock.idle_seconds(ModelDemand(num_in_flight=1, num_answered=0), now=6.0) == 0.0
    assert clock.idle_seconds(ModelDemand(num_answered=0), now=8.0) == 2.0
    # a request that came and went between two reads moved the answered count
    assert clock.idle_seconds(ModelDemand(num_answered=1), now=9.0) == 0.0
    assert clock.idle_seconds(ModelDemand(num_answered=1), now=12.0) == 3.0


def test_demands_of_several_orchestrators_add_up() -> None:
    total = ModelDemand(1, 2, 3) + ModelDemand(4, 5, 6)
    assert total == ModelDemand(num_held=5, num_in_flight=7, num_answered=9)
