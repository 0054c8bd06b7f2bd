"""prefix_hash: ketama placement, locality, and bounded-load spillover (also for kv_cache_aware)."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable
from dataclasses import replace

import pytest
from support.routing_views import context, kv_cache_aware, prompt_hashes, views
from uhashring import HashRing

from herd.api.protocol import KVSnapshot
from herd.orchestrator.kv_index import KVIndex
from herd.orchestrator.routing import KVCacheAware, PrefixHash, RoutingStrategy, WorkerView
from herd.orchestrator.routing._load import MIN_CAP

IDS = [f"w{i}" for i in range(8)]
LOAD_FACTOR = 1.25


def _prefix_hash(prefix_blocks: int = 4) -> PrefixHash:
    return PrefixHash(load_factor=LOAD_FACTOR, prefix_blocks=prefix_blocks, rng=random.Random(5))


def _kv_cache_aware(hot: list[int]) -> KVCacheAware:
    index = KVIndex()
    index.reset("w3", _snapshot(hot))
    return kv_cache_aware(index, seed=5, load_factor=LOAD_FACTOR)


def _snapshot(blocks: list[int]) -> KVSnapshot:
    return KVSnapshot(epoch="e", seq=0, block_size=16, block_hashes=blocks)


def _pick(strategy: RoutingStrategy, workers: list[WorkerView], hashes: list[int]) -> WorkerView:
    chosen = strategy.select(workers, context(hashes))
    assert chosen is not None
    return chosen


@pytest.mark.parametrize(
    ("num_tokens", "prefix_blocks", "key_block"),
    [(512, 4, 3), (40, 4, 1), (512, 1, 0), (64, 8, 3)],
    ids=["4-of-32-blocks", "short-prompt-2-blocks", "first-block-only", "4-blocks-of-8-wanted"],
)
def test_unloaded_placement_is_the_ketama_node_of_the_leading_blocks(
    num_tokens: int, prefix_blocks: int, key_block: int
) -> None:
    ring = HashRing(IDS, hash_fn="ketama")
    strategy = _prefix_hash(prefix_blocks)
    for seed in range(30):
        hashes = prompt_hashes(seed, num_tokens)
        assert _pick(strategy, views(*IDS), hashes).id == ring.get_node(str(hashes[key_block]))


def test_prompts_sharing_the_leading_blocks_share_a_worker() -> None:
    strategy = _prefix_hash(prefix_blocks=4)
    for tenant in range(10):
        first = prompt_hashes(tenant * 1000 + 1, 512, shared=64)
        second = prompt_hashes(tenant * 1000 + 2, 300, shared=64)
        assert first[4] != second[4]
        assert _pick(strategy, views(*IDS), first).id == _pick(strategy, views(*IDS), second).id


def test_a_prompt_without_a_full_block_goes_to_the_least_loaded() -> None:
    workers = views(*IDS, **{name: 3 for name in IDS if name != "w6"})
    assert _pick(_prefix_hash(), workers, []).id == "w6"


def test_unhealthy_or_forgotten_workers_move_only_their_own_keys() -> None:
    strategy = _prefix_hash()
    prompts = [prompt_hashes(seed, 64) for seed in range(60)]
    before = {i: _pick(strategy, views(*IDS), hashes).id for i, hashes in enumerate(prompts)}
    survivors = views(*[name for name in IDS if name != "w2"])
    strategy.forget_worker("w2")
    after = {i: _pick(strategy, survivors, hashes).id for i, hashes in enumerate(prompts)}
    moved = {i for i in before if before[i] != after[i]}
    assert moved == {i for i in before if before[i] == "w2"}
    assert moved


def test_a_joining_worker_takes_keys_only_for_itself() -> None:
    strategy = _prefix_hash()
    prompts = [prompt_hashes(seed, 64) for seed in range(80)]
    before = [_pick(strategy, views(*IDS), hashes).id for hashes in prompts]
    after = [_pick(strategy, views(*IDS, "w8"), hashes).id for hashes in prompts]
    moved = [new for old, new in zip(before, after, strict=True) if old != new]
    assert moved
    assert set(moved) == {"w8"}


def _hammer(
    strategy: RoutingStrategy, prompts: list[list[int]], *, num_in_flight: int, steps: int
) -> list[str]:
    """Route ``steps`` requests keeping ``num_in_flight`` open (a random one finishes each step);
    check the bounded-load guarantee (with the cap's floor) after every decision and return the
    chosen ids."""
    rng = random.Random(11)
    workers = views(*IDS)
    position = {worker.id: i for i, worker in enumerate(workers)}
    open_requests: list[str] = []
    chosen_ids = []

    def add(worker_id: str, delta: int) -> None:  # views are frozen: a changed worker gets a new one
        worker = workers[position[worker_id]]
        workers[position[worker_id]] = replace(worker, num_in_flight=worker.num_in_flight + delta)

    for step in range(steps):
        if len(open_requests) >= num_in_flight:
            add(open_requests.pop(rng.randrange(len(open_requests))), -1)
        chosen = _pick(strategy, workers, prompts[step % len(prompts)])
        add(chosen.id, 1)
        open_requests.append(chosen.id)
        chosen_ids.append(chosen.id)
        mean = sum(worker.num_in_flight for worker in workers) / len(workers)
        assert max(worker.num_in_flight for worker in workers) <= max(MIN_CAP, LOAD_FACTOR * mean + 1)
    return chosen_ids


@pytest.mark.parametrize(
    "build",
    [lambda hot: _prefix_hash(), _kv_cache_aware],
    ids=["prefix_hash", "kv_cache_aware"],
)
def test_a_hot_prefix_spills_over_within_the_bound(build: Callable[[list[int]], RoutingStrategy]) -> None:
    hot = prompt_hashes(7, 512)
    chosen = _hammer(build(hot), [hot], num_in_flight=40, steps=400)
    assert len(set(chosen[-100:])) >= 6


def test_a_mix_of_prefixes_keeps_its_locality() -> None:
    ring = HashRing(IDS, hash_fn="ketama")
    prompts = [prompt_hashes(tenant * 1000 + 1, 512, shared=256) for tenant in range(64)]
    chosen = _hammer(_prefix_hash(), prompts, num_in_flight=64, steps=1024)
    homes = [ring.get_node(str(prompts[step % 64][3])) for step in range(1024)]
    at_home = sum(worker == home for worker, home in zip(chosen, homes, strict=True))
    # Random placement would keep 1/8 of them home; ketama's own imbalance makes some spill.
    assert at_home / len(chosen) >= 0.6
    majority = Counter((step % 64, worker) for step, worker in enumerate(chosen))
    assert sum(majority[tenant, homes[tenant]] >= 8 for tenant in range(64)) >= 60
