"""kv_cache_aware: the longest cached run wins unless its worker is overloaded."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from support.routing_views import context, prompt_hashes, views

from herd.api.protocol import KVSnapshot
from herd.orchestrator.kv_index import KVIndex
from herd.orchestrator.routing import KVCacheAware, WorkerView

PROMPT = prompt_hashes(42, 512)
"""32 blocks: "a" caches the first 8, "b" the first 16, "c" none."""


def _strategy(*, cache_weight: float = 1.0, load_weight: float = 1.0) -> KVCacheAware:
    index = KVIndex()
    index.reset("a", KVSnapshot(epoch="e", seq=0, block_size=16, block_hashes=PROMPT[:8]))
    index.reset("b", KVSnapshot(epoch="e", seq=0, block_size=16, block_hashes=[*PROMPT[:16], 7]))
    return KVCacheAware(
        kv_index=index,
        load_factor=1.25,
        cache_weight=cache_weight,
        load_weight=load_weight,
        rng=random.Random(2),
    )


def _workers(**loads: dict[str, float]) -> list[WorkerView]:
    workers = views("a", "b", "c")
    for worker in workers:
        for field, value in loads.get(worker.id, {}).items():
            setattr(worker, field, value)
    return workers


BUSY = {"num_running": 6, "num_waiting": 4, "num_waiting_prefill_tokens": 4000, "kv_usage": 0.95}


@pytest.mark.parametrize(
    ("workers", "weights", "prompt", "expected"),
    [
        (_workers(), {}, PROMPT, "b"),
        (_workers(b={"num_in_flight": 3}), {}, PROMPT, "a"),
        (_workers(b=BUSY), {}, PROMPT, "a"),
        (_workers(b={"num_running": 1}, c={"num_running": 1}), {}, PROMPT, "b"),
        (_workers(b=BUSY), {"load_weight": 0.0}, PROMPT, "b"),
        (_workers(a=BUSY, b=BUSY), {}, PROMPT, "c"),
        (_workers(a={"kv_usage": 0.5}, b={"kv_usage": 0.2}), {}, [], "c"),
        (_workers(a={"kv_usage": 0.5}, b={"kv_usage": 0.2}), {"cache_weight": 0.0}, PROMPT, "c"),
    ],
    ids=[
        "longest-run-wins",
        "longest-run-over-the-in-flight-cap",
        "longest-run-but-saturated",
        "longest-run-with-light-load",
        "load-ignored",
        "both-cached-workers-saturated",
        "no-full-block-least-loaded",
        "cache-ignored",
    ],
)
def test_kv_cache_aware_rule(
    workers: list[WorkerView], weights: dict[str, float], prompt: list[int], expected: str
) -> None:
    chosen = _strategy(**weights).select(workers, context(prompt))
    assert chosen is not None
    assert chosen.id == expected


def test_ties_go_to_the_fewest_in_flight_then_at_random() -> None:
    strategy = _strategy()
    uncached = prompt_hashes(43, 512)
    workers = _workers(a={"num_running": 2, "num_in_flight": 0}, b={"num_running": 2, "num_in_flight": 1})
    picks = Counter(strategy.select(workers, context(uncached)).id for _ in range(1))  # type: ignore[union-attr]
    assert picks == Counter({"c": 1})
    tied = _workers()
    picks = Counter(strategy.select(tied, context(uncached)).id for _ in range(60))  # type: ignore[union-attr]
    assert set(picks) == {"a", "b", "c"}
