"""The orchestrator's global KV index: which workers hold which prefix-cache blocks.

Fed (pushed in, no I/O here) by the registry from each worker's KV event batches and snapshots.
Events are numbered per worker ``epoch``; each worker's ``(epoch, last seq)`` is kept so that

* an already-applied event (``seq <= last``) is skipped: batches that arrive twice, e.g. from several
  orchestrator replicas through Redis, are harmless;
* a gap (``seq > last + 1``) or a new epoch stops the batch and ``apply`` returns ``False``: the caller
  must fetch a snapshot and call ``reset``. Until then the worker keeps its (possibly stale) entries;
  staleness costs only routing quality, never correctness.

Cost: ``apply`` is O(blocks in the batch), ``reset`` and ``remove_worker`` O(blocks the worker holds),
``match`` O(k x w) for the leading run of k matched blocks over the w workers still matching (it
stops at the first block no worker holds), ``num_blocks`` O(1). Memory: one dict entry per distinct
block plus one set entry per (block, worker).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from herd.api.kv_hash import BlockHash
from herd.api.protocol import KVEvent, KVEventBatch, KVSnapshot

__all__ = ["KVIndex"]


@dataclass(slots=True)
class _WorkerState:
    epoch: str
    last_seq: int
    blocks: set[BlockHash] = field(default_factory=set)


class KVIndex:
    """Block hash -> ids of the workers whose prefix cache holds that block."""

    def __init__(self) -> None:
        self._holders: dict[BlockHash, set[str]] = {}
        self._workers: dict[str, _WorkerState] = {}

    def apply(self, worker_id: str, batch: KVEventBatch) -> bool:
        """Apply a worker's events in order; ``False`` means a gap or a new epoch: resync with ``reset``."""
        state = self._workers.get(worker_id)
        if state is None or state.epoch != batch.epoch:
            return False
        for event in batch.events:
            if event.seq <= state.last_seq:
                continue
            if event.seq != state.last_seq + 1:
                return False
            self._apply_event(worker_id, state, event)
            state.last_seq = event.seq
        return True

    def reset(self, worker_id: str, snapshot: KVSnapshot) -> None:
        """Replace everything known about a worker with its snapshot (events up to ``snapshot.seq``)."""
        self.remove_worker(worker_id)
        state = _WorkerState(epoch=snapshot.epoch, last_seq=snapshot.seq)
        self._workers[worker_id] = state
        self._store(worker_id, state, snapshot.block_hashes)

    def remove_worker(self, worker_id: str) -> None:
        """Forget a worker that left (or is about to be resynced)."""
        state = self._workers.pop(worker_id, None)
        if state is not None:
            self._remove(worker_id, state, list(state.blocks))

    def match(self, block_hashes: Sequence[BlockHash]) -> dict[str, int]:
        """Length of the leading run of ``block_hashes`` each worker holds (workers with none omitted)."""
        run: dict[str, int] = {}
        alive: set[str] | None = None
        for depth, block in enumerate(block_hashes):
            holders = self._holders.get(block)
            if not holders:
                break
            alive = set(holders) if alive is None else alive & holders
            if not alive:
                break
            for worker_id in alive:
                run[worker_id] = depth + 1
        return run

    def num_blocks(self, worker_id: str) -> int:
        state = self._workers.get(worker_id)
        return 0 if state is None else len(state.blocks)

    def workers(self) -> list[str]:
        return sorted(self._workers)

    def position(self, worker_id: str) -> tuple[str, int] | None:
        """The worker's ``(epoch, last applied seq)``, or ``None`` if it was never reset."""
        state = self._workers.get(worker_id)
        return None if state is None else (state.epoch, state.last_seq)

    def _apply_event(self, worker_id: str, state: _WorkerState, event: KVEvent) -> None:
        if event.kind == "stored":
            self._store(worker_id, state, event.block_hashes)
        elif event.kind == "removed":
            self._remove(worker_id, state, event.block_hashes)
        else:
            self._remove(worker_id, state, list(state.blocks))

    def _store(self, worker_id: str, state: _WorkerState, blocks: Iterable[BlockHash]) -> None:
        for block in blocks:
            state.blocks.add(block)
            self._holders.setdefault(block, set()).add(worker_id)

    def _remove(self, worker_id: str, state: _WorkerState, blocks: Iterable[BlockHash]) -> None:
        for block in blocks:
            state.blocks.discard(block)
            holders = self._holders.get(block)
            if holders is None:
                continue
            holders.discard(worker_id)
            if not holders:
                del self._holders[block]
