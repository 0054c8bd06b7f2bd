"""The fair queue without a gateway: priority order, token fair share by weight, bounds."""

from __future__ import annotations

import pytest

from herd.orchestrator.admission.fair_queue import FairQueue, QueueEntry

Arrival = tuple[str, str, int]
"""(name, tenant, priority)"""


def queue_of(arrivals: list[Arrival], *, max_size: int = 100) -> FairQueue[str]:
    queue: FairQueue[str] = FairQueue(max_size=max_size, max_wait_seconds=10.0)
    for name, tenant, priority in arrivals:
        assert queue.push(QueueEntry(name, tenant, priority, enqueued_at=0.0)) is None
    return queue


def drain(queue: FairQueue[str], cost: dict[str, int] | None = None) -> str:
    """Pop everything, charging each tenant its entry's cost (10 tokens by default)."""
    order = []
    while (entry := queue.pop()) is not None:
        order.append(entry.item)
        queue.charge(entry.tenant, (cost or {}).get(entry.tenant, 10), entry.weight)
    return "".join(order)


@pytest.mark.parametrize(
    ("arrivals", "order"),
    [
        ([("a", "x", 0), ("b", "x", 0), ("c", "x", 0)], "abc"),
        ([("a", "x", 2), ("b", "x", 1), ("c", "x", 0)], "cba"),
        ([("a", "x", 0), ("b", "x", 0), ("c", "x", 0), ("d", "y", 0)], "adbc"),
        ([("a", "x", 0), ("b", "x", 0), ("c", "y", 0), ("d", "y", 0), ("e", "z", 0)], "acebd"),
        ([("a", "x", 1), ("b", "y", 0), ("c", "x", 0), ("d", "y", 1)], "bcad"),
    ],
    ids=["fifo-one-tenant", "priority-first", "newcomer-shares", "round-of-three", "fair-within-priority"],
)
def test_pop_order(arrivals: list[Arrival], order: str) -> None:
    assert drain(queue_of(arrivals)) == order


def test_a_heavy_sender_gets_the_same_token_share_as_a_light_one() -> None:
    heavy = [(f"h{i}", "heavy", 0) for i in range(20)]
    order = drain(queue_of(heavy + [(f"l{i}", "light", 0) for i in range(2)]))
    assert order.startswith("h0l0h1l1h2h3")


def test_tokens_not_requests_are_shared() -> None:
    """light's requests cost 3x heavy's: it gets one for every three of heavy's."""
    queue = queue_of([(f"h{i}", "h", 0) for i in range(9)] + [(f"l{i}", "l", 0) for i in range(3)])
    order = drain(queue, cost={"h": 10, "l": 30})
    assert order.startswith("h0l0h1h2h3l1h4h5")


def test_weights_scale_the_share() -> None:
    queue: FairQueue[str] = FairQueue(max_size=100, max_wait_seconds=10.0)
    for i in range(6):
        queue.push(QueueEntry(f"a{i}", "a", 0, 0.0, weight=2.0))
        queue.push(QueueEntry(f"b{i}", "b", 0, 0.0, weight=1.0))
    order = drain(queue)
    assert order[:12].count("a") == 4


def test_an_idle_tenant_banks_no_credit() -> None:
    queue = queue_of([(f"a{i}", "a", 0) for i in range(5)])
    assert drain(queue) == "a0a1a2a3a4"
    queue.push(QueueEntry("a5", "a", 0, 0.0))
    queue.push(QueueEntry("a6", "a", 0, 0.0))
    queue.push(QueueEntry("b0", "b", 0, 0.0))  # idle until now: lifted to a's counter, not below it
    queue.push(QueueEntry("b1", "b", 0, 0.0))
    assert drain(queue) == "a5b0a6b1"


@pytest.mark.parametrize(
    ("newcomer_priority", "refused", "left"),
    [(0, "b", "acn"), (3, "n", "abc"), (5, "n", "abc")],
    ids=["sheds-least-urgent", "equal-is-refused", "less-urgent-is-refused"],
)
def test_a_full_queue_sheds_the_least_urgent_newest(newcomer_priority: int, refused: str, left: str) -> None:
    queue = queue_of([("a", "x", 3), ("b", "y", 3), ("c", "x", 1)], max_size=3)
    shed = queue.push(QueueEntry("n", "z", newcomer_priority, 0.0))
    assert shed is not None and shed.item == refused
    assert len(queue) == 3
    assert sorted(drain(queue)) == sorted(left)


def test_expired_removes_what_waited_too_long() -> None:
    queue: FairQueue[str] = FairQueue(max_size=10, max_wait_seconds=5.0)
    for name, at in [("a", 0.0), ("b", 2.0), ("c", 4.0)]:
        queue.push(QueueEntry(name, "x", 0, at))
    assert [entry.item for entry in queue.expired(now=7.0)] == ["a", "b"]
    assert len(queue) == 1 and drain(queue) == "c"


def test_requeue_puts_an_entry_back_at_its_tenants_head() -> None:
    queue = queue_of([("a", "x", 0), ("b", "x", 0)])
    first = queue.pop()
    assert first is not None
    queue.requeue(first)
    assert drain(queue) == "ab"


def test_remove_takes_a_waiting_entry_out_once() -> None:
    queue: FairQueue[str] = FairQueue(max_size=10, max_wait_seconds=5.0)
    entry = QueueEntry("a", "x", 0, 0.0)
    queue.push(entry)
    assert queue.remove(entry) and not queue.remove(entry)
    assert len(queue) == 0 and queue.pop() is None


def test_bounds_are_checked() -> None:
    with pytest.raises(ValueError, match="positive"):
        FairQueue[str](max_size=0, max_wait_seconds=1.0)
