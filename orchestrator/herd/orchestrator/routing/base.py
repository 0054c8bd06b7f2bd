"""The routing package's public interface: the strategy types, and ``build_strategy``.

Strategies implement ``RoutingStrategy`` (defined with the request and worker types in ``_types``,
the package's bottom layer, so that no strategy imports this module or the factory); the model's
``spec.routing`` picks one, built fresh per model by ``build_strategy``.
"""

from __future__ import annotations

from herd.orchestrator.routing._factory import build_strategy
from herd.orchestrator.routing._types import (
    Phase,
    RequestContext,
    RoutingStrategy,
    WorkerView,
    healthy,
    restore_block_tokens,
)

__all__ = [
    "Phase",
    "RequestContext",
    "RoutingStrategy",
    "WorkerView",
    "build_strategy",
    "healthy",
    "restore_block_tokens",
]
