"""The engine's running counters (the server turns them into Prometheus metrics)."""

from __future__ import annotations

from dataclasses import dataclass

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
