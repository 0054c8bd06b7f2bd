"""Builders of synthetic worker views and requests for routing tests and benchmarks."""

from __future__ import annotations

import random

from herd.api.kv_hash import block_hashes
from herd.orchestrator.routing import RequestContext, WorkerView

__all__ = ["context", "prompt_hashes", "views"]


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
