"""``decide``: the capacity filter, the strategy, the prefill/decode pair, the blocks to expect, the pin."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from herd.api.crd import KVCacheAwareRouting, RoundRobinRouting, RoutingSpec, StickySessionRouting
from herd.api.protocol import KVSnapshot, Role
from herd.orchestrator.discovery import ModelConfig
from herd.orchestrator.routing import (
    Decision,
    Pin,
    RequestContext,
    UnroutableError,
    WorkerView,
    decide,
    decide_prefill,
)
from herd.orchestrator.routing.latency import LatencyFeatures
from herd.orchestrator.routing.pairing import MIN_REMOTE_BLOCKS
from herd.orchestrator.served import ServedModel

BLOCK = 16
THRESHOLD = 256


def view(worker_id: str, role: Role = "unified", **fields: Any) -> WorkerView:
    return WorkerView(id=worker_id, url=f"http://{worker_id}", role=role, **fields)


def model(
    mode: str = "aggregated",
    routing: RoutingSpec | None = None,
    *,
    limit: int = 0,
    cached: dict[str, int] | None = None,
    host: dict[str, tuple[int, int]] | None = None,
) -> ServedModel:
    """A served model whose KV index says worker ``w`` holds the first ``cached[w]`` blocks of ``HASHES``
    on its device and ``HASHES[start:end]`` in its host tier, ``(start, end) = host[w]``."""
    config = ModelConfig(
        "m",
        routing or RoundRobinRouting(strategy="round_robin"),
        block_size=BLOCK,
        mode=mode,  # type: ignore[arg-type]
        prefill_threshold_tokens=THRESHOLD,
        max_in_flight_per_worker=limit,
    )
    served = ServedModel(config)
    for worker_id in {*(cached or {}), *(host or {})}:
        start, end = (host or {}).get(worker_id, (0, 0))
        snapshot = KVSnapshot(
            epoch="e",
            seq=0,
            block_size=BLOCK,
            block_hashes=HASHES[: (cached or {}).get(worker_id, 0)],
            tier_block_hashes={"host": HASHES[start:end]} if end else {},
        )
        served.kv_index.reset(worker_id, snapshot)
    return served


HASHES = list(range(100, 140))
"""Block hashes of a 40-block prompt (the index compares them only for equality)."""


def request(num_blocks: int, **fields: Any) -> RequestContext:
    """A prompt of ``num_blocks`` full blocks."""
    return RequestContext(
        model="m", token_ids=tuple(range(num_blocks * BLOCK)), block_hashes=HASHES[:num_blocks], **fields
    )


@dataclass(frozen=True)
class Case:
    views: list[WorkerView]
    request: RequestContext = field(default_factory=lambda: request(0))
    mode: str = "aggregated"
    limit: int = 0
    cached: dict[str, int] = field(default_factory=dict)
    host: dict[str, tuple[int, int]] = field(default_factory=dict)
    worker: str = ""
    prefill: str | None = None
    num_prefill_tokens: int = 0
    num_cached_blocks: int = 0


UNIFIED = [view("a"), view("b")]
POOLS = [view("p0", "prefill"), view("p1", "prefill", num_waiting_prefill_tokens=500), view("d0", "decode")]

CASES = {
    "first-in-order": Case(UNIFIED, worker="a"),
    "tried-ones-left-out": Case(UNIFIED, request(0, excluded=frozenset({"a"})), worker="b"),
    "unhealthy-left-out": Case([view("a", is_healthy=False), view("b")], worker="b"),
    "full-ones-left-out": Case([view("a", num_in_flight=2), view("b")], limit=2, worker="b"),
    "other-roles-left-out": Case([view("d0", "decode"), view("b")], worker="b"),
    "cached-blocks-counted": Case(
        UNIFIED, request(6), cached={"a": 4}, worker="a", num_prefill_tokens=2 * BLOCK, num_cached_blocks=4
    ),
    "host-tier-blocks-are-restored-not-prefilled": Case(
        UNIFIED,
        request(8),
        cached={"a": 4},
        host={"a": (4, 7)},
        worker="a",
        num_prefill_tokens=1 * BLOCK,
        num_cached_blocks=4,
    ),
    "host-tier-blocks-past-a-gap-are-prefilled": Case(
        UNIFIED,
        request(8),
        cached={"a": 2},
        host={"a": (3, 8)},
        worker="a",
        num_prefill_tokens=6 * BLOCK,
        num_cached_blocks=2,
    ),
    "long-prompt-prefills-on-the-least-queued": Case(
        POOLS, request(20), mode="disaggregated", worker="d0", prefill="p0", num_prefill_tokens=20 * BLOCK
    ),
    "prefill-work-is-what-the-prefill-worker-lacks": Case(
        POOLS,
        request(20),
        mode="disaggregated",
        cached={"p0": 5},
        worker="d0",
        prefill="p0",
        num_prefill_tokens=15 * BLOCK,
    ),
    "short-prompt-prefills-locally": Case(
        POOLS,
        request(MIN_REMOTE_BLOCKS - 1),
        mode="disaggregated",
        worker="d0",
        num_prefill_tokens=(MIN_REMOTE_BLOCKS - 1) * BLOCK,
    ),
    "prompt-cached-on-the-decode-worker-prefills-locally": Case(
        POOLS,
        request(20),
        mode="disaggregated",
        cached={"d0": 18},
        worker="d0",
        num_prefill_tokens=2 * BLOCK,
        num_cached_blocks=18,
    ),
    "short-prompt-beside-a-long-queue-prefills-locally": Case(
        [view("p0", "prefill", num_prefill_tokens_in_flight=250), view("d0", "decode")],
        request(MIN_REMOTE_BLOCKS),
        mode="disaggregated",
        worker="d0",
        num_prefill_tokens=MIN_REMOTE_BLOCKS * BLOCK,
    ),
    "no-prefill-pool-prefills-locally": Case(
        [view("d0", "decode")], request(20), mode="disaggregated", worker="d0", num_prefill_tokens=20 * BLOCK
    ),
    "a-retry-after-the-prefill-chooses-a-decode-worker-only": Case(
        POOLS, request(20, is_prefilled=True), mode="disaggregated", worker="d0"
    ),
    "no-tokens-yet-always-prefills-remotely": Case(
        POOLS, request(0), mode="disaggregated", worker="d0", prefill="p0"
    ),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_decide(case: Case) -> None:
    served = model(case.mode, limit=case.limit, cached=case.cached, host=case.host)
    decision = decide(served, case.views, case.request)
    assert decision.worker.id == case.worker
    assert (None if decision.prefill is None else decision.prefill.id) == case.prefill
    assert decision.num_prefill_tokens == case.num_prefill_tokens
    assert decision.num_cached_blocks == case.num_cached_blocks
    assert list(decision.expected_blocks) == list(case.request.block_hashes)


@pytest.mark.parametrize(
    ("views", "limit", "reason"),
    [
        ([], 0, "no_healthy_worker"),
        ([view("a", is_healthy=False)], 0, "no_healthy_worker"),
        ([view("p0", "prefill")], 0, "no_healthy_worker"),
        ([view("a", num_in_flight=1), view("b", num_in_flight=3)], 1, "at_capacity"),
    ],
    ids=["none", "none-healthy", "only-another-role", "all-full"],
)
def test_decide_refuses(views: list[WorkerView], limit: int, reason: str) -> None:
    with pytest.raises(UnroutableError) as refused:
        decide(model(limit=limit), views, request(0))
    assert refused.value.reason == reason


@pytest.mark.parametrize(
    ("session_key", "pinned", "expected"),
    [
        (None, None, None),
        ("s1", None, Pin("m:s1", "a", 60, is_claim=True)),
        ("s1", "b", Pin("m:s1", "b", 60, is_claim=False)),
        ("s1", "gone", Pin("m:s1", "a", 60, is_claim=False)),
    ],
    ids=["no-session", "new-session-claims", "pinned-session-refreshes", "dead-pin-re-pins"],
)
def test_decide_names_the_pin_to_write(
    session_key: str | None, pinned: str | None, expected: Pin | None
) -> None:
    sticky = StickySessionRouting(strategy="sticky_session", session_ttl_seconds=60)
    ctx = request(0, session_key=session_key, pinned_worker_id=pinned)
    assert decide(model(routing=sticky), UNIFIED, ctx).pin == expected


@pytest.mark.parametrize(
    ("tier_cost", "walks"),
    [
        ("measured", {"match": 2, "match_tiers": 1}),
        ("device", {"match": 2, "held_run": 1}),
    ],
    ids=["tier-runs-shared", "tier-blind-walks-the-chosen-worker-alone"],
)
def test_a_decision_walks_the_index_once_for_each_kind_of_run(
    tier_cost: str, walks: dict[str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """kv_cache_aware (pricing pulls: the device runs, and the runs peers can lend) and the
    decision's own counts share the walks; the chosen worker's run over every tier comes from the
    strategy's tier runs when it priced the tiers."""
    routing = KVCacheAwareRouting(strategy="kv_cache_aware", tier_cost=tier_cost, peer_pulls=True)  # type: ignore[arg-type]
    served = model(routing=routing, cached={"a": 4, "b": 2}, host={"a": (4, 7)})
    calls: Counter[str] = Counter()

    def counted(name: str, method: Callable[..., object]) -> Callable[..., object]:
        def call(*args: object, **kwargs: object) -> object:
            calls[name] += 1
            return method(*args, **kwargs)

        return call

    for name in ("match", "match_tiers", "held_run"):
        monkeypatch.setattr(served.kv_index, name, counted(name, getattr(served.kv_index, name)))
    decision = decide(served, UNIFIED, request(8))
    assert (decision.worker.id, decision.num_prefill_tokens, decision.num_cached_blocks) == ("a", BLOCK, 4)
    assert calls == walks


def test_decide_prefill_replaces_a_failed_prefill_worker() -> None:
    served = model("disaggregated")
    first = decide(served, POOLS, request(20))
    assert first.prefill is not None and first.prefill.id == "p0"
    replacement, num_tokens = decide_prefill(served, POOLS, request(20, excluded=frozenset({"p0"})))
    assert (replacement, num_tokens) == (POOLS[1], 20 * BLOCK)
    assert decide_prefill(served, POOLS, request(20, excluded=frozenset({"p0", "p1"}))) == (None, 0)


def test_a_decision_is_a_plain_value() -> None:
    """Edges apply it; nothing in it refers back to the gateway."""
    decision = decide(model(), UNIFIED, request(2))
    features = LatencyFeatures(queued_prefill_tokens=0, batch=0, uncached_prompt_tokens=2 * BLOCK)
    assert decision == Decision(
        UNIFIED[0], num_prefill_tokens=2 * BLOCK, expected_blocks=HASHES[:2], features=features
    )
