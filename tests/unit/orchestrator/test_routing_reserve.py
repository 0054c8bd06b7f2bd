"""The slots each worker keeps for urgent requests: background requests fill only part of them."""

from __future__ import annotations

import pytest

from herd.api.crd import RoundRobinRouting
from herd.orchestrator.discovery import ModelConfig
from herd.orchestrator.routing import RequestContext, UnroutableError, WorkerView, decide
from herd.orchestrator.routing.reserve import SlotReserve, background_limit, background_room, may_take_slot
from herd.orchestrator.served import ServedModel

BATCH = 1000
QUARTER = SlotReserve(share=0.25)


@pytest.mark.parametrize(
    ("cap", "share", "limit"),
    [
        (8, 0.25, 6),
        (4, 0.25, 3),
        (5, 0.25, 3),
        (2, 0.25, 1),
        (1, 0.25, 1),
        (8, 0.0, 8),
        (8, 0.9, 1),
        (0, 0.25, 0),
    ],
    ids=[
        "8",
        "4",
        "5-rounds-the-reserve-up",
        "2",
        "1-keeps-one-for-background",
        "no-reserve",
        "large",
        "no-cap",
    ],
)
def test_background_limit(cap: int, share: float, limit: int) -> None:
    assert background_limit(cap, SlotReserve(share=share)) == limit


@pytest.mark.parametrize(
    ("priority", "num_in_flight", "num_background", "cap", "reserve", "allowed"),
    [
        (BATCH, 0, 0, 8, QUARTER, True),
        (BATCH, 5, 5, 8, QUARTER, True),
        (BATCH, 6, 6, 8, QUARTER, False),
        (BATCH, 7, 5, 8, QUARTER, True),
        (0, 6, 6, 8, QUARTER, True),
        (0, 7, 6, 8, QUARTER, True),
        (0, 8, 6, 8, QUARTER, False),
        (5, 7, 6, 8, QUARTER, True),
        (5, 6, 6, 8, SlotReserve(share=0.25, priority=5), False),
        (BATCH, 6, 6, 8, SlotReserve(share=0.25, priority=5), False),
        (BATCH, 7, 7, 8, SlotReserve(share=0.0), True),
        (BATCH, 500, 500, 0, QUARTER, True),
    ],
    ids=[
        "background-on-an-idle-worker",
        "background-under-its-part",
        "background-at-its-part",
        "urgent-ones-do-not-count-against-background",
        "urgent-takes-a-reserved-slot",
        "urgent-takes-the-last-reserved-slot",
        "nobody-past-the-cap",
        "a-middle-priority-is-not-background",
        "a-lower-threshold-makes-it-background",
        "every-priority-past-the-threshold-counts",
        "no-reserve",
        "no-cap",
    ],
)
def test_may_take_slot(
    priority: int, num_in_flight: int, num_background: int, cap: int, reserve: SlotReserve, allowed: bool
) -> None:
    room = background_room(priority, cap, reserve)
    assert may_take_slot(num_in_flight, num_background, cap, room) is allowed


@pytest.mark.parametrize(
    ("priority", "cap", "reserve", "room"),
    [
        (BATCH, 8, QUARTER, 6),
        (BATCH + 1, 8, QUARTER, 6),
        (BATCH - 1, 8, QUARTER, 8),
        (0, 8, QUARTER, 8),
        (5, 8, SlotReserve(share=0.25, priority=5), 6),
        (4, 8, SlotReserve(share=0.25, priority=5), 8),
        (BATCH, 8, SlotReserve(share=0.0), 8),
        (BATCH, 0, QUARTER, 0),
        (0, 0, QUARTER, 0),
    ],
    ids=[
        "background-gets-its-part",
        "past-the-threshold",
        "just-under-the-threshold-gets-every-slot",
        "urgent-gets-every-slot",
        "at-a-lower-threshold",
        "under-a-lower-threshold",
        "no-reserve",
        "no-cap-background",
        "no-cap-urgent",
    ],
)
def test_background_room(priority: int, cap: int, reserve: SlotReserve, room: int) -> None:
    assert background_room(priority, cap, reserve) == room


@pytest.mark.parametrize("share", [-0.1, 1.0, 1.5])
def test_a_share_outside_0_1_is_refused(share: float) -> None:
    with pytest.raises(ValueError, match="share"):
        SlotReserve(share=share)


def served(limit: int) -> ServedModel:
    return ServedModel(
        ModelConfig("m", RoundRobinRouting(strategy="round_robin"), max_in_flight_per_worker=limit)
    )


BUSY_WITH_BATCH = [
    WorkerView(id=name, url=f"http://{name}", num_in_flight=3, num_background=3) for name in "ab"
]
"""Two workers of 4 slots, each with 3 batch lines: the part of background (4 less a quarter)."""


def test_decide_keeps_the_reserved_slot_for_an_urgent_request() -> None:
    with pytest.raises(UnroutableError) as refused:
        decide(served(4), BUSY_WITH_BATCH, RequestContext(model="m", priority=BATCH), QUARTER)
    assert refused.value.reason == "at_capacity"
    assert (
        decide(served(4), BUSY_WITH_BATCH, RequestContext(model="m", priority=0), QUARTER).worker.id in "ab"
    )
    no_reserve = SlotReserve(share=0.0)
    assert decide(served(4), BUSY_WITH_BATCH, RequestContext(model="m", priority=BATCH), no_reserve).worker


@pytest.mark.parametrize("priority", [0, 5, BATCH - 1, BATCH])
@pytest.mark.parametrize("limit", [0, 1, 4, 8])
def test_decide_opens_a_worker_exactly_when_the_slot_rule_does(priority: int, limit: int) -> None:
    """``decide`` applies ``may_take_slot`` (with the room worked out once) to background requests
    only: for a more urgent one the limit on all requests in flight (this replica's and the others')
    says the same, on every split of a worker's requests between priorities and replicas."""
    for own_urgent in range(5):
        for own_batch in range(9):
            for elsewhere in (0, 2):
                num_in_flight = own_urgent + own_batch + elsewhere
                worker = WorkerView(
                    id="a",
                    url="http://a",
                    num_in_flight=num_in_flight,
                    num_background=own_batch,
                )
                opens = may_take_slot(
                    num_in_flight, own_batch, limit, background_room(priority, limit, QUARTER)
                )
                request = RequestContext(model="m", priority=priority)
                if opens:
                    assert decide(served(limit), [worker], request, QUARTER).worker.id == "a"
                else:
                    with pytest.raises(UnroutableError):
                        decide(served(limit), [worker], request, QUARTER)
