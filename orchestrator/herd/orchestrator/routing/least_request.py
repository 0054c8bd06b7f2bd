"""Least request: the worker with the fewest requests in flight from this orchestrator."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import ClassVar

from herd.orchestrator.routing._load import least_in_flight
from herd.orchestrator.routing._types import RequestContext, RoutingStrategy, WorkerView

__all__ = ["LeastRequest"]


class LeastRequest(RoutingStrategy):
    """Fewest in flight; ties broken at random so idle workers share a burst."""

    name: ClassVar[str] = "least_request"

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def select(self, workers: Sequence[WorkerView], ctx: RequestContext) -> WorkerView | None:
        return least_in_flight(workers, self._rng)
