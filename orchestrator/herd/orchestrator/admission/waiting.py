"""Requests waiting for a worker: each model's ``FairQueue`` with an asyncio future per request.

A request that finds every worker of its model full (or others already waiting) gets in line
(``ModelQueue.wait``) and sleeps until a worker frees a slot: the registry calls ``wake`` whenever
a request on the model ends or a worker is admitted, and ``wake`` hands the turn to the next request
by priority and fair share. The woken request then routes; if another request took the slot first
(another replica, a retry, a more urgent newcomer), it goes back to the head of its line. While a
woken request has not routed yet, newcomers as urgent as it or less queue behind it instead of taking
its slot; a newcomer more urgent than every waiting and woken request tries to route at once
(``is_open_to``): batch lines waiting for a slot do not hold an interactive request back.

A request leaves the line with ``QueueRefusalError`` (the gateway's 429 with ``Retry-After``) when the
line is full and it is the least urgent, when a more urgent newcomer sheds it, or when it waited
``max_wait_seconds``. A client that leaves while waiting is removed, and a turn it was given passes on.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from herd.orchestrator.admission.fair_queue import FairQueue, QueueEntry

__all__ = ["ModelQueue", "QueueRefusalError", "QueueSettings", "Turn"]

RefusalReason = Literal["queue_full", "shed", "timed_out"]


@dataclass(frozen=True, slots=True)
class QueueSettings:
    max_size: int = 1024
    """Requests that may wait per model (per gateway replica)."""
    max_wait_seconds: float = 30.0
    """Longest a request waits for a worker before its 429."""


class QueueRefusalError(Exception):
    def __init__(self, reason: RefusalReason) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(eq=False)
class Turn:
    """A request's place in line; ``future`` resolves when it may route (or fails with its refusal)."""

    future: asyncio.Future[None]
    entry: QueueEntry[Turn] | None = None
    is_woken: bool = False


class ModelQueue:
    """One model's line; ``charge`` keeps its tenants' virtual token counters."""

    def __init__(self, settings: QueueSettings, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self.clock = clock
        self.fair: FairQueue[Turn] = FairQueue(
            max_size=settings.max_size, max_wait_seconds=settings.max_wait_seconds
        )
        self._woken: Counter[int] = Counter()
        """The priorities of the requests holding a turn (woken, not routed yet)."""

    def is_open_to(self, priority: int) -> bool:
        """A newcomer of ``priority`` may route at once: every request waiting or holding a turn is
        less urgent (or there is none)."""
        waiting = self.fair.most_urgent
        woken = min(self._woken, default=None)
        return all(urgent is None or urgent > priority for urgent in (waiting, woken))

    def charge(self, tenant: str, num_tokens: float, weight: float) -> None:
        self.fair.charge(tenant, num_tokens, weight)

    async def wait(self, turn: Turn | None, *, tenant: str, priority: int, weight: float) -> Turn:
        """Wait for a turn (``turn``: the one a request had and lost, back at its line's head); the turn
        returned must be ``done`` once the request routed or gave up. Raises ``QueueRefusalError``."""
        if turn is None:
            loop = asyncio.get_running_loop()
            turn = Turn(loop.create_future())
            turn.entry = QueueEntry(turn, tenant, priority, self.clock(), weight)
            shed = self.fair.push(turn.entry)
            if shed is turn.entry:
                raise QueueRefusalError("queue_full")
            if shed is not None:
                shed.item.future.set_exception(QueueRefusalError("shed"))
        else:
            self._give_back(turn)
        await self._sleep(turn)
        return turn

    def done(self, turn: Turn) -> None:
        """The request with ``turn`` routed, or left: its turn is over."""
        if turn.is_woken:
            assert turn.entry is not None
            turn.is_woken = False
            self._woken[turn.entry.priority] -= 1
            if not self._woken[turn.entry.priority]:
                del self._woken[turn.entry.priority]

    def wake(self) -> None:
        """A worker has room: hand the turn to the next request in line."""
        for stale in self.fair.expired(self.clock()):
            _refuse(stale.item, "timed_out")
        entry = self.fair.pop()
        if entry is not None:
            entry.item.is_woken = True
            self._woken[entry.priority] += 1
            entry.item.future.set_result(None)

    def _give_back(self, turn: Turn) -> None:
        assert turn.entry is not None
        self.done(turn)
        turn.future = asyncio.get_running_loop().create_future()
        self.fair.requeue(turn.entry)

    async def _sleep(self, turn: Turn) -> None:
        assert turn.entry is not None
        remaining = turn.entry.enqueued_at + self.settings.max_wait_seconds - self.clock()
        try:
            async with asyncio.timeout(max(remaining, 0.0)):
                await asyncio.shield(turn.future)
        except TimeoutError:
            if not turn.future.done():
                self.fair.remove(turn.entry)
                raise QueueRefusalError("timed_out") from None
        except BaseException:
            if not turn.future.done():  # the client left while waiting
                self.fair.remove(turn.entry)
            elif turn.is_woken:  # it left holding a turn: pass the turn on
                self.done(turn)
                self.wake()
            raise
        turn.future.result()  # raises the refusal a shedding newcomer set


def _refuse(turn: Turn, reason: RefusalReason) -> None:
    if not turn.future.done():
        turn.future.set_exception(QueueRefusalError(reason))
