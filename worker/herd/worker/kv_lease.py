"""KV leases: blocks a prefill worker holds for a decode worker until it has pulled them.

A lease pins the prompt's leading cached blocks (one extra reference each) so that eviction cannot
take them before the decode side copies them. It ends when the decode side releases it, or when
it expires (the decode worker died or never came): then its blocks are released all the same and
the expiry is counted. The table is plain data; the worker's disaggregation routes own the clock
sweep and the engine calls.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from herd.api.kv_hash import BlockHash

__all__ = ["DEFAULT_LEASE_SECONDS", "MAX_LEASE_SECONDS", "Lease", "LeaseTable"]

DEFAULT_LEASE_SECONDS = 30.0
MAX_LEASE_SECONDS = 600.0


@dataclass(frozen=True, slots=True)
class Lease:
    request_id: str
    block_ids: list[int]
    block_hashes: list[BlockHash]
    expires_at: float

    def block_ids_for(self, block_hashes: list[BlockHash]) -> list[int] | None:
        """The ids of ``block_hashes`` under this lease, in order; ``None`` if one is not leased."""
        position = {block_hash: index for index, block_hash in enumerate(self.block_hashes)}
        if any(block_hash not in position for block_hash in block_hashes):
            return None
        return [self.block_ids[position[block_hash]] for block_hash in block_hashes]


class LeaseTable:
    """Live leases by request id; ``clock`` is monotonic seconds (injectable for tests)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._leases: dict[str, Lease] = {}

    def __len__(self) -> int:
        return len(self._leases)

    def add(
        self, request_id: str, block_ids: list[int], block_hashes: list[BlockHash], seconds: float
    ) -> Lease:
        if request_id in self._leases:
            raise ValueError(f"a lease for request {request_id!r} exists already: use a unique request id")
        lease = Lease(request_id, list(block_ids), list(block_hashes), self.clock() + seconds)
        self._leases[request_id] = lease
        return lease

    def get(self, request_id: str) -> Lease | None:
        """The live lease, or ``None`` if unknown or expired (an expired one waits for ``pop_expired``)."""
        lease = self._leases.get(request_id)
        return lease if lease is not None and lease.expires_at > self.clock() else None

    def pop(self, request_id: str) -> Lease | None:
        return self._leases.pop(request_id, None)

    def pop_expired(self) -> list[Lease]:
        now = self.clock()
        expired = [lease for lease in self._leases.values() if lease.expires_at <= now]
        for lease in expired:
            del self._leases[lease.request_id]
        return expired

    def next_expiry(self) -> float | None:
        return min((lease.expires_at for lease in self._leases.values()), default=None)
