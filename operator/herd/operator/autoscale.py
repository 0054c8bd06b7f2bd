"""The pure autoscaling decision for one pool of a ModelDeployment, in the manner of the HPA.

A unified model scales ``workers``; a disaggregated one scales ``decode`` and ``prefill``
separately, each on its own pods' figures: prefill workers produce one token per request, so their
TTFT drives the prefill pool, while the decode pool sees the ITL of every stream.

Steps, each a rule from the Kubernetes Horizontal Pod Autoscaler:

1. Bounds first: a pool outside ``[minReplicas, maxReplicas]`` is moved inside, metrics or not.
2. From zero: with no replicas there are no latencies; requests waiting (at the workers, or held by
   the gateways for a model with no worker) bring up ``max(1, min)``.
   To zero (``minReplicas: 0`` only): a pool idle for ``scaleToZeroAfterSeconds`` (no request got a
   token, runs, waits or is held, and every Ready pod answered) goes to zero. Every other rule keeps
   at least one replica, so only idleness, never a dip in latency, empties a pool.
3. Ratio: ``max(observed p95 / target)`` over TTFT and ITL. Within the tolerance band (10 %) of
   1.0 the pool stays as it is; otherwise the recommendation is ``ceil(current * ratio)``, clamped
   to the bounds. A window in which no request finished and none waits is idle (ratio 0).
4. Up fast: at most double per step, and no further step while pods of the last one are not Ready
   yet (their latencies are not in the figures, so the ratio would ask for the same pods again).
5. Down slowly: only when every pod is Ready and every metric of every one is there, no request
   waits, the KV cache is below its high-water mark, and the pool has been quiet (no scale change)
   for the whole stabilization window; then to the highest recommendation seen over that window.

Cost: O(recommendations in the window). The caller keeps that history; this module does no I/O.
The trade-off is the HPA's: a spike scales up within one interval, a dip has to last a window.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from herd.api.crd import AutoscalingSpec, ModelDeploymentSpec, PoolName
from herd.operator.settings import AutoscalerSettings

__all__ = [
    "Decision",
    "Observation",
    "Recommendation",
    "ScaleState",
    "autoscaled_pools",
    "decide",
    "pool_bounds",
    "recommend",
]


@dataclass(frozen=True)
class Observation:
    """What the Ready pods of the pool reported over the last interval (sums and means over pods).

    A latency is None when no request reached that point in the interval. ``is_complete`` is False
    when a Ready pod did not answer, or answered without one of the metrics.
    """

    ttft_p95_ms: float | None
    itl_p95_ms: float | None
    num_waiting: float
    kv_usage: float
    is_complete: bool
    num_running: float = 0.0
    num_held: float = 0.0
    """Requests the gateways hold for the model while it has no ready worker (the serving pool only)."""

    @property
    def is_idle(self) -> bool:
        """No request got a token, runs, waits or is held, by a complete set of figures."""
        is_quiet = self.ttft_p95_ms is None and self.itl_p95_ms is None
        has_none = self.num_waiting == 0 and self.num_running == 0 and self.num_held == 0
        return self.is_complete and is_quiet and has_none


@dataclass(frozen=True)
class Recommendation:
    at: float
    replicas: int


@dataclass(frozen=True)
class ScaleState:
    """The pool as the scaler sees it; ``quiet_s``: seconds since the last scale change (or since
    the scaler started watching, whichever is shorter)."""

    current: int
    num_ready: int
    now: float
    quiet_s: float
    history: Sequence[Recommendation] = ()
    idle_s: float = 0.0
    """Seconds the pool has been idle (``Observation.is_idle`` every round) at its current size."""


@dataclass(frozen=True)
class Decision:
    """``desired`` replicas and why; ``recommendation`` is the unstabilized figure for the history."""

    desired: int
    reason: str
    recommendation: int


def autoscaled_pools(spec: ModelDeploymentSpec) -> tuple[PoolName, ...]:
    """The pools the autoscaler sizes: every pool the spec runs, the serving pool (behind
    ``spec.replicas``) first."""
    serving = spec.serving_pool
    return (serving, *(pool for pool in spec.pools() if pool != serving))


def pool_bounds(spec: AutoscalingSpec, pool: PoolName) -> AutoscalingSpec:
    """``spec`` with the bounds that apply to ``pool``.

    The prefill pool never goes below one replica: at zero, prompts prefill on the decode workers
    and no prefill pod would report the waiting requests that bring it back.
    """
    if pool != "prefill" or spec.min_replicas >= 1:
        return spec
    return spec.model_copy(update={"min_replicas": 1})


def decide(
    state: ScaleState, observed: Observation, spec: AutoscalingSpec, settings: AutoscalerSettings
) -> Decision:
    current = state.current
    if not spec.min_replicas <= current <= spec.max_replicas:
        bound = min(max(current, spec.min_replicas), spec.max_replicas)
        return Decision(bound, f"{current} is outside [{spec.min_replicas}, {spec.max_replicas}]", bound)
    if current == 0:
        return _from_zero(observed, spec)
    if spec.min_replicas == 0 and state.idle_s >= spec.scale_to_zero_after_seconds:
        why = f"idle for {state.idle_s:.0f} s (scaleToZeroAfterSeconds {spec.scale_to_zero_after_seconds})"
        return Decision(0, why, 0)
    spec = spec.model_copy(update={"min_replicas": max(1, spec.min_replicas)})  # zero is idleness's alone
    wanted, why = recommend(current, observed, spec, settings)
    if wanted > current:
        return _scale_up(state, wanted, why)
    if wanted < current:
        return _scale_down(state, observed, settings, wanted, why)
    return Decision(current, why, wanted)


def recommend(
    current: int, observed: Observation, spec: AutoscalingSpec, settings: AutoscalerSettings
) -> tuple[int, str]:
    """The HPA formula, clamped to the bounds, and the observed figures that gave it."""
    targets = spec.targets
    ratios = {
        name: value / target
        for name, value, target in (
            ("ttft", observed.ttft_p95_ms, targets.ttft_p95_ms),
            ("itl", observed.itl_p95_ms, targets.itl_p95_ms),
        )
        if value is not None
    }
    if not ratios:
        if observed.num_waiting > 0:
            return current, "requests wait but none got a token this interval"
        return spec.min_replicas, "idle: no requests"
    name = max(ratios, key=lambda key: ratios[key])
    ratio = ratios[name]
    why = f"{name} p95 at {ratio:.0%} of target"
    if abs(ratio - 1.0) <= settings.tolerance:
        return current, why + " (within tolerance)"
    wanted = math.ceil(current * ratio)
    return min(max(wanted, spec.min_replicas), spec.max_replicas), why


def _from_zero(observed: Observation, spec: AutoscalingSpec) -> Decision:
    num_waiting = observed.num_waiting + observed.num_held
    if num_waiting > 0:
        wanted = max(1, spec.min_replicas)
        return Decision(wanted, f"{num_waiting:g} requests wait at zero replicas", wanted)
    return Decision(0, "idle at zero replicas", 0)


def _scale_up(state: ScaleState, wanted: int, why: str) -> Decision:
    if state.num_ready < state.current:
        return Decision(state.current, f"{why}; waiting for the last scale-up to be Ready", wanted)
    step = min(wanted, 2 * state.current)
    return Decision(step, why, wanted)


def _scale_down(
    state: ScaleState, observed: Observation, settings: AutoscalerSettings, wanted: int, why: str
) -> Decision:
    hold = _scale_down_blocker(state, observed, settings)
    if hold:
        return Decision(state.current, f"{why}; no scale-down: {hold}", wanted)
    since = state.now - settings.stabilization_s
    seen = [r.replicas for r in state.history if r.at >= since]
    stable = min(max([wanted, *seen]), state.current)
    if stable == state.current:
        return Decision(state.current, f"{why}; held by a higher recommendation within the window", wanted)
    return Decision(stable, why, wanted)


def _scale_down_blocker(state: ScaleState, observed: Observation, settings: AutoscalerSettings) -> str:
    if not observed.is_complete:
        return "metrics missing"
    if state.num_ready < state.current:  # still starting: their load is not in the figures yet
        return f"{state.current - state.num_ready} pods not Ready"
    if observed.num_waiting > 0:
        return f"{observed.num_waiting:g} requests waiting"
    if observed.kv_usage >= settings.kv_high_water:
        return f"KV cache {observed.kv_usage:.0%} full"
    if state.quiet_s < settings.stabilization_s:
        return f"last change {state.quiet_s:.0f} s ago, window {settings.stabilization_s:g} s"
    return ""
