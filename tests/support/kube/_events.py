"""The store's change log: every write gets the next global resourceVersion and one event here.

Watches replay the log from the resourceVersion they resume at and then wait for news. The log is
bounded: a watch resuming before its oldest entry gets ``410 Gone``, as from a compacted etcd.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass
from typing import Any

from ._errors import gone

__all__ = ["EventLog", "StoreEvent"]


@dataclass(frozen=True)
class StoreEvent:
    """One change; ``obj`` and ``previous`` are the store's own (never mutated) dicts."""

    resource_version: int
    type: str
    storage_key: tuple[str, str]
    obj: dict[str, Any]
    previous: dict[str, Any] | None


class EventLog:
    def __init__(self, size: int = 20_000) -> None:
        self._events: deque[StoreEvent] = deque(maxlen=size)
        self._changed = asyncio.Event()
        self.is_closed = False

    def append(self, event: StoreEvent) -> None:
        self._events.append(event)
        self._wake()

    def close(self) -> None:
        """Wake every watcher for good: the server is stopping."""
        self.is_closed = True
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    @property
    def changed(self) -> asyncio.Event:
        """Set on the next append; take it before reading ``since`` so no wake-up is lost."""
        return self._changed

    def since(self, resource_version: int) -> list[StoreEvent]:
        """Events newer than ``resource_version``, oldest first; 410 where some were dropped."""
        if self._events and resource_version + 1 < self._events[0].resource_version:
            raise gone(
                f"too old resource version: {resource_version} ({self._events[0].resource_version - 1})"
            )
        newer: list[StoreEvent] = []
        for event in reversed(self._events):
            if event.resource_version <= resource_version:
                break
            newer.append(event)
        newer.reverse()
        return newer
