"""The orchestrator's global KV index: which workers hold which prefix-cache blocks.

Fed (pushed in, no I/O here) by the registry from each worker's KV event batches and snapshots.
Events are numbered per worker ``epoch``; each worker's ``(epoch, last seq)`` is kept so that

* an already-applied event (``seq <= last``) is skipped: batches that arrive twice, e.g. from several
  orchestrator replicas through Redis, are harmless;
* a gap (``seq > last + 1``) or a new epoch stops the batch and ``apply`` returns ``False``: the caller
  must fetch a snapshot and call ``reset``. Until then the worker keeps its (possibly stale) entries;
  staleness costs only routing quality, never correctness.

Expected blocks: events arrive only after a worker has computed a prompt's blocks (its prefill plus
a polling interval), so a tenant's next request, routed meanwhile, would see no cached prefix
anywhere and go by load alone, duplicating the prefix on another worker. ``expect`` records that a
routed request's blocks are about to exist on its worker; ``match`` counts them until the worker's
own events take over, a ``removed`` event or resync drops them, or ``expected_ttl_s`` passes.

Tiers: a worker's events name the tier (``medium``) a block entered or left. The device's holdings
are the index above; the tiers below it (host, disk) are kept apart, per worker, in a second map
whose values say which of them hold the block. ``match`` counts the device (and expected blocks);
``match_tiers`` counts the leading run in any tier and how much of it each worker would restore from
its host and its disk tier, which routing by cost prices with the worker's measured bandwidths.

Cost: ``apply`` is O(blocks in the batch), ``reset`` and ``remove_worker`` O(blocks the worker holds),
``match`` O(k x w) for the leading run of k matched blocks over the w workers still matching (it
stops at the first block no worker holds), ``num_blocks`` and ``held_blocks`` O(1). Memory: one dict entry per distinct
block plus one set entry per (block, worker).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property

from herd.api.kv_hash import BlockHash
from herd.api.protocol import KVEvent, KVEventBatch, KVSnapshot, Medium

__all__ = ["KVIndex", "PromptMatch", "TierRun"]

_TIER_BITS: dict[Medium, int] = {"host": 1, "disk": 2}


@dataclass(slots=True, frozen=True)
class TierRun:
    """A worker's leading run of a prompt's blocks over every tier: ``length`` blocks, of which
    ``host`` and ``disk`` are held only there (a restore brings them back); the rest on the device."""

    length: int
    host: int = 0
    disk: int = 0

    @property
    def device(self) -> int:
        return self.length - self.host - self.disk


@dataclass(slots=True)
class _WorkerState:
    epoch: str
    last_seq: int
    blocks: set[BlockHash] = field(default_factory=set)
    tiers: dict[Medium, set[BlockHash]] = field(default_factory=dict)


class KVIndex:
    """Block hash -> ids of the workers whose prefix cache holds that block."""

    def __init__(self, *, expected_ttl_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._holders: dict[BlockHash, set[str]] = {}
        self._lower: dict[BlockHash, dict[str, int]] = {}
        """Block -> worker -> the tiers below its device holding it (``_TIER_BITS`` or'ed)."""
        self._workers: dict[str, _WorkerState] = {}
        self._num_held: dict[str, int] = {}
        """``len(blocks)`` of every worker's state, kept for the routing score's read of every worker."""
        self._expected: dict[BlockHash, dict[str, float]] = {}
        self._num_expected: dict[str, int] = {}
        """Blocks expected per worker (an entry of ``_expected``), kept as ``_num_held`` is."""
        self._expiries: deque[tuple[float, str, Sequence[BlockHash]]] = deque()
        self._expected_ttl_s = expected_ttl_s
        self._clock = clock

    def expect(self, worker_id: str, block_hashes: Sequence[BlockHash]) -> None:
        """A request with these blocks was just routed to ``worker_id``: count them as held there."""
        now = self._clock()
        self._expire(now)
        deadline = now + self._expected_ttl_s
        for block in block_hashes:
            workers = self._expected.setdefault(block, {})
            if worker_id not in workers:
                self._num_expected[worker_id] = self._num_expected.get(worker_id, 0) + 1
            workers[worker_id] = deadline
        self._expiries.append((deadline, worker_id, block_hashes))

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
        for medium, blocks in snapshot.tier_block_hashes.items():
            self._store_tier(worker_id, state, medium, blocks)

    def remove_worker(self, worker_id: str) -> None:
        """Forget a worker that left (or is about to be resynced)."""
        state = self._workers.pop(worker_id, None)
        if state is not None:
            self._remove(worker_id, state, list(state.blocks))
            self._clear_tiers(worker_id, state)
        self._num_held.pop(worker_id, None)
        self._unexpect_worker(worker_id)

    def match(
        self, block_hashes: Sequence[BlockHash], *, include_expected: bool = True, include_host: bool = False
    ) -> dict[str, int]:
        """Length of the leading run of ``block_hashes`` each worker holds on its device or, with
        ``include_expected``, is expected to hold, or, with ``include_host``, holds in its host tier
        (workers with none omitted). Without expected blocks and with the host tier: what a worker can
        lend a peer (a lease restores its host blocks first; never its disk's)."""
        self._expire(self._clock())
        run: dict[str, int] = {}
        alive: set[str] | None = None
        for depth, block in enumerate(block_hashes):
            holders = self._holders.get(block)
            expected = self._expected.get(block) if include_expected else None
            if expected:
                holders = holders | expected.keys() if holders else set(expected)
            if include_host and (lower := self._lower.get(block)):
                in_host = {worker_id for worker_id, bits in lower.items() if bits & _TIER_BITS["host"]}
                holders = holders | in_host if holders else in_host
            if not holders:
                break
            alive = set(holders) if alive is None else alive & holders
            if not alive:
                break
            for worker_id in alive:
                run[worker_id] = depth + 1
        return run

    def held_run(self, worker_id: str, block_hashes: Sequence[BlockHash], *, start: int = 0) -> int:
        """Length of the leading run of ``block_hashes`` that ``worker_id`` holds in any tier or is
        expected to hold on its device: the blocks it will not compute, restores included. ``start``:
        a run already known (``match``), checked from there on."""
        self._expire(self._clock())
        for depth in range(start, len(block_hashes)):
            block = block_hashes[depth]
            if (
                worker_id not in self._holders.get(block, ())
                and worker_id not in self._expected.get(block, ())
                and worker_id not in self._lower.get(block, ())
            ):
                return depth
        return len(block_hashes)

    def match_tiers(self, block_hashes: Sequence[BlockHash]) -> dict[str, TierRun]:
        """Each worker's leading run of ``block_hashes`` held in any tier (or expected on its
        device), with how many of its blocks only a lower tier holds (workers with none omitted)."""
        if not self._lower:
            return {worker_id: TierRun(length) for worker_id, length in self.match(block_hashes).items()}
        self._expire(self._clock())
        run: dict[str, int] = {}
        restores: dict[str, list[int]] = {}
        alive: set[str] | None = None
        for depth, block in enumerate(block_hashes):
            device = self._holders.get(block, set())
            expected = self._expected.get(block)
            if expected:
                device = device | expected.keys()
            lower = self._lower.get(block, {})
            holders = device | lower.keys() if lower else device
            alive = set(holders) if alive is None else alive & holders
            if not alive:
                break
            for worker_id in alive:
                run[worker_id] = depth + 1
                if worker_id not in device:  # the host tier first: the faster restore
                    restores.setdefault(worker_id, [0, 0])[0 if lower[worker_id] & 1 else 1] += 1
        return {
            worker_id: TierRun(length, *restores.get(worker_id, (0, 0))) for worker_id, length in run.items()
        }

    def tier_blocks(self, worker_id: str) -> dict[Medium, int]:
        """Blocks each tier below the device holds for ``worker_id``."""
        state = self._workers.get(worker_id)
        return {} if state is None else {medium: len(blocks) for medium, blocks in state.tiers.items()}

    def num_blocks(self, worker_id: str) -> int:
        return self._num_held.get(worker_id, 0)

    def held_blocks(self) -> Mapping[str, int]:
        """Blocks held per worker (workers with none may be absent): a live view, to read, not to keep."""
        return self._num_held

    def expected_blocks(self) -> Mapping[str, int]:
        """Blocks expected per worker (``expect``; workers with none may be absent): a live view."""
        return self._num_expected

    def workers(self) -> list[str]:
        return sorted(self._workers)

    def position(self, worker_id: str) -> tuple[str, int] | None:
        """The worker's ``(epoch, last applied seq)``, or ``None`` if it was never reset."""
        state = self._workers.get(worker_id)
        return None if state is None else (state.epoch, state.last_seq)

    def _apply_event(self, worker_id: str, state: _WorkerState, event: KVEvent) -> None:
        if event.kind == "cleared":
            self._remove(worker_id, state, list(state.blocks))
            self._clear_tiers(worker_id, state)
            self._unexpect_worker(worker_id)
        elif event.medium != "device":
            store = event.kind == "stored"
            (self._store_tier if store else self._remove_tier)(
                worker_id, state, event.medium, event.block_hashes
            )
        elif event.kind == "stored":
            self._store(worker_id, state, event.block_hashes)
        else:
            self._remove(worker_id, state, event.block_hashes)

    def _store_tier(
        self, worker_id: str, state: _WorkerState, medium: Medium, blocks: Iterable[BlockHash]
    ) -> None:
        bit = _TIER_BITS[medium]
        held = state.tiers.setdefault(medium, set())
        for block in blocks:
            held.add(block)
            workers = self._lower.setdefault(block, {})
            workers[worker_id] = workers.get(worker_id, 0) | bit

    def _remove_tier(
        self, worker_id: str, state: _WorkerState, medium: Medium, blocks: Iterable[BlockHash]
    ) -> None:
        bit = _TIER_BITS[medium]
        held = state.tiers.get(medium, set())
        for block in blocks:
            held.discard(block)
            workers = self._lower.get(block)
            if workers is None or worker_id not in workers:
                continue
            mask = workers[worker_id] & ~bit
            if mask:
                workers[worker_id] = mask
            else:
                del workers[worker_id]
                if not workers:
                    del self._lower[block]

    def _clear_tiers(self, worker_id: str, state: _WorkerState) -> None:
        for medium, blocks in list(state.tiers.items()):
            self._remove_tier(worker_id, state, medium, list(blocks))

    def _store(self, worker_id: str, state: _WorkerState, blocks: Iterable[BlockHash]) -> None:
        for block in blocks:
            state.blocks.add(block)
            self._holders.setdefault(block, set()).add(worker_id)
        self._num_held[worker_id] = len(state.blocks)

    def _remove(self, worker_id: str, state: _WorkerState, blocks: Iterable[BlockHash]) -> None:
        for block in blocks:
            self._unexpect(worker_id, block)
            state.blocks.discard(block)
            holders = self._holders.get(block)
            if holders is None:
                continue
            holders.discard(worker_id)
            if not holders:
                del self._holders[block]
        self._num_held[worker_id] = len(state.blocks)

    def _unexpect(self, worker_id: str, block: BlockHash) -> None:
        expected = self._expected.get(block)
        if expected is None or expected.pop(worker_id, None) is None:
            return
        self._num_expected[worker_id] -= 1
        if not expected:
            del self._expected[block]

    def _unexpect_worker(self, worker_id: str) -> None:
        for block in [block for block, workers in self._expected.items() if worker_id in workers]:
            self._unexpect(worker_id, block)

    def _expire(self, now: float) -> None:
        """Drop expectations past their deadline (oldest first: deadlines grow with time)."""
        while self._expiries and self._expiries[0][0] <= now:
            deadline, worker_id, blocks = self._expiries.popleft()
            for block in blocks:
                expected = self._expected.get(block)
                # A later expect() of the same block on the same worker extended the deadline.
                if expected is not None and expected.get(worker_id) == deadline:
                    self._unexpect(worker_id, block)


class PromptMatch:
    """One prompt's leading runs in ``index``, each kind walked at most once: the steps of one routing
    decision (the strategy, the decision's own counts, a peer pull) read them in several ways.

    The answers are those of the moment each was first read; build one for each decision and drop it
    with the decision (a decision is synchronous: the index does not change meanwhile).
    """

    def __init__(self, index: KVIndex, block_hashes: Sequence[BlockHash]) -> None:
        self.index = index
        self.block_hashes = block_hashes

    @cached_property
    def device(self) -> dict[str, int]:
        """``KVIndex.match``: each worker's leading run on its device, expected blocks included."""
        return self.index.match(self.block_hashes) if self.block_hashes else {}

    @cached_property
    def lendable(self) -> dict[str, int]:
        """Each worker's leading run a peer can pull from it (``KVIndex.match``, on its device or in
        its host tier by its events alone)."""
        if not self.block_hashes:
            return {}
        return self.index.match(self.block_hashes, include_expected=False, include_host=True)

    @cached_property
    def tiers(self) -> dict[str, TierRun]:
        """``KVIndex.match_tiers``: each worker's leading run over every tier."""
        return self.index.match_tiers(self.block_hashes) if self.block_hashes else {}

    def held_run(self, worker_id: str) -> int:
        """``KVIndex.held_run`` of one worker: read off ``tiers`` when something walked them (a
        ``cached_property`` keeps its value in the instance's ``__dict__``), else that worker's own
        walk from the end of its device run."""
        if (tiers := vars(self).get("tiers")) is not None:
            run = tiers.get(worker_id)
            return 0 if run is None else run.length
        return self.index.held_run(worker_id, self.block_hashes, start=self.device.get(worker_id, 0))
