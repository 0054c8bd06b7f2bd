"""Prefix hash: consistent hashing of the prompt's leading blocks, with bounded loads.

Steps per request: the key is the chained hash of block ``k = min(prefix_blocks, full blocks)``,
which names the whole prompt prefix up to that block (``herd.api.kv_hash``), so prompts sharing
their first ``k`` blocks share a key. The key's point on a ketama ring (``_ring``: uhashring's
hash, 160 points per worker) gives the preferred worker; walking the ring clockwise gives the next
ones. The first worker under the bounded-load cap (see ``_load``) wins, so a hot prefix spills
over to its ring neighbours while every other prefix keeps its worker.

A prompt with no full block has nothing a worker could cache, so locality buys nothing: it goes to
the least loaded worker instead.

Cost: O(n) to index the candidates and compute the cap, O(log points) for the ring lookup, plus
a few steps per skipped worker. The ring holds every worker seen since it last left
(``forget_worker``); an unhealthy or busy worker is skipped, not removed, so health flaps do not
move keys, and the ring is rebuilt only when a new worker appears or one is forgotten.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import ClassVar

from herd.orchestrator.routing._load import bounded_load_cap, least_in_flight
from herd.orchestrator.routing._ring import HashRing
from herd.orchestrator.routing._types import RequestContext, RoutingStrategy, WorkerView

__all__ = ["PrefixHash"]


class PrefixHash(RoutingStrategy):
    name: ClassVar[str] = "prefix_hash"
    needs_tokens: ClassVar[bool] = True

    def __init__(self, *, load_factor: float, prefix_blocks: int, rng: random.Random) -> None:
        self._load_factor = load_factor
        self._prefix_blocks = prefix_blocks
        self._rng = rng
        self._ring = HashRing()

    def select(self, workers: Sequence[WorkerView], ctx: RequestContext) -> WorkerView | None:
        if not ctx.block_hashes:
            return least_in_flight(workers, self._rng)
        by_id = {worker.id: worker for worker in workers}
        self._ring.add(by_id.keys())
        cap = bounded_load_cap(workers, self._load_factor)
        key = ctx.block_hashes[min(self._prefix_blocks, len(ctx.block_hashes)) - 1]
        for worker_id in self._ring.walk(str(key)):
            worker = by_id.get(worker_id)
            if worker is not None and worker.num_in_flight < cap:
                return worker
        return None

    def forget_worker(self, worker_id: str) -> None:
        self._ring.remove(worker_id)
