"""``herd up``'s scale to zero: a model whose ``autoscaling`` scales to zero (``enabled``,
``minReplicas: 0``) stops its worker processes once idle, and starts them again on demand.

herd up reads the demand signal the operator reads on Kubernetes (``herd.api.demand``): every
``interval_s`` it scrapes its orchestrator's ``/metrics``. A model with no request in flight and no
new answer for ``scaleToZeroAfterSeconds`` has its workers parked (SIGTERM, no restart); a request for
it is then held by the orchestrator, and the held count starts them again on the same ports, where
the orchestrator finds them ready and serves what it held. ``next_action`` is the whole decision.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import httpx

from herd.api.demand import ModelDemand, parse_demand
from herd.cli.supervise import Child, Supervisor

__all__ = ["IdleClock", "IdleScaler", "LocalPool", "next_action"]

log = logging.getLogger("herd.up")

Action = Literal["start", "stop"]


def next_action(*, is_running: bool, demand: ModelDemand, idle_s: float, after_s: float) -> Action | None:
    """Stop a running pool idle for ``after_s`` with nothing in flight; start a stopped one that has
    requests held for it; else nothing."""
    if is_running:
        return "stop" if idle_s >= after_s and demand.num_in_flight == 0 else None
    return "start" if demand.num_held > 0 else None


@dataclass
class IdleClock:
    """When a model was last used, from successive demands: a request in flight, or an answered count
    that moved (a request that came and went between two reads)."""

    last_active: float
    num_answered: float = 0.0

    def idle_seconds(self, demand: ModelDemand, now: float) -> float:
        if demand.num_in_flight > 0 or demand.num_answered != self.num_answered:
            self.last_active = now
        self.num_answered = demand.num_answered
        return now - self.last_active


@dataclass(eq=False)
class LocalPool:
    """One scale-to-zero model's processes (its workers, and a vLLM worker's server) under herd up."""

    model: str
    children: Sequence[Child]
    after_s: float
    clock: IdleClock = field(default_factory=lambda: IdleClock(time.monotonic()))

    @property
    def is_running(self) -> bool:
        return not any(child.is_parked for child in self.children)


class IdleScaler:
    """Parks and restarts the pools' processes from the orchestrator's demand, every ``interval_s``."""

    def __init__(
        self, supervisor: Supervisor, pools: Sequence[LocalPool], metrics_url: str, interval_s: float = 0.5
    ) -> None:
        self.supervisor = supervisor
        self.pools = list(pools)
        self.metrics_url = metrics_url
        self.interval_s = interval_s
        self._next_at = 0.0

    def step(self) -> None:
        """One read and decision, when due; an orchestrator that does not answer changes nothing."""
        now = time.monotonic()
        if now < self._next_at:
            return
        self._next_at = now + self.interval_s
        try:
            response = httpx.get(self.metrics_url, timeout=1.0)
            response.raise_for_status()
            demands = parse_demand(response.text)
        except (httpx.HTTPError, ValueError):
            return
        for pool in self.pools:
            self._decide(pool, demands.get(pool.model, ModelDemand()), now)

    def _decide(self, pool: LocalPool, demand: ModelDemand, now: float) -> None:
        idle_s = pool.clock.idle_seconds(demand, now)
        action = next_action(is_running=pool.is_running, demand=demand, idle_s=idle_s, after_s=pool.after_s)
        if action == "stop":
            log.info(
                "model idle: stopping its workers", extra={"model": pool.model, "idle_s": round(idle_s, 1)}
            )
            for child in pool.children:
                self.supervisor.park(child)
        elif action == "start":
            log.info(
                "requests held: starting the model's workers",
                extra={"model": pool.model, "num_held": demand.num_held},
            )
            for child in pool.children:
                self.supervisor.unpark(child)
            pool.clock.last_active = now
