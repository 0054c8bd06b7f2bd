"""The slots of each worker kept for urgent requests: background work may fill only part of them.

The gateway holds at most ``max_in_flight_per_worker`` requests on a worker (``engine.maxBatchSize +
engine.maxQueueLen``). Were background work (a batch job, at ``BATCH_PRIORITY``) let fill all of
them, an interactive request would wait in the gateway's queue for one of its lines to *end*, though
it is more urgent: the queue orders who gets the next free slot, it takes no slot back. So requests
at ``SlotReserve.priority`` or a larger number (less urgent) may hold at most the ``1 - share`` part
of each worker's slots between them, and the rest stays open to the more urgent ones; once such a
request is on the worker, the engine preempts a background sequence for it when its batch is full
(``herd.worker.scheduler``). llm-d's flow control and Dynamo keep similar per-band limits.

``may_take_slot`` is the rule, pure, over counts the views carry (no per-worker walk of a dict, as a
batch line's decision asks it of every worker) and the request's ``background_room``, worked out once
a decision; ``decide`` applies it to background requests in its capacity filter (a more urgent
request may take any slot under the limit, which the filter checks anyway).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = [
    "BACKGROUND_PRIORITY",
    "DEFAULT_RESERVE",
    "SlotReserve",
    "background_limit",
    "background_room",
    "may_take_slot",
]

BACKGROUND_PRIORITY = 1000
"""The least urgent priority (``herd.orchestrator.admission.tenants.LOWEST_PRIORITY``, the batch's)."""


@dataclass(frozen=True, slots=True)
class SlotReserve:
    share: float = 0.25
    """The part of each worker's slots that background requests may not take (0: none is kept)."""
    priority: int = BACKGROUND_PRIORITY
    """Requests at this priority number or larger are background."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.share < 1.0:
            raise ValueError(f"the slot reserve's share must be in [0, 1), got {self.share}")


DEFAULT_RESERVE = SlotReserve()


def background_limit(cap: int, reserve: SlotReserve) -> int:
    """The slots background requests may hold on a worker of ``cap`` slots (0: no limit): ``cap`` less
    the reserve (rounded up), but at least one, so background work always progresses."""
    if not cap:
        return 0
    return max(1, cap - math.ceil(cap * reserve.share))


def background_room(priority: int, cap: int, reserve: SlotReserve) -> int:
    """How many background requests a worker of ``cap`` slots (0: no limit) may hold and still take a
    request of ``priority``: ``background_limit`` for a background request; ``cap`` for a more urgent
    one, which may use every slot (its background requests are fewer than ``cap`` while one is free).
    The same for every worker: ``decide`` works it out once a decision, not once a worker."""
    return background_limit(cap, reserve) if priority >= reserve.priority else cap


def may_take_slot(num_in_flight: int, num_background: int, cap: int, room: int) -> bool:
    """Whether a request may take a slot on a worker of ``cap`` slots (0: no limit) holding
    ``num_in_flight`` requests, ``num_background`` of them this replica's at the reserve's priority or
    a larger number (``WorkerView.num_background``, counted by the registry as requests are held and
    released), ``room`` being the request's ``background_room``."""
    return not cap or (num_in_flight < cap and num_background < room)
