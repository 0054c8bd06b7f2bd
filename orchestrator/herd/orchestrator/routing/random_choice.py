"""Random: uniform over the healthy workers."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import ClassVar

from herd.orchestrator.routing._types import RequestContext, RoutingStrategy, WorkerView

__all__ = ["RandomChoice"]


class RandomChoice(RoutingStrategy):
    name: ClassVar[str] = "random"

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def select(self, workers: Sequence[WorkerView], ctx: RequestContext) -> WorkerView | None:
        return self._rng.choice(workers)
