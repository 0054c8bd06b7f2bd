"""The block manager and prefix cache without a model: allocation, hits, eviction order, events."""

from __future__ import annotations

import pytest
from conftest import MODEL_ID, make_seq

from herd.api.kv_hash import block_hashes
from herd.worker.block_manager import BlockManager
from herd.worker.sequence import Sequence

BS = 4


def run_prefill(manager: BlockManager, seq: Sequence) -> None:
    """Admit ``seq`` with its cache hit, then pretend its whole prompt was computed."""
    hits = manager.computed_blocks(seq)
    num_new = seq.num_tokens - len(hits) * BS
    assert manager.can_allocate(seq, hits, num_new)
    manager.allocate(seq, hits, num_new)
    seq.num_computed_tokens += num_new
    manager.commit(seq, seq.num_computed_tokens)


@pytest.mark.parametrize(
    ("num_tokens", "expected_blocks"),
    [(1, 1), (4, 1), (5, 2), (12, 3), (13, 4)],
    ids=["one-token", "one-full-block", "spill-one", "three-full", "three-and-one"],
)
def test_allocation_covers_the_prompt(num_tokens: int, expected_blocks: int) -> None:
    manager = BlockManager(16, BS)
    seq = make_seq(list(range(100, 100 + num_tokens)))
    run_prefill(manager, seq)
    assert len(seq.block_table) == expected_blocks
    assert manager.num_free_blocks == 16 - expected_blocks
    manager.free(seq)
    assert manager.num_free_blocks == 16
    assert seq.block_table == []


@pytest.mark.parametrize(
    ("first", "second", "salts", "expected_cached"),
    [
        (list(range(12)), [*range(12), 99], (None, None), 12),
        (list(range(12)), list(range(12)), (None, None), 8),
        (list(range(12)), [*range(8), 50, 51, 52, 53, 54], (None, None), 8),
        (list(range(12)), [7, *range(1, 13)], (None, None), 0),
        (list(range(12)), [*range(12), 99], ("tenant-a", "tenant-b"), 0),
        (list(range(12)), [*range(12), 99], ("tenant-a", "tenant-a"), 12),
        (list(range(10)), [*range(10), 99], (None, None), 8),
    ],
    ids=[
        "full-prefix",
        "identical-keeps-one-token-to-compute",
        "diverges-in-third-block",
        "diverges-in-first-token",
        "other-salt-isolated",
        "same-salt-shares",
        "partial-tail-never-cached",
    ],
)
def test_prefix_hits(
    first: list[int], second: list[int], salts: tuple[str | None, str | None], expected_cached: int
) -> None:
    manager = BlockManager(16, BS)
    run_prefill(manager, make_seq(first, salt=salts[0]))
    later = make_seq(second, salt=salts[1])
    run_prefill(manager, later)
    assert later.num_cached_tokens == expected_cached


def test_hashes_are_the_shared_chain() -> None:
    manager = BlockManager(16, BS)
    seq = make_seq(list(range(10)))
    run_prefill(manager, seq)
    assert manager.cached_hashes() == block_hashes(list(range(10)), BS, model_id=MODEL_ID)


def test_hit_on_a_live_block_shares_it_and_counts_references() -> None:
    manager = BlockManager(16, BS)
    first, second = make_seq(list(range(9)), request_id="a"), make_seq(list(range(9)), request_id="b")
    run_prefill(manager, first)
    run_prefill(manager, second)
    assert second.block_table[:2] == first.block_table[:2]
    assert [manager.blocks[b].ref_count for b in first.block_table[:2]] == [2, 2]
    manager.free(first)
    assert [manager.blocks[b].ref_count for b in second.block_table[:2]] == [1, 1]


def test_token_mismatch_is_a_miss_even_when_the_hash_matches() -> None:
    manager = BlockManager(16, BS)
    run_prefill(manager, make_seq(list(range(9))))
    manager.blocks[manager.cached[manager.cached_hashes()[0]]].token_ids = [9, 9, 9, 9]
    later = make_seq(list(range(9)))
    assert manager.computed_blocks(later) == []


def test_freed_blocks_keep_their_hash_and_revive() -> None:
    manager = BlockManager(8, BS)
    first = make_seq(list(range(9)))
    run_prefill(manager, first)
    manager.free(first)
    assert len(manager.cached) == 2
    again = make_seq(list(range(9)))
    run_prefill(manager, again)
    assert again.num_cached_tokens == 8
    assert manager.num_free_blocks == 8 - 3


def test_eviction_takes_the_tail_first_and_emits_removed() -> None:
    manager = BlockManager(4, BS)
    first = make_seq(list(range(16)))
    run_prefill(manager, first)
    manager.free(first)
    hashes = manager.cached_hashes()
    manager.events.drain()
    run_prefill(manager, make_seq([200, 201, 202, 203, 204]))
    removed = [h for event in manager.events.drain() if event.kind == "removed" for h in event.block_hashes]
    assert removed == [hashes[3], hashes[2]]
    assert hashes[0] in manager.cached
    assert hashes[1] in manager.cached


def test_unhashed_free_blocks_are_reused_before_cached_ones() -> None:
    manager = BlockManager(3, BS)
    cached, partial = make_seq(list(range(8))), make_seq([300, 301])
    run_prefill(manager, cached)
    run_prefill(manager, partial)
    partial_block = partial.block_table[0]
    manager.free(cached)
    manager.free(partial)
    newcomer = make_seq([400, 401, 402])
    run_prefill(manager, newcomer)
    assert newcomer.block_table == [partial_block]
    assert len(manager.cached) == 2


def test_events_replayed_equal_the_snapshot() -> None:
    manager = BlockManager(6, BS)
    known: set[int] = set()
    last_seq = 0
    for start in range(0, 60, 7):
        seq = make_seq(list(range(start, start + 9)))
        run_prefill(manager, seq)
        manager.free(seq)
        for event in manager.events.drain():
            assert event.seq > last_seq
            last_seq = event.seq
            known = (
                known | set(event.block_hashes) if event.kind == "stored" else known - set(event.block_hashes)
            )
    assert known == set(manager.cached_hashes())
    assert last_seq == manager.events.last_seq


def test_can_allocate_counts_revived_cached_blocks() -> None:
    manager = BlockManager(3, BS)
    first = make_seq(list(range(9)))
    run_prefill(manager, first)
    manager.free(first)
    later = make_seq(list(range(9)))
    hits = manager.computed_blocks(later)
    assert len(hits) == 2
    assert manager.can_allocate(later, hits, 1)
    assert not manager.can_allocate(later, hits, 5)


def test_disabled_prefix_caching_never_hits_or_stores() -> None:
    manager = BlockManager(8, BS, enable_prefix_caching=False)
    first = make_seq(list(range(9)))
    run_prefill(manager, first)
    manager.free(first)
    again = make_seq(list(range(9)))
    run_prefill(manager, again)
    assert again.num_cached_tokens == 0
    assert manager.cached_hashes() == []
    assert manager.events.drain() == []


def test_forget_drops_the_hashes_of_a_failed_step_and_reuses_those_blocks_first() -> None:
    manager = BlockManager(4, BS)
    kept = make_seq([1, 2, 3, 4], request_id="kept")
    run_prefill(manager, kept)
    manager.free(kept)
    lost = make_seq([9, 9, 9, 9, 8], request_id="lost")
    manager.allocate(lost, [], lost.num_tokens)
    cached = manager.commit(lost, lost.num_tokens)
    manager.events.drain()
    manager.free(lost)
    manager.forget(cached)
    [removed] = manager.events.drain()
    assert removed.kind == "removed" and removed.block_hashes == block_hashes(
        [9, 9, 9, 9], BS, model_id=MODEL_ID
    )
    assert manager.computed_blocks(make_seq([9, 9, 9, 9, 7])) == []
    fresh = make_seq([5] * 12, request_id="fresh")
    manager.allocate(fresh, [], 12)
    assert cached[0] in fresh.block_table and manager.computed_blocks(make_seq([1, 2, 3, 4, 5])) != []
