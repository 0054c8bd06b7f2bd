"""KVIndex: event ordering (duplicates, gaps, epochs), snapshot resync, removal, leading-run matching."""

from __future__ import annotations

import pytest

from herd.api.protocol import KVEvent, KVEventBatch, KVSnapshot
from herd.orchestrator.kv_index import KVIndex, PromptMatch, TierRun


def _snapshot(blocks: list[int], *, seq: int = 0, epoch: str = "e1") -> KVSnapshot:
    return KVSnapshot(epoch=epoch, seq=seq, block_size=16, block_hashes=blocks)


def _batch(*events: tuple[int, str, list[int]], epoch: str = "e1") -> KVEventBatch:
    return KVEventBatch(
        epoch=epoch,
        events=[KVEvent(seq=seq, kind=kind, block_hashes=blocks) for seq, kind, blocks in events],
    )


@pytest.fixture
def index() -> KVIndex:
    index = KVIndex()
    index.reset("a", _snapshot([1, 2, 3], seq=5))
    index.reset("b", _snapshot([1, 2], seq=0))
    return index


def test_unknown_worker_needs_a_snapshot_first() -> None:
    index = KVIndex()
    assert index.apply("a", _batch((1, "stored", [1]))) is False
    assert index.match([1]) == {}
    assert index.workers() == []


def test_in_order_events_are_applied(index: KVIndex) -> None:
    assert index.apply("b", _batch((1, "stored", [3, 4]), (2, "removed", [1]))) is True
    assert index.num_blocks("b") == 3
    assert index.position("b") == ("e1", 2)
    assert index.match([1, 2, 3]) == {"a": 3}
    assert index.match([2, 3, 4]) == {"a": 2, "b": 3}


def test_already_applied_events_are_skipped(index: KVIndex) -> None:
    batch = _batch((1, "stored", [9]), (2, "removed", [9]))
    assert index.apply("b", batch) is True
    assert index.apply("b", batch) is True
    assert index.apply("b", _batch((2, "stored", [9]))) is True
    assert index.match([9]) == {}
    assert index.position("b") == ("e1", 2)


@pytest.mark.parametrize(
    ("batch", "expected_blocks"),
    [
        (_batch((7, "stored", [9])), 3),
        (_batch((6, "stored", [9]), (8, "stored", [10])), 4),
        (_batch((6, "stored", [9]), epoch="e2"), 3),
    ],
    ids=["gap-at-start", "gap-after-one-applied", "new-epoch"],
)
def test_gap_or_new_epoch_asks_for_a_resync(
    index: KVIndex, batch: KVEventBatch, expected_blocks: int
) -> None:
    assert index.apply("a", batch) is False
    assert index.num_blocks("a") == expected_blocks
    assert index.match([10]) == {}


def test_snapshot_resync_replaces_the_workers_entries(index: KVIndex) -> None:
    assert index.apply("a", _batch((6, "stored", [4]), epoch="e2")) is False
    index.reset("a", _snapshot([7, 8], seq=3, epoch="e2"))
    assert index.match([1, 2, 3]) == {"b": 2}
    assert index.match([7, 8]) == {"a": 2}
    assert index.apply("a", _batch((4, "stored", [9]), epoch="e2")) is True
    assert index.num_blocks("a") == 3


def test_cleared_event_drops_every_block(index: KVIndex) -> None:
    assert index.apply("a", _batch((6, "cleared", []), (7, "stored", [5]))) is True
    assert index.match([1, 2]) == {"b": 2}
    assert index.match([5]) == {"a": 1}


def test_remove_worker_drops_its_entries(index: KVIndex) -> None:
    index.remove_worker("a")
    index.remove_worker("never-seen")
    assert index.workers() == ["b"]
    assert index.num_blocks("a") == 0
    assert index.match([1, 2, 3]) == {"b": 2}
    index.remove_worker("b")
    assert index.match([1]) == {}


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        ([1, 2, 3, 4], {"a": 3, "b": 2}),
        ([2, 3], {"a": 2, "b": 1, "c": 2}),
        ([1, 5, 3], {"a": 1, "b": 1}),
        ([], {}),
        ([6, 1], {}),
    ],
    ids=["longest-runs", "other-first-block", "stops-at-first-miss", "empty", "miss-first"],
)
def test_match_counts_the_leading_run_only(
    index: KVIndex, query: list[int], expected: dict[str, int]
) -> None:
    index.reset("c", _snapshot([2, 3]))
    assert index.match(query) == expected


def _tier_event(seq: int, kind: str, blocks: list[int], medium: str) -> KVEventBatch:
    return KVEventBatch(
        epoch="e1",
        events=[KVEvent(seq=seq, kind=kind, block_hashes=blocks, medium=medium)],  # type: ignore[arg-type]
    )


@pytest.mark.parametrize(
    ("events", "expected"),
    [
        ([], {"a": TierRun(3), "b": TierRun(2)}),
        ([(6, "stored", [3, 4], "host")], {"a": TierRun(3), "b": TierRun(4, host=2)}),
        ([(6, "stored", [3], "host"), (7, "stored", [4], "disk")], {"a": TierRun(3), "b": TierRun(4, 1, 1)}),
        (
            [(6, "stored", [3], "disk"), (7, "stored", [3], "host")],
            {"a": TierRun(3), "b": TierRun(3, host=1)},
        ),
        ([(6, "stored", [3], "host"), (7, "removed", [3], "host")], {"a": TierRun(3), "b": TierRun(2)}),
        (
            [(6, "stored", [3], "host"), (7, "removed", [3], "device")],
            {"a": TierRun(3), "b": TierRun(3, host=1)},
        ),
        ([(6, "stored", [3], "host"), (7, "cleared", [], "device")], {"a": TierRun(3)}),
    ],
    ids=[
        "device-only",
        "host-extends",
        "host-then-disk",
        "host-beats-disk",
        "host-removed",
        "device-removed-keeps-host",
        "cleared-all",
    ],
)
def test_tier_runs_count_each_tier(
    index: KVIndex, events: list[tuple[int, str, list[int], str]], expected: dict[str, TierRun]
) -> None:
    index.reset("b", _snapshot([1, 2], seq=5))
    for seq, kind, blocks, medium in events:
        assert index.apply("b", _tier_event(seq, kind, blocks, medium))
    assert index.match_tiers([1, 2, 3, 4]) == expected
    assert index.match([1, 2, 3, 4])["a"] == 3
    assert index.held_run("b", [1, 2, 3, 4]) == expected.get("b", TierRun(0)).length


@pytest.mark.parametrize(
    ("events", "expected"),
    [
        ([], {"a": 3, "b": 2}),
        ([(6, "stored", [3, 4], "host")], {"a": 3, "b": 4}),
        ([(6, "stored", [3], "host"), (7, "stored", [4], "disk")], {"a": 3, "b": 3}),
        ([(6, "stored", [3], "disk")], {"a": 3, "b": 2}),
        ([(6, "stored", [3], "host"), (7, "removed", [3], "host")], {"a": 3, "b": 2}),
    ],
    ids=["device-only", "host-extends", "disk-is-not-lent", "disk-alone", "host-removed"],
)
def test_a_peer_lends_its_device_and_host_runs(
    index: KVIndex, events: list[tuple[int, str, list[int], str]], expected: dict[str, int]
) -> None:
    index.reset("b", _snapshot([1, 2], seq=5))
    for seq, kind, blocks, medium in events:
        assert index.apply("b", _tier_event(seq, kind, blocks, medium))
    index.expect("c", [1, 2, 3, 4])  # a worker merely expected to hold blocks has none to lend
    assert index.match([1, 2, 3, 4], include_expected=False, include_host=True) == expected


@pytest.mark.parametrize(
    ("worker_id", "query", "start", "expected"),
    [
        ("b", [1, 2, 3, 4, 5], 0, 4),
        ("b", [1, 2, 3, 4, 5], 2, 4),
        ("b", [1, 2, 3, 4, 5], 4, 4),
        ("b", [3, 4], 0, 2),
        ("b", [1, 5, 3], 0, 1),
        ("a", [1, 2, 3, 4, 7, 8], 0, 6),
        ("a", [9], 0, 0),
        ("gone", [1], 0, 0),
        ("b", [], 0, 0),
    ],
    ids=[
        "device-then-host",
        "from-a-known-run",
        "nothing-past-the-known-run",
        "host-from-the-first-block",
        "stops-at-the-first-miss",
        "expected-blocks-count",
        "miss-first",
        "unknown-worker",
        "empty",
    ],
)
def test_held_run_counts_every_tier_for_one_worker(
    index: KVIndex, worker_id: str, query: list[int], start: int, expected: int
) -> None:
    assert index.apply("b", _tier_event(1, "stored", [3, 4], "host"))
    index.expect("a", [4, 7, 8])
    assert index.held_run(worker_id, query, start=start) == expected


@pytest.mark.parametrize("tiers_walked", [False, True], ids=["own-walk", "read-off-the-tiers"])
@pytest.mark.parametrize("query", [[1, 2, 3, 4, 5], [3, 4], [1, 5, 3], [1, 2, 3, 4, 7, 8], [9], []])
def test_a_prompt_match_answers_as_the_index_does(
    index: KVIndex, query: list[int], tiers_walked: bool
) -> None:
    """Each run the index would give, walked once; one worker's held run read off the tier runs
    when a strategy walked them, else walked for that worker alone."""
    assert index.apply("b", _tier_event(1, "stored", [3, 4], "host"))
    index.expect("a", [4, 7, 8])
    kv = PromptMatch(index, query)
    if tiers_walked:
        assert kv.tiers == index.match_tiers(query)
    for worker_id in ("a", "b", "gone"):
        assert kv.held_run(worker_id) == index.held_run(worker_id, query)
    assert kv.device == index.match(query)
    assert kv.lendable == index.match(query, include_expected=False, include_host=True)
    assert kv.device is kv.device


def test_a_snapshot_carries_the_tiers() -> None:
    index = KVIndex()
    snapshot = _snapshot([1], seq=2).model_copy(update={"tier_block_hashes": {"host": [2], "disk": [3]}})
    index.reset("a", snapshot)
    assert index.match_tiers([1, 2, 3]) == {"a": TierRun(3, host=1, disk=1)}
    assert index.tier_blocks("a") == {"host": 1, "disk": 1}
    index.remove_worker("a")
    assert index.match_tiers([1, 2, 3]) == {}
