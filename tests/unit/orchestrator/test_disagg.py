"""The pure parts of disaggregated routing: the uncached-token count, the path and the prefill choice."""

from __future__ import annotations

import dataclasses

import pytest

from herd.orchestrator.routing import WorkerView
from herd.orchestrator.routing.pairing import (
    MIN_REMOTE_BLOCKS,
    choose_path,
    choose_prefill,
    num_uncached_tokens,
)


@pytest.mark.parametrize(
    ("num_tokens", "num_cached_blocks", "expected"),
    [(100, 0, 100), (100, 4, 36), (64, 4, 0), (10, 3, 0)],
    ids=["nothing-cached", "some-cached", "all-cached", "index-ahead-of-prompt"],
)
def test_num_uncached_tokens(num_tokens: int, num_cached_blocks: int, expected: int) -> None:
    assert num_uncached_tokens(num_tokens, num_cached_blocks, 16) == expected


def view(worker_id: str, *, waiting: int = 0, in_flight: int = 0) -> WorkerView:
    return WorkerView(
        id=worker_id, url="", role="prefill", num_waiting_prefill_tokens=waiting, num_in_flight=in_flight
    )


def with_prefills(worker: WorkerView, in_flight_tokens: dict[str, int]) -> WorkerView:
    """``worker`` with this orchestrator's prefill tokens in flight on it (the registry's count)."""
    return dataclasses.replace(worker, num_prefill_tokens_in_flight=in_flight_tokens.get(worker.id, 0))


@pytest.mark.parametrize(
    ("workers", "cached", "in_flight_tokens", "expected"),
    [
        ([view("a", waiting=100), view("b", waiting=10)], {}, {}, "b"),
        ([view("a", waiting=100), view("b", waiting=10)], {"a": 8}, {}, "a"),
        ([view("a", waiting=100), view("b", waiting=10)], {"a": 2}, {}, "b"),
        ([view("a", in_flight=3), view("b", in_flight=1)], {}, {}, "b"),
        ([view("a"), view("b")], {}, {"a": 1130}, "b"),
        ([view("a", waiting=10), view("b")], {}, {"b": 90}, "a"),
        ([view("b"), view("a")], {}, {}, "a"),
    ],
    ids=[
        "least-queued",
        "cache-outweighs-queue",
        "queue-outweighs-small-cache",
        "fewest-in-flight",
        "own-prefills-in-flight-count",
        "report-and-own-count-compare",
        "stable-id",
    ],
)
def test_choose_prefill(
    workers: list[WorkerView], cached: dict[str, int], in_flight_tokens: dict[str, int], expected: str
) -> None:
    choice = choose_prefill([with_prefills(worker, in_flight_tokens) for worker in workers], cached, 16)
    assert choice is not None and choice.id == expected


def test_choose_prefill_without_workers_is_none() -> None:
    assert choose_prefill([], {}, 16) is None


@pytest.mark.parametrize(
    ("worker", "in_flight_tokens", "expected"),
    [(view("p"), {}, 0), (view("p", waiting=50), {"p": 200}, 200), (view("p", waiting=300), {"p": 200}, 300)],
    ids=["nothing", "own-count-beyond-the-report", "report-beyond-the-own-count"],
)
def test_queued_prefill_tokens(worker: WorkerView, in_flight_tokens: dict[str, int], expected: int) -> None:
    # with_prefills replaces the view: its derived count follows the new fields.
    assert with_prefills(worker, in_flight_tokens).queued_prefill_tokens == expected


SMALL = MIN_REMOTE_BLOCKS * 16


@pytest.mark.parametrize(
    ("num_uncached", "prefill", "queued", "expected"),
    [
        (1000, None, 0, "local_prefill"),
        (256, view("p"), 4096, "remote_prefill"),
        (1000, view("p"), 0, "remote_prefill"),
        (SMALL, view("p"), 0, "remote_prefill"),
        (255, view("p"), 0, "remote_prefill"),
        (90, view("p"), 166, "remote_prefill"),
        (90, view("p"), 167, "local_prefill"),
        (SMALL, view("p"), 1130, "local_prefill"),
        (SMALL - 1, view("p"), 0, "local_prefill"),
        (0, view("p"), 0, "local_prefill"),
    ],
    ids=[
        "no-prefill-worker",
        "long-goes-remote-even-when-busy",
        "long-goes-remote",
        "short-goes-to-an-idle-prefill-worker",
        "just-below-threshold-idle",
        "short-joins-a-queue-that-stays-within-the-threshold",
        "short-stays-local-when-the-queue-would-pass-it",
        "short-stays-local-beside-a-long-prompt",
        "too-few-blocks-to-move",
        "all-cached",
    ],
)
def test_choose_path(num_uncached: int, prefill: WorkerView | None, queued: int, expected: str) -> None:
    path = choose_path(num_uncached, prefill, queued_tokens=queued, threshold_tokens=256, block_size=16)
    assert path == expected
