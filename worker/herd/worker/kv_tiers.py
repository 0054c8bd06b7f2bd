"""The KV tiers below the device pool: which block sits in which slot of the host and disk tiers.

Pure bookkeeping, as the block manager is: the runner owns the bytes and performs the ``KVMove``s a
plan lists. A tier holds ``num_slots`` blocks, each under its chained hash with its token ids (a hit
compares tokens, as the device cache does), evicted least recently used first. Tiers are inclusive: a
block restored to the device keeps its host copy, so evicting it from the device again costs no copy.

Within one step a slot is written or read at most in the order the plan lists its moves, and a slot
touched by the plan being built is pinned: it is never evicted again in that step. So each slot's
content at any point of the plan is what the bookkeeping says, and a runner may do all of a step's
disk writes, then its disk reads, before its other moves (the disk holds no slot the plan wrote before
reading or writing it). A tier whose every slot is pinned takes nothing more in that step.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from herd.api.kv_hash import BlockHash
from herd.api.protocol import Medium

__all__ = [
    "DISK_WRITE_QUEUE_BYTES",
    "KVMove",
    "KVTierError",
    "TierCache",
    "TierHit",
    "disk_write_queue_depth",
]

DISK_WRITE_QUEUE_BYTES = 256 * 2**20
"""The blocks queued for the disk tier, at most, before a step that demotes one waits for a write
(the engine's write-behind queue, and the simulated runner's model of it)."""


def disk_write_queue_depth(num_disk_slots: int, bytes_per_block: int) -> int:
    """How many demoted blocks may wait for the disk: ``DISK_WRITE_QUEUE_BYTES`` of them, at least one,
    and never more than the disk tier holds."""
    return min(num_disk_slots, max(1, DISK_WRITE_QUEUE_BYTES // bytes_per_block))


@dataclass(frozen=True, slots=True)
class KVMove:
    """Copy one block from slot ``src_slot`` of ``src`` to slot ``dst_slot`` of ``dst``."""

    src: Medium
    src_slot: int
    dst: Medium
    dst_slot: int


@dataclass(frozen=True, slots=True)
class TierHit:
    """A prompt block found in a tier below the device: restore it from ``slot``."""

    medium: Medium
    slot: int
    block_hash: BlockHash


@dataclass(slots=True)
class _Entry:
    block_hash: BlockHash
    token_ids: list[int]


class TierCache:
    """One tier's slots: ``hash -> slot``, an LRU order over the occupied slots, and the plan's pins."""

    def __init__(self, medium: Medium, num_slots: int) -> None:
        self.medium = medium
        self.num_slots = num_slots
        self.slots: dict[BlockHash, int] = {}
        self._entries: dict[int, _Entry] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._empty = list(range(num_slots - 1, -1, -1))
        self._pinned: set[int] = set()

    @property
    def num_used(self) -> int:
        return len(self._entries)

    def hashes(self) -> list[BlockHash]:
        return list(self.slots)

    def lookup(self, block_hash: BlockHash, token_ids: list[int]) -> int | None:
        """The slot holding ``block_hash`` with exactly ``token_ids``, else None."""
        slot = self.slots.get(block_hash)
        if slot is None or self._entries[slot].token_ids != token_ids:
            return None
        return slot

    def holds(self, slot: int) -> bool:
        return slot in self._entries

    def entry(self, slot: int) -> tuple[BlockHash, list[int]]:
        entry = self._entries[slot]
        return entry.block_hash, entry.token_ids

    def use(self, slot: int) -> None:
        """The plan reads or keeps ``slot``: most recently used, and pinned for this step."""
        self._lru.move_to_end(slot)
        self._pinned.add(slot)

    def victim(self) -> int | None:
        """The slot a new block would take: an empty one, else the least recently used unpinned one."""
        if self._empty:
            return self._empty[-1]
        return next((slot for slot in self._lru if slot not in self._pinned), None)

    def store(self, slot: int, block_hash: BlockHash, token_ids: list[int]) -> BlockHash | None:
        """Put ``block_hash`` into ``slot`` (from ``victim``), pinned; the hash it replaced, if any."""
        replaced = self.drop_slot(slot)
        if self._empty and self._empty[-1] == slot:
            self._empty.pop()
        self._entries[slot] = _Entry(block_hash, list(token_ids))
        self.slots[block_hash] = slot
        self._lru[slot] = None
        self._pinned.add(slot)
        return replaced

    def drop_slot(self, slot: int) -> BlockHash | None:
        """Empty ``slot``; the hash it held, if any."""
        entry = self._entries.pop(slot, None)
        if entry is None:
            return None
        del self.slots[entry.block_hash]
        del self._lru[slot]
        self._empty.append(slot)
        return entry.block_hash

    def clear(self) -> list[BlockHash]:
        """Empty every slot; the hashes held."""
        held = self.hashes()
        for slot in list(self._entries):
            self.drop_slot(slot)
        return held

    def end_plan(self) -> None:
        """The plan is complete: its pins lapse."""
        self._pinned.clear()


class KVTierError(RuntimeError):
    """A tier's storage failed (a disk read or write); the engine drops that tier and goes on."""

    def __init__(self, medium: Medium, message: str) -> None:
        super().__init__(message)
        self.medium = medium
