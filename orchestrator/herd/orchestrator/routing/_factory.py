"""``build_strategy``: one exhaustive ``match`` over the routing spec's union."""

from __future__ import annotations

import random
from typing import assert_never

from herd.api.crd import (
    KVCacheAwareRouting,
    LeastRequestRouting,
    PrefixHashRouting,
    RandomRouting,
    RoundRobinRouting,
    RoutingSpec,
    StickySessionRouting,
)
from herd.orchestrator.kv_index import KVIndex
from herd.orchestrator.routing._types import RoutingStrategy
from herd.orchestrator.routing.kv_cache_aware import KVCacheAware
from herd.orchestrator.routing.least_request import LeastRequest
from herd.orchestrator.routing.prefix_hash import PrefixHash
from herd.orchestrator.routing.random_choice import RandomChoice
from herd.orchestrator.routing.round_robin import RoundRobin
from herd.orchestrator.routing.sticky_session import StickySession

__all__ = ["build_strategy"]


def build_strategy(
    spec: RoutingSpec, *, kv_index: KVIndex, block_size: int, rng: random.Random | None = None
) -> RoutingStrategy:
    """A fresh strategy for one model, from its ``spec.routing`` and the block size its workers hash."""
    rng = rng or random.Random()
    match spec:
        case RoundRobinRouting():
            return RoundRobin()
        case LeastRequestRouting():
            return LeastRequest(rng)
        case RandomRouting():
            return RandomChoice(rng)
        case PrefixHashRouting(load_factor=load_factor, prefix_blocks=prefix_blocks):
            return PrefixHash(load_factor=load_factor, prefix_blocks=prefix_blocks, rng=rng)
        case StickySessionRouting(session_header=header, session_ttl_seconds=ttl):
            return StickySession(session_header=header, session_ttl_seconds=ttl)
        case KVCacheAwareRouting():
            return KVCacheAware(
                kv_index=kv_index,
                load_factor=spec.load_factor,
                cache_weight=spec.cache_weight,
                load_weight=spec.load_weight,
                block_size=block_size,
                rng=rng,
                tier_cost=spec.tier_cost,
                tier_weights=spec.tier_weights,
            )
        case _:
            assert_never(spec)
