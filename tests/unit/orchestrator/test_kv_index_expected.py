"""KVIndex expectations: a routed request's blocks count as held on its worker until events arrive."""

from __future__ import annotations

import pytest
from support.routing_views import context, prompt_hashes, views

from herd.api.crd import KVCacheAwareRouting
from herd.api.protocol import KVEvent, KVEventBatch, KVSnapshot
from herd.orchestrator.kv_index import KVIndex
from herd.orchestrator.routing import build_strategy


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def index(clock: Clock) -> KVIndex:
    index = KVIndex(expected_ttl_s=10.0, clock=clock)
    for worker in ("a", "b"):
        index.reset(worker, KVSnapshot(epoch="e", seq=0, block_size=16, block_hashes=[]))
    return index


def test_expected_blocks_match_until_their_deadline(index: KVIndex, clock: Clock) -> None:
    index.expect("a", [1, 2, 3])
    assert index.match([1, 2, 3, 4]) == {"a": 3}
    clock.now = 9.9
    assert index.match([1, 2]) == {"a": 2}
    clock.now = 10.0
    assert index.match([1, 2]) == {}


def test_a_later_expectation_extends_the_deadline(index: KVIndex, clock: Clock) -> None:
    index.expect("a", [1, 2])
    clock.now = 5.0
    index.expect("a", [1, 2])
    clock.now = 12.0
    assert index.match([1, 2]) == {"a": 2}
    clock.now = 15.0
    assert index.match([1, 2]) == {}


def test_expected_and_stored_blocks_make_one_run(index: KVIndex) -> None:
    index.apply("b", KVEventBatch(epoch="e", events=[KVEvent(seq=1, kind="stored", block_hashes=[1, 2])]))
    index.expect("b", [1, 2, 3])
    index.expect("a", [1])
    assert index.match([1, 2, 3]) == {"a": 1, "b": 3}


@pytest.mark.parametrize(
    "forget",
    [
        lambda index: index.apply(
            "a", KVEventBatch(epoch="e", events=[KVEvent(seq=1, kind="removed", block_hashes=[2])])
        ),
        lambda index: index.apply("a", KVEventBatch(epoch="e", events=[KVEvent(seq=1, kind="cleared")])),
        lambda index: index.remove_worker("a"),
        lambda index: index.reset("a", KVSnapshot(epoch="e2", seq=0, block_size=16, block_hashes=[])),
    ],
    ids=["removed-event", "cleared-event", "worker-left", "resync"],
)
def test_the_workers_own_word_drops_expectations(index: KVIndex, forget: object) -> None:
    index.expect("a", [1, 2, 3])
    forget(index)  # type: ignore[operator]
    assert index.match([1, 2, 3]).get("a", 0) <= 1


def test_kv_cache_aware_keeps_a_tenant_together_before_any_event(index: KVIndex) -> None:
    """A tenant's requests in quick succession stay on one worker, instead of spreading by load."""
    strategy = build_strategy(KVCacheAwareRouting(strategy="kv_cache_aware"), kv_index=index, block_size=16)
    tenant = prompt_hashes(7000, shared=256)
    first = strategy.select(views("a", "b"), context(tenant))
    assert first is not None
    index.expect(first.id, tenant)
    busy = {first.id: 1}
    second = strategy.select(views("a", "b", **busy), context(prompt_hashes(7001, shared=256)))
    assert second is not None and second.id == first.id


def test_expected_blocks_are_counted_per_worker_until_removed_or_expired(
    index: KVIndex, clock: Clock
) -> None:
    index.expect("a", [1, 2, 3])
    index.expect("a", [2, 3, 4])  # renewed ones count once
    index.expect("b", [1])
    assert dict(index.expected_blocks()) == {"a": 4, "b": 1}
    index.apply("a", KVEventBatch(epoch="e", events=[KVEvent(seq=1, kind="removed", block_hashes=[4])]))
    assert index.expected_blocks()["a"] == 3
    clock.now = 11.0
    index.expect("b", [9])  # expiry runs on the next expect
    assert dict(index.expected_blocks()) == {"a": 0, "b": 1}
