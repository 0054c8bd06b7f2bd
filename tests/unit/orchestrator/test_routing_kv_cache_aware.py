"""kv_cache_aware: the worker where the request costs the least work, in prompt tokens (prefill, evicted
cache, queued prefill and requests in flight), under the bounded-load cap."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import replace

import pytest
from support.routing_views import context, kv_cache_aware, prompt_hashes, views

from herd.api.protocol import KVSnapshot, LoadReport
from herd.orchestrator.kv_index import KVIndex
from herd.orchestrator.routing import KVCacheAware, RequestContext, WorkerView, restore_block_tokens

PROMPT = prompt_hashes(42, 512)
"""32 blocks: "a" caches the first 8, "b" the first 16, "c" none."""


def _strategy(*, cache_weight: float = 1.0, load_weight: float = 1.0) -> KVCacheAware:
    index = KVIndex()
    index.reset("a", KVSnapshot(epoch="e", seq=0, block_size=16, block_hashes=PROMPT[:8]))
    index.reset("b", KVSnapshot(epoch="e", seq=0, block_size=16, block_hashes=[*PROMPT[:16], 7]))
    return kv_cache_aware(index, seed=2, cache_weight=cache_weight, load_weight=load_weight)


def _workers(**loads: Mapping[str, float]) -> list[WorkerView]:
    return [replace(worker, **loads.get(worker.id, {})) for worker in views("a", "b", "c")]  # type: ignore[arg-type]


BUSY = {"num_running": 6, "num_waiting": 4, "num_waiting_prefill_tokens": 4000}
ONE_RUNNING = {"num_running": 1}
"""One request in flight: a third of the 512-token prompt (171 tokens), more than a's 128 cached tokens
less than b's."""


@pytest.mark.parametrize(
    ("workers", "weights", "prompt", "expected"),
    [
        (_workers(), {}, PROMPT, "b"),
        (_workers(b={"num_in_flight": 3}), {}, PROMPT, "a"),
        (_workers(b=ONE_RUNNING), {}, PROMPT, "a"),
        (_workers(a=ONE_RUNNING, b=ONE_RUNNING), {}, PROMPT, "b"),
        (_workers(b={"num_waiting_prefill_tokens": 200}), {}, PROMPT, "a"),
        (_workers(b={"num_waiting_prefill_tokens": 100}), {}, PROMPT, "b"),
        (_workers(b={"num_prefill_tokens_in_flight": 200}), {}, PROMPT, "a"),
        (
            _workers(b={"num_prefill_tokens_in_flight": 200, "num_waiting_prefill_tokens": 100}),
            {},
            PROMPT,
            "a",
        ),
        (_workers(b=BUSY), {}, PROMPT, "a"),
        (_workers(b=BUSY), {"load_weight": 0.0}, PROMPT, "b"),
        (_workers(a=BUSY, b=BUSY), {}, PROMPT, "c"),
        (_workers(a=ONE_RUNNING, b=ONE_RUNNING), {"cache_weight": 0.0}, PROMPT, "c"),
        (_workers(a={"num_total_blocks": 8}, b=BUSY), {}, PROMPT, "c"),
        (_workers(a={"num_total_blocks": 32}, b=BUSY), {}, PROMPT, "a"),
    ],
    ids=[
        "longest-run-wins",
        "longest-run-over-the-in-flight-cap",
        "a-request-in-flight-outweighs-128-cached-tokens",
        "equal-loads-longest-run",
        "queued-prefill-tokens-outweigh-the-gain",
        "queued-prefill-tokens-below-the-gain",
        "prefills-sent-and-not-started-outweigh-the-gain",
        "the-larger-of-sent-and-reported-counts",
        "longest-run-but-saturated",
        "load-ignored",
        "both-cached-workers-saturated",
        "cache-ignored",
        "full-pool-counts-the-evicted-tokens",
        "pool-with-room-evicts-nothing",
    ],
)
def test_kv_cache_aware_rule(
    workers: list[WorkerView], weights: dict[str, float], prompt: list[int], expected: str
) -> None:
    chosen = _strategy(**weights).select(workers, context(prompt))
    assert chosen is not None
    assert chosen.id == expected


def test_a_prompt_without_a_full_block_goes_by_load() -> None:
    workers = _workers(a={"num_running": 1}, b={"num_running": 2})
    chosen = _strategy().select(workers, RequestContext(model="m", token_ids=range(10)))
    assert chosen is not None
    assert chosen.id == "c"


def test_ties_go_to_the_fewest_in_flight_then_the_fewest_cached_blocks_then_at_random() -> None:
    strategy = _strategy()
    uncached = prompt_hashes(43, 512)  # costs the same on every idle worker with room
    workers = _workers(a={"num_running": 2, "num_in_flight": 0}, b={"num_running": 2, "num_in_flight": 1})
    assert strategy.select(workers, context(uncached)).id == "c"  # type: ignore[union-attr]
    picks = Counter(strategy.select(_workers(), context(uncached)).id for _ in range(20))  # type: ignore[union-attr]
    assert picks == Counter({"c": 20}), "c caches nothing: the new prefix goes to the emptiest pool"
    picks = Counter(strategy.select(_workers()[:2], context(uncached)).id for _ in range(20))  # type: ignore[union-attr]
    assert picks == Counter({"a": 20}), "a caches 8 blocks, b 17"
    empty = views("c", "d", "e")
    picks = Counter(strategy.select(empty, context(uncached)).id for _ in range(60))  # type: ignore[union-attr]
    assert set(picks) == {"c", "d", "e"}


@pytest.mark.parametrize(
    ("d_run", "tier_cost", "expected"),
    [(1, "measured", "e"), (1, "device", "e"), (2, "measured", "d"), (2, "device", "d")],
    ids=["one-block-tiered", "one-block-device", "two-blocks-tiered", "two-blocks-device"],
)
def test_a_leading_run_of_one_block_counts_as_none(d_run: int, tier_cost: str, expected: str) -> None:
    """'d' holds the prompt's first ``d_run`` blocks and 'e' nothing, both idle with room: one block (a
    chat template's opening, shared by every prompt) does not tie new prompts to the workers already
    used, so the tie goes to the emptier pool; two blocks are a prefix worth going to 'd' for."""
    index = KVIndex()
    index.reset("d", KVSnapshot(epoch="e", seq=0, block_size=16, block_hashes=PROMPT[:d_run]))
    strategy = kv_cache_aware(index, seed=2, tier_cost=tier_cost)
    chosen = strategy.select(views("d", "e"), context(PROMPT))
    assert chosen is not None
    assert chosen.id == expected


def _tiered(tier_cost: str) -> KVCacheAware:
    """'a' holds the first 8 blocks on its device; 'b' the first 8 on its device and the next 16 in
    its host tier; 'c' none."""
    index = KVIndex()
    index.reset("a", KVSnapshot(epoch="e", seq=0, block_size=16, block_hashes=PROMPT[:8]))
    b = KVSnapshot(
        epoch="e", seq=0, block_size=16, block_hashes=PROMPT[:8], tier_block_hashes={"host": PROMPT[8:24]}
    )
    index.reset("b", b)
    return kv_cache_aware(index, seed=2, tier_cost=tier_cost)


@pytest.mark.parametrize(
    ("tier_cost", "b_load", "expected"),
    [
        ("measured", {"host_block_tokens": 0.5}, "b"),
        ("measured", {"host_block_tokens": 0.5, "num_waiting_prefill_tokens": 200}, "b"),
        ("measured", {"host_block_tokens": 14.0, "num_waiting_prefill_tokens": 200}, "a"),
        ("measured", {"num_waiting_prefill_tokens": 1}, "a"),
        ("weights", {"host_block_tokens": 0.5, "num_waiting_prefill_tokens": 260}, "a"),
        ("weights", {}, "b"),
        ("device", {"host_block_tokens": 0.5, "num_waiting_prefill_tokens": 1}, "a"),
    ],
    ids=[
        "a-cheap-restore-wins",
        "a-cheap-restore-outweighs-a-queue",
        "a-slow-restore-loses-to-the-queue",
        "an-unmeasured-tier-counts-as-recompute",
        "fixed-weights-ignore-the-bandwidth",
        "fixed-weights-count-the-host",
        "tier-blind-sees-the-device-only",
    ],
)
def test_a_lower_tier_counts_by_its_cost(tier_cost: str, b_load: dict[str, float], expected: str) -> None:
    workers = _workers(b=b_load)
    chosen = _tiered(tier_cost).select(workers, context(PROMPT))
    assert chosen is not None and chosen.id == expected


@pytest.mark.parametrize(
    ("report", "expected"),
    [
        ({}, None),
        ({"bytes_per_block": 10**6, "prefill_tokens_per_s": 1000.0}, None),
        ({"bytes_per_block": 10**6, "restore_bytes_per_s": {"host": 1e9}}, None),
        (
            {"bytes_per_block": 10**6, "prefill_tokens_per_s": 1000.0, "restore_bytes_per_s": {"host": 1e9}},
            1.0,
        ),
        (
            {"bytes_per_block": 10**6, "prefill_tokens_per_s": 500.0, "restore_bytes_per_s": {"host": 1e8}},
            5.0,
        ),
    ],
    ids=["nothing-measured", "no-bandwidth", "no-prefill-rate", "1-ms-at-1000-tok-s", "10-ms-at-500-tok-s"],
)
def test_a_restore_costs_the_tokens_the_worker_prefills_meanwhile(
    report: dict[str, object], expected: float | None
) -> None:
    assert restore_block_tokens(LoadReport.model_validate(report), "host") == expected


@pytest.mark.parametrize(
    ("fields", "queued", "requests"),
    [
        ({}, 0, 0),
        ({"num_running": 3, "num_waiting": 2, "num_in_flight": 4}, 0, 5),
        ({"num_running": 1, "num_in_flight": 4}, 0, 4),
        ({"num_waiting_prefill_tokens": 300, "num_prefill_tokens_in_flight": 200}, 300, 0),
        ({"num_waiting_prefill_tokens": 100, "num_prefill_tokens_in_flight": 200}, 200, 0),
    ],
    ids=[
        "idle",
        "report-beyond-the-own-count",
        "own-count-beyond-the-report",
        "reported-queue",
        "sent-prefills",
    ],
)
def test_a_view_derives_its_load_terms_when_built(fields: dict[str, int], queued: int, requests: int) -> None:
    """``queued(w)`` and ``requests(w)`` of the cost, derived by the view (a replaced view too)."""
    built = WorkerView(id="w", url="", **fields)  # type: ignore[arg-type]
    replaced = replace(WorkerView(id="w", url=""), **fields)  # type: ignore[arg-type]
    for view in (built, replaced):
        assert (view.queued_prefill_tokens, view.num_requests) == (queued, requests)
