"""The prefix cache's change log: numbered ``stored`` / ``removed`` events for the router's KV index,
and the feed that serves them on the internal port."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncGenerator, Iterable
from typing import Literal

from herd.api.kv_hash import BlockHash
from herd.api.protocol import KVEvent, Medium

__all__ = ["KVEventBuffer", "KVEventFeed"]


class KVEventBuffer:
    """The block manager's events waiting for the engine's next drain; ``seq`` strictly increases
    over the engine's life.

    At most ``max_pending`` events wait for a drain; older ones are dropped, and the gap in ``seq``
    tells the receiver to resync from a snapshot (an engine nobody drains stays bounded).
    """

    def __init__(self, max_pending: int = 65536) -> None:
        self._last_seq = 0
        self._pending: deque[KVEvent] = deque(maxlen=max_pending)

    @property
    def last_seq(self) -> int:
        """The ``seq`` of the newest event recorded (0 before any)."""
        return self._last_seq

    def record(
        self,
        kind: Literal["stored", "removed", "cleared"],
        hashes: Iterable[BlockHash],
        medium: Medium = "device",
    ) -> None:
        block_hashes = list(hashes)
        if not block_hashes and kind != "cleared":
            return
        self._last_seq += 1
        self._pending.append(KVEvent(seq=self._last_seq, kind=kind, block_hashes=block_hashes, medium=medium))

    def drain(self) -> list[KVEvent]:
        events = list(self._pending)
        self._pending.clear()
        return events


class KVEventFeed:
    """The published KV events: the last ``max_logged`` replayed to pollers (one that falls further
    behind sees a gap and asks for a snapshot), each new one pushed to every live subscriber's queue;
    event-loop side only. A herd worker's engine and the vLLM sidecar serve their events from one."""

    def __init__(self, max_logged: int = 65536) -> None:
        self._log: deque[KVEvent] = deque(maxlen=max_logged)
        self._subscribers: set[asyncio.Queue[KVEvent]] = set()
        self._changed = asyncio.Event()
        self.num_published = 0

    def publish(self, events: list[KVEvent]) -> None:
        self.num_published += len(events)
        self._log.extend(events)
        for subscriber in self._subscribers:
            for event in events:
                subscriber.put_nowait(event)
        self._changed.set()

    async def after(self, seq: int, *, wait: float) -> list[KVEvent]:
        deadline = time.monotonic() + wait
        while True:
            self._changed.clear()
            events = [event for event in self._log if event.seq > seq]
            remaining = deadline - time.monotonic()
            if events or remaining <= 0:
                return events
            try:
                await asyncio.wait_for(self._changed.wait(), remaining)
            except TimeoutError:
                return []

    async def subscribe(self) -> AsyncGenerator[KVEvent, None]:
        events: asyncio.Queue[KVEvent] = asyncio.Queue()
        self._subscribers.add(events)
        try:
            while True:
                yield await events.get()
        finally:
            self._subscribers.discard(events)
