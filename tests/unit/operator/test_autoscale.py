"""The pure autoscaling decision: HPA rules, table-driven."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from herd.api.crd import AutoscalingSpec, ModelDeploymentSpec, PoolName
from herd.operator.autoscale import (
    Observation,
    Recommendation,
    ScaleState,
    autoscaled_pools,
    decide,
    pool_bounds,
)
from herd.operator.autoscaler import merge_patch_between
from herd.operator.settings import AutoscalerSettings

SETTINGS = AutoscalerSettings(stabilization_s=300.0, tolerance=0.1, kv_high_water=0.9)
SPEC = AutoscalingSpec.model_validate(
    {"enabled": True, "minReplicas": 1, "maxReplicas": 8, "targets": {"ttftP95Ms": 1000, "itlP95Ms": 100}}
)
FROM_ZERO = SPEC.model_copy(update={"min_replicas": 0})
NOW = 10_000.0
ON_TARGET = Observation(ttft_p95_ms=1000.0, itl_p95_ms=100.0, num_waiting=0, kv_usage=0.3, is_complete=True)
IDLE = Observation(ttft_p95_ms=None, itl_p95_ms=None, num_waiting=0, kv_usage=0.0, is_complete=True)
QUIET = ScaleState(current=4, num_ready=4, now=NOW, quiet_s=600.0)


def slow(ttft: float, **changes: object) -> Observation:
    """Both latencies at the same fraction of their targets, TTFT given in ms."""
    return replace(ON_TARGET, ttft_p95_ms=ttft, itl_p95_ms=ttft / 10, **changes)  # type: ignore[arg-type]


CASES = [
    ("on-target", QUIET, ON_TARGET, SPEC, 4),
    ("within-tolerance-up", QUIET, slow(1090.0), SPEC, 4),
    ("within-tolerance-down", QUIET, slow(910.0), SPEC, 4),
    ("ttft-1.5x-scales-up", QUIET, slow(1500.0), SPEC, 6),
    ("itl-drives-when-worse", QUIET, replace(ON_TARGET, itl_p95_ms=175.0), SPEC, 7),
    ("up-at-most-double", replace(QUIET, current=2, num_ready=2), slow(5000.0), SPEC, 4),
    ("up-capped-at-max", QUIET, slow(3000.0), SPEC, 8),
    ("no-second-step-before-ready", replace(QUIET, num_ready=2), slow(1500.0), SPEC, 4),
    ("up-even-with-metrics-missing", QUIET, slow(1500.0, is_complete=False), SPEC, 6),
    ("down-after-window", QUIET, slow(500.0), SPEC, 2),
    ("down-floored-at-min", QUIET, slow(100.0), SPEC, 1),
    ("idle-goes-to-min", QUIET, IDLE, SPEC, 1),
    ("no-down-inside-window", replace(QUIET, quiet_s=200.0), slow(500.0), SPEC, 4),
    (
        "down-to-window-max-recommendation",
        replace(QUIET, history=(Recommendation(NOW - 100.0, 3), Recommendation(NOW - 400.0, 4))),
        slow(500.0),
        SPEC,
        3,
    ),
    (
        "window-max-above-current-holds",
        replace(QUIET, history=(Recommendation(NOW - 60.0, 6),)),
        slow(500.0),
        SPEC,
        4,
    ),
    ("no-down-with-metrics-missing", QUIET, slow(500.0, is_complete=False), SPEC, 4),
    ("no-down-while-pods-start", replace(QUIET, num_ready=3), IDLE, SPEC, 4),
    ("no-down-while-requests-wait", QUIET, slow(500.0, num_waiting=3), SPEC, 4),
    ("no-down-with-kv-full", QUIET, slow(500.0, kv_usage=0.95), SPEC, 4),
    (
        "waiting-without-latencies-holds",
        QUIET,
        replace(IDLE, num_waiting=5),
        SPEC,
        4,
    ),
    ("below-min-raised", replace(QUIET, current=0, num_ready=0), ON_TARGET, SPEC, 1),
    ("above-max-lowered", replace(QUIET, current=12, num_ready=12), slow(5000.0), SPEC, 8),
    ("above-max-lowered-without-metrics", replace(QUIET, current=9), slow(0.0, is_complete=False), SPEC, 8),
    (
        "from-zero-when-requests-wait",
        replace(QUIET, current=0, num_ready=0),
        replace(IDLE, num_waiting=2, is_complete=False),
        FROM_ZERO,
        1,
    ),
    (
        "stays-zero-when-idle",
        replace(QUIET, current=0, num_ready=0),
        replace(IDLE, is_complete=False),
        FROM_ZERO,
        0,
    ),
    ("idle-to-zero-after-its-time", replace(QUIET, idle_s=300.0), IDLE, FROM_ZERO, 0),
    ("idle-short-of-its-time-floors-at-one", replace(QUIET, idle_s=299.0), IDLE, FROM_ZERO, 1),
    ("a-dip-never-reaches-zero", QUIET, slow(100.0), FROM_ZERO, 1),
    (
        "zero-after-a-shorter-idle-time",
        replace(QUIET, current=1, num_ready=1, quiet_s=40.0, idle_s=30.0),
        IDLE,
        FROM_ZERO.model_copy(update={"scale_to_zero_after_seconds": 30}),
        0,
    ),
    (
        "from-zero-when-the-gateways-hold-requests",
        replace(QUIET, current=0, num_ready=0),
        replace(IDLE, num_held=1, is_complete=False),
        FROM_ZERO,
        1,
    ),
]


@pytest.mark.parametrize(
    ("observed", "is_idle"),
    [
        (IDLE, True),
        (replace(IDLE, is_complete=False), False),
        (replace(IDLE, num_running=1), False),
        (replace(IDLE, num_waiting=1), False),
        (replace(IDLE, num_held=1), False),
        (replace(IDLE, itl_p95_ms=20.0), False),
        (ON_TARGET, False),
    ],
    ids=["idle", "incomplete", "running", "waiting", "held", "tokens", "serving"],
)
def test_idle_means_nothing_at_all_happened(observed: Observation, is_idle: bool) -> None:
    assert observed.is_idle is is_idle


@pytest.mark.parametrize(
    ("state", "observed", "spec", "desired"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_decide(state: ScaleState, observed: Observation, spec: AutoscalingSpec, desired: int) -> None:
    decision = decide(state, observed, spec, SETTINGS)
    assert decision.desired == desired, decision.reason
    assert spec.min_replicas <= decision.desired <= spec.max_replicas
    assert decision.reason


def test_a_held_scale_down_still_records_the_lower_recommendation() -> None:
    decision = decide(replace(QUIET, quiet_s=10.0), slow(500.0), SPEC, SETTINGS)
    assert (decision.desired, decision.recommendation) == (4, 2)
    assert "window" in decision.reason


def test_the_reason_names_the_metric_that_drove_it() -> None:
    decision = decide(QUIET, replace(ON_TARGET, itl_p95_ms=300.0), SPEC, SETTINGS)
    assert decision.reason.startswith("itl p95 at 300% of target")


UNIFIED = {"model": {"source": "pvc://weights/chat"}}
DISAGGREGATED = {**UNIFIED, "serving": {"mode": "disaggregated"}, "prefill": {}, "decode": {}}


@pytest.mark.parametrize(
    ("spec", "scalable", "pools"),
    [(UNIFIED, "workers", ("workers",)), (DISAGGREGATED, "decode", ("decode", "prefill"))],
    ids=["unified", "disaggregated"],
)
def test_which_pools_scale(spec: dict[str, Any], scalable: PoolName, pools: tuple[PoolName, ...]) -> None:
    parsed = ModelDeploymentSpec.model_validate(spec)
    assert parsed.serving_pool == scalable
    assert autoscaled_pools(parsed) == pools


@pytest.mark.parametrize(
    ("pool", "min_replicas", "bounds"),
    [
        ("workers", 0, (0, 8)),
        ("decode", 0, (0, 8)),
        ("prefill", 0, (1, 8)),  # at zero nothing would bring it back
        ("prefill", 2, (2, 8)),
    ],
    ids=["workers-to-zero", "decode-to-zero", "prefill-floored-at-one", "prefill-keeps-a-higher-min"],
)
def test_pool_bounds(pool: PoolName, min_replicas: int, bounds: tuple[int, int]) -> None:
    spec = pool_bounds(SPEC.model_copy(update={"min_replicas": min_replicas}), pool)
    assert (spec.min_replicas, spec.max_replicas) == bounds


def test_an_idle_prefill_pool_stops_at_one_replica() -> None:
    decision = decide(QUIET, IDLE, pool_bounds(FROM_ZERO, "prefill"), SETTINGS)
    assert decision.desired == 1


def test_a_prefill_pool_scales_on_ttft_alone() -> None:
    """Prefill workers make one token per request: no ITL, and TTFT decides."""
    observed = replace(ON_TARGET, ttft_p95_ms=2000.0, itl_p95_ms=None)
    decision = decide(QUIET, observed, pool_bounds(SPEC, "prefill"), SETTINGS)
    assert decision.desired == 8 and decision.reason.startswith("ttft p95 at 200%")


@pytest.mark.parametrize(
    ("old", "new", "patch"),
    [
        ({}, {"a": 1}, {"a": 1}),
        ({"a": 1}, {"a": 1}, {}),
        ({"a": 1, "b": 2}, {"a": 1}, {"b": None}),
        ({"o": {"x": 1, "y": 2}}, {"o": {"x": 1}}, {"o": {"y": None}}),
        ({"o": {"x": 1}}, {"o": {"x": 3}}, {"o": {"x": 3}}),
        ({"prefill": {"reason": "r"}, "reason": "r"}, {"reason": "r"}, {"prefill": None}),
    ],
    ids=["added", "unchanged", "removed", "nested-removed", "nested-changed", "pool-no-longer-scaled"],
)
def test_merge_patch_between(old: dict[str, Any], new: dict[str, Any], patch: dict[str, Any]) -> None:
    assert merge_patch_between(old, new) == patch
