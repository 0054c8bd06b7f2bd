"""The engine's running counters (the server turns them into Prometheus metrics)."""

from __future__ import annotations

from dataclasses import dataclass, field

from herd.api.protocol import Medium
from herd.worker.block_manager import TierCounters

__all__ = ["EngineStats"]


@dataclass
class EngineStats:
    """Totals since start. ``prefix_cache_*`` count tokens, as vLLM's metrics of the same name do.

    ``spec_*`` count speculative decoding as vLLM's ``spec_decode`` metrics do: a draft is one
    sequence's proposal in one step; ``spec_accepted_per_pos[i]`` counts drafts whose token at
    position ``i`` was accepted."""

    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    num_steps: int = 0
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = field(default_factory=list)
    kv_tiers: TierCounters = field(default_factory=TierCounters)
    """Blocks stored into, restored from and evicted out of each tier (the block manager's own)."""
    kv_tier_blocks: dict[Medium, tuple[int, int]] = field(default_factory=dict)
    """Blocks used and held per tier below the device, as of the last step."""

    def count_draft(self, num_proposed: int, num_accepted: int) -> None:
        if not num_proposed:
            return
        self.spec_num_drafts += 1
        self.spec_num_draft_tokens += num_proposed
        self.spec_num_accepted_tokens += num_accepted
        for position in range(min(num_accepted, len(self.spec_accepted_per_pos))):
            self.spec_accepted_per_pos[position] += 1
