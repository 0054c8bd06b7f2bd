"""One model's waiting requests: by priority, then weighted fair share between tenants, bounded.

Requests wait here only while every worker of the model is full. ``pop`` takes the most urgent
priority present (the smallest number); within it, the tenant with the smallest virtual token
counter, and that tenant's oldest request. The counters are those of the Virtual Token Counter
(Sheng et al., "Fairness in Serving Large Language Models", OSDI 2024): a tenant's counter grows by
the tokens it is served divided by its weight (``charge``: the prompt and the expected output when a
request leaves the queue, the difference to the real output when it ends), so while two tenants are
both backlogged each gets the share of tokens its weight says, however many requests it sends. A
tenant that starts waiting is lifted to the smallest counter among those already waiting (to the
last served tenant's when none waits), so idle time earns no credit to burst with later.

Bounds: at most ``max_size`` requests wait; a newcomer to a full queue takes the place of the least
urgent waiting request (the newest of the largest priority number) when it is more urgent, else it
is refused. A request waits at most ``max_wait_seconds`` (``expired``). Every operation is O(number
of tenants waiting) or better; no I/O, no clock of its own (``now`` is passed in).
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Generic, TypeVar

__all__ = ["FairQueue", "QueueEntry"]

T = TypeVar("T")


@dataclass(eq=False)
class QueueEntry(Generic[T]):
    """A waiting request; ``item`` is what the caller gets back (the gateway's waiter)."""

    item: T
    tenant: str
    priority: int
    enqueued_at: float
    weight: float = 1.0
    seq: int = field(default=0, compare=False)


class FairQueue(Generic[T]):
    def __init__(self, *, max_size: int, max_wait_seconds: float) -> None:
        if max_size < 1 or max_wait_seconds <= 0:
            raise ValueError("a queue holds at least one request for a positive time")
        self.max_size = max_size
        self.max_wait_seconds = max_wait_seconds
        self._bands: dict[int, dict[str, deque[QueueEntry[T]]]] = {}
        """priority -> tenant -> its waiting requests, oldest first."""
        self._counters: dict[str, float] = {}
        self._floor = 0.0
        """The counter of the tenant served last: where a tenant arriving at an empty queue starts."""
        self._size = 0
        self._seq = itertools.count()

    def __len__(self) -> int:
        return self._size

    @property
    def most_urgent(self) -> int | None:
        """The smallest priority number waiting; ``None`` when none waits."""
        return min(self._bands) if self._bands else None

    def counter(self, tenant: str) -> float:
        return self._counters.get(tenant, 0.0)

    def push(self, entry: QueueEntry[T]) -> QueueEntry[T] | None:
        """Queue ``entry``; the entry shed to make room (``entry`` itself when it was refused), if any."""
        shed = None
        if self._size >= self.max_size:
            worst = self._least_urgent()
            if worst.priority <= entry.priority:
                return entry
            self.remove(worst)
            shed = worst
        entry.seq = next(self._seq)
        band = self._bands.setdefault(entry.priority, {})
        if not self._is_waiting(entry.tenant):
            self._lift(entry.tenant)
        band.setdefault(entry.tenant, deque()).append(entry)
        self._size += 1
        return shed

    def requeue(self, entry: QueueEntry[T]) -> None:
        """Put back, at the head of its tenant's line, an entry that ``pop`` gave out but that found
        every worker full again; it keeps its place in time and may push the queue past ``max_size``."""
        band = self._bands.setdefault(entry.priority, {})
        band.setdefault(entry.tenant, deque()).appendleft(entry)
        self._size += 1

    def pop(self) -> QueueEntry[T] | None:
        """The next request to serve, or ``None`` when none waits."""
        if not self._bands:
            return None
        band = self._bands[min(self._bands)]
        tenant = min(band, key=lambda name: (self.counter(name), band[name][0].seq))
        entry = band[tenant].popleft()
        self._drop_if_empty(entry)
        self._floor = self.counter(tenant)
        return entry

    def remove(self, entry: QueueEntry[T]) -> bool:
        """Take ``entry`` out (its client left, or it was shed); whether it was waiting."""
        line = self._bands.get(entry.priority, {}).get(entry.tenant)
        if line is None or entry not in line:
            return False
        line.remove(entry)
        self._drop_if_empty(entry)
        return True

    def expired(self, now: float) -> list[QueueEntry[T]]:
        """Remove and return every entry that has waited ``max_wait_seconds`` or more."""
        limit = now - self.max_wait_seconds
        stale = [
            entry
            for band in self._bands.values()
            for line in band.values()
            for entry in line
            if entry.enqueued_at <= limit
        ]
        for entry in stale:
            self.remove(entry)
        return stale

    def charge(self, tenant: str, num_tokens: float, weight: float = 1.0) -> None:
        """Count ``num_tokens`` served to ``tenant`` (negative: a refund of an over-estimate)."""
        self._counters[tenant] = self.counter(tenant) + num_tokens / weight

    def _least_urgent(self) -> QueueEntry[T]:
        band = self._bands[max(self._bands)]
        return max((line[-1] for line in band.values()), key=lambda entry: entry.seq)

    def _is_waiting(self, tenant: str) -> bool:
        return any(tenant in band for band in self._bands.values())

    def _lift(self, tenant: str) -> None:
        waiting = {name for band in self._bands.values() for name in band}
        floor = min(self.counter(name) for name in waiting) if waiting else self._floor
        self._counters[tenant] = max(self.counter(tenant), floor)

    def _drop_if_empty(self, entry: QueueEntry[T]) -> None:
        self._size -= 1
        band = self._bands[entry.priority]
        if not band[entry.tenant]:
            del band[entry.tenant]
            if not band:
                del self._bands[entry.priority]
