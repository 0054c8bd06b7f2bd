"""Paged KV blocks with a prefix cache, in the nano-vllm manner.

Every full block is registered under its chained ``herd.api.kv_hash`` hash in a ``hash -> block``
dict as soon as a step is planned to compute it (vLLM v1 caches at the same moment): a request
admitted in that same step, or while a long prompt's later chunks still run, shares the block
instead of computing it again, which works because a forward stores every new key and value before
any attention reads them. Should that step fail, ``forget`` drops those hashes. A new sequence walks its prompt's hashes and takes every leading block whose
hash is present and whose tokens match (the token comparison guards against hash collisions),
bumping reference counts. A block whose count drops to zero keeps its hash and joins the free list
(an LRU queue: eviction takes the head); the blocks of a sequence are freed in reverse so the tail
is evicted first and shared prefixes survive longest. Blocks that were never hashed go to the head,
so they are reused before any cached block is evicted. Registering and evicting a hash emit
``stored`` / ``removed`` events. Cost: one dict lookup and one token comparison per prompt block.

Tiers (``herd.worker.kv_tiers``): with a host tier, a hashed block the device evicts is copied there
first (the plan's ``KVMove``s, made by the runner before the forward that reuses the block), and the
host tier's own LRU victims go on to the disk tier when there is one. A prompt whose device hit ends
continues its walk in the host tier, then the disk tier: every further block found there is restored
onto a fresh device block (a move into it) instead of computed. Events name the tier (``medium``).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

from herd.api.kv_events import KVEventBuffer
from herd.api.kv_hash import BlockHash, hash_block
from herd.api.protocol import Medium
from herd.worker.kv_tiers import KVMove, TierCache, TierHit
from herd.worker.sequence import Sequence

__all__ = ["Block", "BlockManager", "HeldRun", "RunEnd", "TierCounters"]

RunEnd = Literal["whole", "not_cached", "on_disk", "no_free_block", "tier_failed"]
"""Why a lease of a peer's prompt blocks ended where it did: it held the whole run; the next block is
cached nowhere here; it is on the disk tier only (a lease never reads the disk); it is in the host
tier but no device block was free to restore it onto; or a tier failed while restoring (the engine
then holds nothing)."""


@dataclass(frozen=True, slots=True)
class HeldRun:
    """The blocks ``hold_cached`` holds for a peer, and why the run it was asked for ended there."""

    block_ids: list[int]
    end: RunEnd


@dataclass
class TierCounters:
    """Blocks moved per tier since start: ``stored`` into it, ``restored`` from it onto the device,
    ``evicted`` out of it for room (device evictions included)."""

    stored: Counter[Medium] = field(default_factory=Counter)
    restored: Counter[Medium] = field(default_factory=Counter)
    evicted: Counter[Medium] = field(default_factory=Counter)


@dataclass(eq=False)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: BlockHash | None = None
    token_ids: list[int] = field(default_factory=list)
    lora_name: str | None = None  # the adapter whose KV it holds: unloading the adapter forgets it


class BlockManager:
    """Owns the block pool: allocation, reference counts, the prefix cache and its events."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_prefix_caching: bool = True,
        num_host_blocks: int = 0,
        num_disk_blocks: int = 0,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}: raise the KV memory")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(block_id) for block_id in range(num_blocks)]
        self.cached: dict[BlockHash, int] = {}
        self.events = KVEventBuffer()
        self.counters = TierCounters()
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        has_host = enable_prefix_caching and num_host_blocks > 0
        self.host = TierCache("host", num_host_blocks) if has_host else None
        self.disk = TierCache("disk", num_disk_blocks) if has_host and num_disk_blocks > 0 else None
        self._moves: list[KVMove] = []
        self._restored: list[int] = []

    @property
    def num_total_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Share of blocks held by running sequences (free cached blocks count as free)."""
        return 1.0 - len(self._free) / len(self.blocks)

    def cached_hashes(self) -> list[BlockHash]:
        return list(self.cached)

    def tiers(self) -> list[TierCache]:
        """The tiers below the device, fastest first."""
        return [tier for tier in (self.host, self.disk) if tier is not None]

    def restore_run(self, seq: Sequence, start: int) -> list[TierHit | int]:
        """The cached run of ``seq`` on from block ``start`` (its device hit's end): blocks found in a
        lower tier, which a restore brings back, and device blocks after them, up to the first block
        cached nowhere; at least one token is left to compute. Device blocks follow restored ones
        when a peer pull imported blocks past a hole in the device's run whose blocks the host tier
        held: they are hits too, never restored (a restore would register a hash on a second block)."""
        if self.host is None:
            return []
        run: list[TierHit | int] = []
        hashes = self._hashes(seq, (seq.num_tokens - 1) // self.block_size)
        for index in range(start, len(hashes)):
            block_hash = hashes[index]
            if block_hash in self.cached:
                if (block_id := self._device_hit(seq, index, block_hash)) is None:
                    break
                run.append(block_id)
                continue
            tokens = seq.block_tokens(index, self.block_size)
            hit = next(
                (
                    TierHit(tier.medium, slot, block_hash)
                    for tier in self.tiers()
                    if (slot := tier.lookup(block_hash, tokens)) is not None
                ),
                None,
            )
            if hit is None:
                break
            run.append(hit)
        return run

    def end_plan(self) -> tuple[list[KVMove], list[int]]:
        """The moves the plan now complete needs, in order, and the device blocks it restores into."""
        moves, restored = self._moves, self._restored
        self._moves, self._restored = [], []
        for tier in self.tiers():
            tier.end_plan()
        return moves, restored

    def computed_blocks(self, seq: Sequence) -> list[int]:
        """Leading blocks of ``seq`` already in the cache; at least one token is left to compute."""
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        for index, block_hash in enumerate(self._hashes(seq, (seq.num_tokens - 1) // self.block_size)):
            if (block_id := self._device_hit(seq, index, block_hash)) is None:
                break
            hits.append(block_id)
        return hits

    def _device_hit(self, seq: Sequence, index: int, block_hash: BlockHash) -> int | None:
        """The device block cached under ``block_hash`` if it holds ``seq``'s block ``index`` (its
        tokens checked, so a hash collision is a miss); else None."""
        block_id = self.cached.get(block_hash)
        if block_id is None or self.blocks[block_id].token_ids != seq.block_tokens(index, self.block_size):
            return None
        return block_id

    def can_allocate(
        self, seq: Sequence, hits: list[int], num_new_tokens: int, restores: list[TierHit | int] | None = None
    ) -> bool:
        """Whether ``seq`` can start with its cached ``hits``, its ``restore_run`` and fresh blocks
        for ``num_new_tokens``."""
        restores = restores or []
        device = [*hits, *(entry for entry in restores if isinstance(entry, int))]
        num_cached = len(hits) + len(restores)
        num_fresh = self._num_blocks(num_cached * self.block_size + num_new_tokens) - len(device)
        num_revived = sum(1 for block_id in device if self.blocks[block_id].ref_count == 0)
        return num_fresh + num_revived <= len(self._free)

    def allocate(
        self, seq: Sequence, hits: list[int], num_new_tokens: int, restores: list[TierHit | int] | None = None
    ) -> None:
        """Give a waiting ``seq`` its cached ``hits``, its ``restore_run`` (lower-tier blocks restored
        onto fresh blocks, device blocks after them), and fresh blocks for ``num_new_tokens``."""
        restores = restores or []
        for block_id in [*hits, *(entry for entry in restores if isinstance(entry, int))]:
            self._take(block_id)  # taken first: a restore's fresh block must not evict a later hit
        for entry in restores:  # pinned first: the restores' own evictions must not take their sources
            if not isinstance(entry, int):
                self._tier(entry.medium).use(entry.slot)
        seq.block_table = [
            *hits,
            *(entry if isinstance(entry, int) else self._restore(entry) for entry in restores),
        ]
        seq.num_committed_blocks = len(seq.block_table)
        seq.num_computed_tokens = seq.num_committed_blocks * self.block_size
        if seq.num_preemptions == 0:
            seq.num_cached_tokens = seq.num_computed_tokens
        self.append_slots(seq, num_new_tokens)

    def can_append(self, seq: Sequence, num_new_tokens: int, *, num_kept_free: int = 0) -> bool:
        """Whether ``num_new_tokens`` more tokens fit with ``num_kept_free`` blocks left over."""
        return self._num_missing_blocks(seq, num_new_tokens) + num_kept_free <= len(self._free)

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grow the block table so ``num_new_tokens`` more tokens have slots."""
        for _ in range(self._num_missing_blocks(seq, num_new_tokens)):
            seq.block_table.append(self._take_fresh())

    def trim(self, seq: Sequence) -> None:
        """Release the blocks past those that hold ``seq``'s computed tokens: slots that were reserved
        for proposed tokens the target rejected. They were never committed, so they hold no hash."""
        keep = self._num_blocks(seq.num_computed_tokens)
        self.release(seq.block_table[keep:])
        del seq.block_table[keep:]

    def free(self, seq: Sequence) -> None:
        """Release ``seq``'s blocks, tail first; hashed blocks stay in the cache until evicted."""
        self.release(seq.block_table)
        seq.block_table = []

    def release(self, block_ids: list[int]) -> None:
        """Drop one reference on each of ``block_ids``, tail first, so shared prefixes survive longest."""
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
                if block.block_hash is None:
                    self._free.move_to_end(block_id, last=False)

    def check_references(self, holders: Iterable[list[int]]) -> None:
        """Raise ``RuntimeError`` unless each block's reference count is the number of ``holders``
        (block tables, leases) naming it and exactly the unreferenced blocks are free."""
        counts = Counter(block_id for table in holders for block_id in table)
        for block in self.blocks:
            is_free = block.block_id in self._free
            if block.ref_count != counts[block.block_id] or is_free != (block.ref_count == 0):
                raise RuntimeError(
                    f"KV block {block.block_id} has {block.ref_count} references, "
                    f"{counts[block.block_id]} holders and is{'' if is_free else ' not'} free"
                )

    def can_reset_prefix_cache(self) -> bool:
        """Only an idle pool can forget its cache: a held block's hash is what its holder reads."""
        return len(self._free) == len(self.blocks)

    def reset_prefix_cache(self) -> None:
        """Forget every cached block in every tier (all device blocks are free:
        ``can_reset_prefix_cache``); one ``cleared`` event."""
        for block in self.blocks:
            block.block_hash, block.token_ids = None, []
        self.cached.clear()
        for tier in self.tiers():
            tier.clear()
        self.events.record("cleared", [])

    def hold_prefix(self, block_hashes: list[BlockHash], *, restore: bool = False) -> list[int]:
        """Take a reference on the leading run of ``block_hashes`` still cached (a KV lease); their ids.

        With ``restore`` the run goes on through the host tier: a block found there is restored onto
        a fresh device block (its move planned: the caller makes it, ``end_plan``) while one is free.
        Not from the disk tier: a lease is taken between steps, and a disk read would hold the next.
        As on the device, the hash alone names the block (the chain makes a collision negligible)."""
        held: list[int] = []
        host = self.host if restore else None
        for block_hash in block_hashes:
            block_id = self.cached.get(block_hash)
            if block_id is not None:
                self._take(block_id)
            elif host is not None and (slot := host.slots.get(block_hash)) is not None and self._free:
                host.use(slot)  # pinned: the restores' own evictions must not take it
                block_id = self._restore(TierHit("host", slot, block_hash))
            else:
                break
            held.append(block_id)
        return held

    def run_end(self, block_hashes: list[BlockHash], num_held: int) -> RunEnd:
        """Why ``hold_prefix(block_hashes, restore=True)`` held only the first ``num_held`` (see
        ``RunEnd``), asked right after it."""
        if num_held == len(block_hashes):
            return "whole"
        block_hash = block_hashes[num_held]
        if self.host is not None and block_hash in self.host.slots:
            return "no_free_block"  # hold_prefix restores a host block whenever one is free
        if self.disk is not None and block_hash in self.disk.slots:
            return "on_disk"
        return "not_cached"

    def import_block(
        self, block_hash: BlockHash, token_ids: list[int], lora_name: str | None = None
    ) -> int | None:
        """Register a block received from a peer under ``block_hash``, held once; ``None`` if cached or full.

        The caller writes the block's KV, then ``release``s it: it stays cached, most recently used.
        """
        if not self.enable_prefix_caching or block_hash in self.cached or not self._free:
            return None
        block_id = self._take_fresh()
        block = self.blocks[block_id]
        block.block_hash, block.token_ids, block.lora_name = block_hash, list(token_ids), lora_name
        self.cached[block_hash] = block_id
        self.events.record("stored", [block_hash])
        return block_id

    def commit(self, seq: Sequence, num_tokens: int) -> list[int]:
        """Register the full blocks among ``seq``'s first ``num_tokens`` tokens (those computed, or
        planned in this step) in the prefix cache; the ids of the blocks newly registered."""
        num_full = num_tokens // self.block_size
        if not self.enable_prefix_caching or num_full <= seq.num_committed_blocks:
            return []
        stored: list[int] = []
        hashes = self._hashes(seq, num_full)
        for index in range(seq.num_committed_blocks, num_full):
            block = self.blocks[seq.block_table[index]]
            if block.block_hash is None and hashes[index] not in self.cached:
                block.block_hash, block.token_ids = hashes[index], seq.block_tokens(index, self.block_size)
                block.lora_name = seq.lora_name
                self.cached[hashes[index]] = block.block_id
                stored.append(index)
        seq.num_committed_blocks = num_full
        self.events.record("stored", [hashes[index] for index in stored])
        return [seq.block_table[index] for index in stored]

    def lora_blocks(self, lora_name: str) -> list[int]:
        """The cached blocks holding ``lora_name``'s KV (to ``forget`` when the adapter goes)."""
        return [
            block.block_id
            for block in self.blocks
            if block.block_hash is not None and block.lora_name == lora_name
        ]

    def forget(self, block_ids: list[int]) -> None:
        """Drop the hashes of ``block_ids`` (registered by a step that failed, so their KV is not
        what the hash says); free ones go to the head of the free list, as unhashed blocks do."""
        removed: list[BlockHash] = []
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.block_hash is None:
                continue
            del self.cached[block.block_hash]
            removed.append(block.block_hash)
            block.block_hash, block.token_ids = None, []
            if block.ref_count == 0:
                self._free.move_to_end(block_id, last=False)
        self.events.record("removed", removed)

    def forget_moves(self, moves: list[KVMove]) -> None:
        """Drop what ``moves`` wrote into the tiers below the device (a step that failed or was
        abandoned may not have made them); device targets are ``forget``'s."""
        for move in moves:
            tier = self._tier_or_none(move.dst)
            dropped = tier.drop_slot(move.dst_slot) if tier is not None else None
            if dropped is not None:
                self.events.record("removed", [dropped], move.dst)

    def disable_disk(self) -> None:
        """The disk tier failed: drop it and everything it held (one ``removed`` event)."""
        if self.disk is not None:
            self.events.record("removed", self.disk.clear(), "disk")
            self.disk = None

    def _tier(self, medium: Medium) -> TierCache:
        tier = self._tier_or_none(medium)
        if tier is None:
            raise ValueError(f"no {medium} tier")
        return tier

    def _tier_or_none(self, medium: Medium) -> TierCache | None:
        return self.host if medium == "host" else self.disk if medium == "disk" else None

    def _restore(self, hit: TierHit) -> int:
        """A fresh device block for ``hit``, registered under its hash; the plan copies it in."""
        _, token_ids = self._tier(hit.medium).entry(hit.slot)
        block_id = self._take_fresh()
        block = self.blocks[block_id]
        block.block_hash, block.token_ids = hit.block_hash, list(token_ids)
        self.cached[hit.block_hash] = block_id
        self.events.record("stored", [hit.block_hash])
        self._moves.append(KVMove(hit.medium, hit.slot, "device", block_id))
        self._restored.append(block_id)
        self.counters.restored[hit.medium] += 1
        return block_id

    def _offload(self, block: Block) -> None:
        """``block`` leaves the device: copy it to the host tier (unless held there already)."""
        assert block.block_hash is not None
        host = self.host
        if host is None:
            return
        if (slot := host.slots.get(block.block_hash)) is not None:
            host.use(slot)
            return
        slot = host.victim()
        if slot is None:
            return
        self._demote(slot)
        replaced = host.store(slot, block.block_hash, block.token_ids)
        if replaced is not None:
            self.events.record("removed", [replaced], "host")
            self.counters.evicted["host"] += 1
        self._moves.append(KVMove("device", block.block_id, "host", slot))
        self.events.record("stored", [block.block_hash], "host")
        self.counters.stored["host"] += 1

    def _demote(self, host_slot: int) -> None:
        """The host tier's block in ``host_slot`` is about to be replaced: copy it to the disk tier."""
        assert self.host is not None
        disk = self.disk
        if disk is None or not self.host.holds(host_slot):
            return
        block_hash, token_ids = self.host.entry(host_slot)
        if (slot := disk.slots.get(block_hash)) is not None:
            disk.use(slot)
            return
        slot = disk.victim()
        if slot is None:
            return
        replaced = disk.store(slot, block_hash, token_ids)
        if replaced is not None:
            self.events.record("removed", [replaced], "disk")
            self.counters.evicted["disk"] += 1
        self._moves.append(KVMove("host", host_slot, "disk", slot))
        self.events.record("stored", [block_hash], "disk")
        self.counters.stored["disk"] += 1

    def _hashes(self, seq: Sequence, num_blocks: int) -> list[BlockHash]:
        """The chained hashes of ``seq``'s first ``num_blocks`` full blocks, extended lazily."""
        hashes = seq.block_hashes
        while len(hashes) < num_blocks:
            parent = hashes[-1] if hashes else seq.root_hash
            hashes.append(hash_block(parent, seq.block_tokens(len(hashes), self.block_size)))
        return hashes[:num_blocks]

    def _num_blocks(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _num_missing_blocks(self, seq: Sequence, num_new_tokens: int) -> int:
        return max(0, self._num_blocks(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table))

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
        block.ref_count += 1

    def _take_fresh(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:
            del self.cached[block.block_hash]
            self.events.record("removed", [block.block_hash])
            self.counters.evicted["device"] += 1
            self._offload(block)
        block.block_hash, block.token_ids, block.ref_count = None, [], 1
        return block_id
