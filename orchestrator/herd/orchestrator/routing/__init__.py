"""Routing: one decision (``decide``), one small strategy interface (``RoutingStrategy.select``) and six
strategies, one per module."""

from herd.orchestrator.routing.base import (
    Phase,
    RequestContext,
    RoutingStrategy,
    WorkerView,
    build_strategy,
    healthy,
    restore_block_tokens,
)
from herd.orchestrator.routing.decision import (
    LORA_SPILL_IN_FLIGHT,
    Decision,
    Pin,
    UnroutableError,
    decide,
    decide_prefill,
    lora_candidates,
    pin_key,
)
from herd.orchestrator.routing.kv_cache_aware import KVCacheAware
from herd.orchestrator.routing.least_request import LeastRequest
from herd.orchestrator.routing.prefix_hash import PrefixHash
from herd.orchestrator.routing.random_choice import RandomChoice
from herd.orchestrator.routing.round_robin import RoundRobin
from herd.orchestrator.routing.sticky_session import StickySession

__all__ = [
    "LORA_SPILL_IN_FLIGHT",
    "Decision",
    "KVCacheAware",
    "LeastRequest",
    "Phase",
    "Pin",
    "PrefixHash",
    "RandomChoice",
    "RequestContext",
    "RoundRobin",
    "RoutingStrategy",
    "StickySession",
    "UnroutableError",
    "WorkerView",
    "build_strategy",
    "decide",
    "decide_prefill",
    "healthy",
    "lora_candidates",
    "pin_key",
    "restore_block_tokens",
]
