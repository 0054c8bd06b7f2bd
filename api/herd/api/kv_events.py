"""The prefix cache's change log: numbered ``stored`` / ``removed`` events for the router's KV index."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import Literal

from herd.api.kv_hash import BlockHash
from herd.api.protocol import KVEvent

__all__ = ["KVEventBuffer"]


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

    def record(self, kind: Literal["stored", "removed", "cleared"], hashes: Iterable[BlockHash]) -> None:
        block_hashes = list(hashes)
        if not block_hashes and kind != "cleared":
            return
        self._last_seq += 1
        self._pending.append(KVEvent(seq=self._last_seq, kind=kind, block_hashes=block_hashes))

    def drain(self) -> list[KVEvent]:
        events = list(self._pending)
        self._pending.clear()
        return events
