"""Round robin: cycle over the healthy workers in a stable order (by id)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from herd.orchestrator.routing.base import RequestContext, RoutingStrategy, WorkerView

__all__ = ["RoundRobin"]


class RoundRobin(RoutingStrategy):
    """Picks the worker whose id follows the last one chosen, wrapping around.

    Remembering the last id rather than an index keeps the cycle fair when workers join or leave,
    and costs one O(n) pass per decision instead of a sort.
    """

    name: ClassVar[str] = "round_robin"

    def __init__(self) -> None:
        self._last_id = ""

    def select(self, workers: Sequence[WorkerView], ctx: RequestContext) -> WorkerView | None:
        following = [worker for worker in workers if worker.id > self._last_id]
        chosen = min(following or workers, key=_worker_id)
        self._last_id = chosen.id
        return chosen


def _worker_id(worker: WorkerView) -> str:
    return worker.id
