"""The engine's running counters (the server turns them into Prometheus metrics)."""

from __future__ import annotations

from dataclasses import dataclass, field

from herd.api.protocol import Medium
from herd.worker.block_manager import TierCounters

__all__ = ["EngineStats"]


@dataclass
class EngineStats:
    """Totals since start. ``prefix_cache_*`` count tokens, as vLLM's metrics of the same name do."""

    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    num_steps: int = 0
    kv_tiers: TierCounters = field(default_factory=TierCounters)
    """Blocks stored into, restored from and evicted out of each tier (the block manager's own)."""
    kv_tier_blocks: dict[Medium, tuple[int, int]] = field(default_factory=dict)
    """Blocks used and held per tier below the device, as of the last step."""
