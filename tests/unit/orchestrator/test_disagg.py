"""The pure parts of disaggregated routing: the uncached-token count and the prefill choice."""

from __future__ import annotations

import pytest

from herd.orchestrator.disagg import choose_prefill, num_uncached_tokens
from herd.orchestrator.routing import WorkerView


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


@pytest.mark.parametrize(
    ("workers", "cached", "expected"),
    [
        ([view("a", waiting=100), view("b", waiting=10)], {}, "b"),
        ([view("a", waiting=100), view("b", waiting=10)], {"a": 8}, "a"),
        ([view("a", waiting=100), view("b", waiting=10)], {"a": 2}, "b"),
        ([view("a", in_flight=3), view("b", in_flight=1)], {}, "b"),
        ([view("b"), view("a")], {}, "a"),
    ],
    ids=[
        "least-queued",
        "cache-outweighs-queue",
        "queue-outweighs-small-cache",
        "fewest-in-flight",
        "stable-id",
    ],
)
def test_choose_prefill(workers: list[WorkerView], cached: dict[str, int], expected: str) -> None:
    choice = choose_prefill(workers, cached, 16)
    assert choice is not None and choice.id == expected


def test_choose_prefill_without_workers_is_none() -> None:
    assert choose_prefill([], {}, 16) is None
