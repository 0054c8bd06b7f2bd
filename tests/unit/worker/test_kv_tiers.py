"""The tiers' bookkeeping without a model: offload on eviction, restore on a hit, demotion to disk,
LRU per tier, pins within a plan, and the moves a plan lists."""

from __future__ import annotations

import pytest
from conftest import make_seq

from herd.worker.block_manager import BlockManager
from herd.worker.kv_tiers import DISK_WRITE_QUEUE_BYTES, KVMove, TierCache, disk_write_queue_depth
from herd.worker.scheduler import Scheduler
from herd.worker.sequence import Sequence

BS = 4


def prompt(first: int, num_blocks: int) -> list[int]:
    """``num_blocks`` full blocks plus one token, so that every full block may be a hit."""
    return list(range(first, first + num_blocks * BS + 1))


def serve(scheduler: Scheduler, tokens: list[int], request_id: str) -> tuple[Sequence, list[KVMove]]:
    """Admit one prompt, plan its step, finish it: the sequence and the plan's moves."""
    seq = make_seq(tokens, request_id=request_id)
    scheduler.add(seq)
    plan = scheduler.schedule()
    scheduler.update(plan)
    scheduler.finish(seq)
    return seq, plan.kv_moves


def test_an_evicted_block_goes_to_the_host_and_comes_back() -> None:
    manager = BlockManager(4, BS, num_host_blocks=8)
    scheduler = Scheduler(manager, max_batch_tokens=64, max_batch_size=4)
    first, _ = serve(scheduler, prompt(0, 3), "a")
    _, moves = serve(scheduler, prompt(100, 3), "b")  # needs all 4 blocks: a's 3 cached ones go
    assert [(m.src, m.dst) for m in moves] == [("device", "host")] * 3
    assert set(manager.host.slots) == set(first.block_hashes)  # type: ignore[union-attr]
    again, moves = serve(scheduler, prompt(0, 3), "c")
    assert again.num_cached_tokens == 3 * BS
    restores = [m for m in moves if m.dst == "device"]
    assert [m.src for m in restores] == ["host"] * 3
    for restore in restores:  # a reused block leaves for the host before it is written
        offloads = [m for m in moves if m.src == "device" and m.src_slot == restore.dst_slot]
        assert all(moves.index(m) < moves.index(restore) for m in offloads)
    assert sum(m.src == "device" for m in moves) == 3
    assert manager.counters.restored["host"] == 3


def test_tiers_are_inclusive_a_restored_block_is_not_copied_again() -> None:
    manager = BlockManager(4, BS, num_host_blocks=8)
    scheduler = Scheduler(manager, max_batch_tokens=64, max_batch_size=4)
    for request_id, first in [("a", 0), ("b", 100), ("c", 0)]:
        serve(scheduler, prompt(first, 3), request_id)
    _, moves = serve(scheduler, prompt(100, 3), "d")  # evicts a's blocks again: the host has them
    assert [(m.src, m.dst) for m in moves] == [("host", "device")] * 3
    assert manager.counters.stored["host"] == 6


@pytest.mark.parametrize("imported", [(1,), (1, 2)], ids=["imported-block-last", "run-past-the-hole"])
def test_a_restore_run_goes_on_through_device_blocks_past_a_hole(imported: tuple[int, ...]) -> None:
    """A peer pull can import blocks past a hole in the device's run (the hole's block was in the
    host tier when the pull was priced): the prompt restores the hole's block and reads the imported
    ones as hits, computing none of them, and no hash is registered on a second device block (which
    broke the prefix cache's map)."""
    manager = BlockManager(8, BS, num_host_blocks=8)
    scheduler = Scheduler(manager, max_batch_tokens=64, max_batch_size=4)
    first, _ = serve(scheduler, prompt(0, 4), "a")
    serve(scheduler, prompt(100, 7), "b")  # needs all 8 blocks: a's go to the host
    tokens = prompt(0, 4)
    blocks = [manager.import_block(first.block_hashes[i], tokens[i * BS : (i + 1) * BS]) for i in imported]
    assert all(block_id is not None for block_id in blocks)
    manager.release([block_id for block_id in blocks if block_id is not None])
    again, moves = serve(scheduler, tokens, "c")
    num_restored = 4 - len(imported)
    assert [(m.src, m.dst) for m in moves if m.dst == "device"] == [("host", "device")] * num_restored
    assert again.num_cached_tokens == 4 * BS
    for block in manager.blocks:
        assert block.block_hash is None or manager.cached[block.block_hash] == block.block_id


def test_the_host_tier_demotes_its_lru_block_to_disk() -> None:
    manager = BlockManager(4, BS, num_host_blocks=3, num_disk_blocks=8)
    scheduler = Scheduler(manager, max_batch_tokens=64, max_batch_size=4)
    a, _ = serve(scheduler, prompt(0, 3), "a")
    serve(scheduler, prompt(100, 3), "b")  # a -> host
    _, moves = serve(scheduler, prompt(200, 3), "c")  # b -> host, a -> disk first
    assert [(m.src, m.dst) for m in moves] == [("host", "disk"), ("device", "host")] * 3
    assert set(manager.disk.slots) == set(a.block_hashes)  # type: ignore[union-attr]
    again, moves = serve(scheduler, prompt(0, 3), "d")
    assert again.num_cached_tokens == 3 * BS
    assert [m.src for m in moves if m.dst == "device"] == ["disk"] * 3


@pytest.mark.parametrize(
    ("restore", "num_held", "restores"),
    [(False, 0, []), (True, 3, [("host", "device")] * 3)],
    ids=["device-only", "restored-from-host"],
)
def test_a_lease_restores_what_the_host_tier_holds(
    restore: bool, num_held: int, restores: list[tuple[str, str]]
) -> None:
    manager = BlockManager(4, BS, num_host_blocks=8)
    scheduler = Scheduler(manager, max_batch_tokens=64, max_batch_size=4)
    a, _ = serve(scheduler, prompt(0, 3), "a")
    serve(scheduler, prompt(100, 3), "b")  # a's blocks -> host
    held = manager.hold_prefix(a.block_hashes, restore=restore)
    moves, restored = manager.end_plan()
    assert len(held) == num_held and restored == held
    assert [(m.src, m.dst) for m in moves if m.dst == "device"] == restores
    assert [manager.cached.get(h) for h in a.block_hashes[:num_held]] == held
    manager.release(held)
    assert manager.num_free_blocks == 4


def test_a_lease_restores_while_a_device_block_is_free() -> None:
    manager = BlockManager(4, BS, num_host_blocks=8)
    scheduler = Scheduler(manager, max_batch_tokens=64, max_batch_size=4)
    a, _ = serve(scheduler, prompt(0, 3), "a")
    serve(scheduler, prompt(100, 3), "b")  # a -> host
    other = make_seq(list(range(300, 300 + 3 * BS)), request_id="other")
    manager.allocate(other, [], other.num_tokens)  # three of the four device blocks in use
    manager.end_plan()
    held = manager.hold_prefix(a.block_hashes, restore=True)
    moves, _ = manager.end_plan()
    assert len(held) == 1 and [m.src for m in moves if m.dst == "device"] == ["host"]


def test_a_lease_never_restores_from_disk() -> None:
    manager = BlockManager(4, BS, num_host_blocks=3, num_disk_blocks=8)
    scheduler = Scheduler(manager, max_batch_tokens=64, max_batch_size=4)
    a, _ = serve(scheduler, prompt(0, 3), "a")
    serve(scheduler, prompt(100, 3), "b")  # a -> host
    serve(scheduler, prompt(200, 3), "c")  # b -> host, a -> disk
    assert manager.hold_prefix(a.block_hashes, restore=True) == []
    assert manager.end_plan() == ([], [])


@pytest.mark.parametrize(
    ("asked", "in_use", "num_held", "end"),
    [
        ("d", 0, 3, "whole"),  # on the device
        ("c", 0, 3, "whole"),  # in the host tier, restored
        ("c", 3, 1, "no_free_block"),  # in the host tier, one device block free
        ("a", 0, 0, "on_disk"),  # a lease never reads the disk
        ("z", 0, 0, "not_cached"),
    ],
)
def test_a_lease_says_why_its_run_ended(asked: str, in_use: int, num_held: int, end: str) -> None:
    manager = BlockManager(4, BS, num_host_blocks=6, num_disk_blocks=8)
    scheduler = Scheduler(manager, max_batch_tokens=64, max_batch_size=4)
    names = ("a", "b", "c", "d")
    served = {name: serve(scheduler, prompt(100 * index, 3), name)[0] for index, name in enumerate(names)}
    # d on the device, b and c in the host tier, a on the disk
    if in_use:
        other = make_seq(list(range(900, 900 + in_use * BS)), request_id="other")
        manager.allocate(other, [], other.num_tokens)  # d -> host, b -> disk
        manager.end_plan()
    hashes = [12345, 23456, 34567] if asked == "z" else served[asked].block_hashes  # z: never served
    held = manager.hold_prefix(hashes, restore=True)
    assert (len(held), manager.run_end(hashes, len(held))) == (num_held, end)


@pytest.mark.parametrize(
    ("pinned", "expected"),
    [((), 0), ((0,), 1), ((0, 1), 2), ((0, 1, 2), None)],
    ids=["lru-first", "skips-a-pin", "skips-two", "all-pinned-takes-none"],
)
def test_a_tier_evicts_its_lru_unpinned_slot(pinned: tuple[int, ...], expected: int | None) -> None:
    tier = TierCache("host", 3)
    for slot, block_hash in enumerate([10, 11, 12]):
        assert tier.victim() == slot
        tier.store(slot, block_hash, [block_hash])
    tier.end_plan()
    for slot in pinned:
        tier.use(slot)
    assert tier.victim() == expected


def test_a_hit_compares_tokens() -> None:
    tier = TierCache("host", 2)
    tier.store(0, 7, [1, 2, 3, 4])
    assert tier.lookup(7, [1, 2, 3, 4]) == 0
    assert tier.lookup(7, [1, 2, 3, 5]) is None


def test_forgetting_a_plans_moves_drops_what_they_wrote() -> None:
    manager = BlockManager(4, BS, num_host_blocks=8)
    scheduler = Scheduler(manager, max_batch_tokens=64, max_batch_size=4)
    serve(scheduler, prompt(0, 3), "a")
    _, moves = serve(scheduler, prompt(100, 3), "b")
    manager.events.drain()
    manager.forget_moves(moves)
    assert manager.host.num_used == 0  # type: ignore[union-attr]
    assert {(e.kind, e.medium) for e in manager.events.drain()} == {("removed", "host")}


@pytest.mark.parametrize(
    ("num_disk_slots", "bytes_per_block", "depth"),
    [
        (10_000, 2**20, DISK_WRITE_QUEUE_BYTES // 2**20),  # the queue's bytes bound it
        (100, 2**20, 100),  # a small disk tier bounds it
        (10_000, 2 * DISK_WRITE_QUEUE_BYTES, 1),  # a block larger than the queue: one waits
        (0, 2**20, 0),  # no disk tier, no queue
    ],
)
def test_the_disk_write_queue_depth(num_disk_slots: int, bytes_per_block: int, depth: int) -> None:
    assert disk_write_queue_depth(num_disk_slots, bytes_per_block) == depth
