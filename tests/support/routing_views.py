"""Builders of synthetic worker views and requests for routing tests and benchmarks."""

from __future__ import annotations

import random
from typing import Any

from herd.api.kv_hash import block_hashes
from herd.orchestrator.kv_index import KVIndex
from herd.orchestrator.routing import KVCacheAware, RequestContext, WorkerView

__all__ = ["context", "kv_cache_aware", "prompt_hashes", "views"]


def kv_cache_aware(index: KVIndex, *, seed: int, **settings: Any) -> KVCacheAware:
    """kv_cache_aware over ``index`` with blocks of 16 tokens, its defaults (load factor 1.25, cache and
    load weights 1.0) unless ``settings`` name others, ties broken by ``random.Random(seed)``."""
    defaults: dict[str, Any] = {"load_factor": 1.25, "cache_weight": 1.0, "load_weight": 1.0}
    return KVCacheAware(kv_index=index, block_size=16, rng=random.Random(seed), **(defaults | settings))


def views(*ids: str, **in_flight: int) -> list[WorkerView]:
    """Workers named ``ids`` (URLs made up), with ``in_flight`` counts by id."""
    return [WorkerView(id=i, url=f"http://{i}:8000", num_in_flight=in_flight.get(i, 0)) for i in ids]


def prompt_hashes(seed: int, num_tokens: int = 512, *, block_size: int = 16, shared: int = 0) -> list[int]:
    """Block hashes of a random prompt; the first ``shared`` tokens depend only on ``seed // 1000``."""
    prefix = random.Random(seed // 1000).choices(range(32000), k=shared)
    tail = random.Random(seed).choices(range(32000), k=num_tokens - shared)
    return block_hashes(prefix + tail, block_size, model_id="m")


def context(hashes: list[int] | None = None, **fields: object) -> RequestContext:
    """A request whose prompt is 16 tokens per block of ``hashes``."""
    hashes = hashes or []
    return RequestContext(model="m", token_ids=range(16 * len(hashes)), block_hashes=hashes, **fields)  # type: ignore[arg-type]
