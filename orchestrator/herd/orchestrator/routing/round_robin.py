"""Round robin: cycle over the healthy workers in a stable order (by id)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from herd.orchestrator.routing._types import RequestContext, RoutingStrategy, WorkerView

__all__ = ["RoundRobin"]


class RoundRobin(RoutingStrategy):
    """Picks the worker whose id follows the last one chosen, wrapping around.

    Remembering the last id rather than an index keeps the cycle fair when workers join or leave,
    and costs a few O(n) passes per decision instead of a sort.
    """

    name: ClassVar[str] = "round_robin"

    def __init__(self) -> None:
        self._last_id = ""

    def select(self, workers: Sequence[WorkerView], ctx: RequestContext) -> WorkerView | None:
        ids = [worker.id for worker in workers]
        self._last_id = min([i for i in ids if i > self._last_id], default=None) or min(ids)
        return workers[ids.index(self._last_id)]
