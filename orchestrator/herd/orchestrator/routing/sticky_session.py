"""Sticky sessions: a session stays on its pinned worker while that worker is healthy.

The gateway looks the pin up (memory or Redis) before routing and stores the chosen worker after
(``pins_sessions``). Without a session key, or when the pinned worker is gone or ejected, the
request goes round robin and the gateway re-pins the session to the new choice.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from herd.orchestrator.routing._types import RequestContext, RoutingStrategy, WorkerView
from herd.orchestrator.routing.round_robin import RoundRobin

__all__ = ["StickySession"]


class StickySession(RoutingStrategy):
    name: ClassVar[str] = "sticky_session"
    pins_sessions: ClassVar[bool] = True

    def __init__(self, session_header: str, session_ttl_seconds: int) -> None:
        self.session_header = session_header
        """The header whose value is the session key (the gateway reads it into the context)."""
        self.session_ttl_seconds = session_ttl_seconds
        """How long the gateway keeps an idle session's pin."""
        self._fallback = RoundRobin()

    def select(self, workers: Sequence[WorkerView], ctx: RequestContext) -> WorkerView | None:
        if ctx.session_key is not None and ctx.pinned_worker_id is not None:
            for worker in workers:
                if worker.id == ctx.pinned_worker_id:
                    return worker
        return self._fallback.select(workers, ctx)
