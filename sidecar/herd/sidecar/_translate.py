"""vLLM's KV events as herd's: each stored block re-hashed with ``herd.api.kv_hash``.

vLLM names a block by its own hash (SHA-256 over its own encoding); herd's gateway names a prompt's
blocks by herd's chained hash. ``BlockStored`` carries the blocks' token ids and the vLLM hash of the
block before them, so the herd hash of each block is ``hash_block(herd hash of the parent, tokens)``,
starting from ``root_hash(model, cache_salt, lora_name)`` for a prompt's first block (vLLM publishes the salt
among the first block's extra keys). The map from vLLM's hashes to herd's serves ``BlockRemoved``
and ``AllBlocksCleared``, and its values are the snapshot.

A block whose parent the map does not hold (its event was lost) cannot be named and is skipped; its
``BlockRemoved`` is then skipped too. Two vLLM blocks may map to one herd hash (vLLM keys on what
herd's hash leaves out, such as multimodal inputs): a herd hash is reported stored when its first
vLLM block arrives and removed when its last one goes. vLLM's device tier is medium ``GPU`` (which
the CPU build reports too). Its CPU-offload tier (medium ``CPU``, from the offloading connector) is
herd's ``host`` tier: those events carry vLLM's hashes of blocks the device computed first, so they
are named through a bounded memory of every device block's herd hash (``_MAX_NAMES``), and tracked in
their own map. Cost: one BLAKE2b call per stored device block, O(1) per other block; memory: one map
entry per cached vLLM block plus the names remembered.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from typing import Literal

from herd.api.kv_hash import BlockHash, hash_block, root_hash
from herd.api.protocol import Medium
from herd.sidecar._wire import AllBlocksCleared, BlockRemoved, BlockStored, VLLMBlockHash, VLLMEvent

__all__ = ["KVTranslator", "Translated"]

Kind = Literal["stored", "removed", "cleared"]
Translated = tuple[Kind, list[BlockHash]] | tuple[Kind, list[BlockHash], Medium]
"""An event for ``herd.api.kv_events.KVEventBuffer.record`` (the device's without a medium), which
skips one without blocks."""
_DEVICE_MEDIA = (None, "GPU")
_TIER_MEDIA: dict[str, Medium] = {"CPU": "host"}
_MAX_NAMES = 1 << 20
"""Device blocks whose herd hash is remembered after they leave the device, for the tiers' events."""


class KVTranslator:
    """Turns vLLM's KV events into herd's ``stored`` / ``removed`` / ``cleared`` events."""

    def __init__(self, model_id: str, block_size: int) -> None:
        self.model_id = model_id
        self.block_size = block_size
        self.num_skipped_blocks = 0
        """Stored blocks that could not be named (unknown parent, another block size)."""
        self._herd_of: dict[VLLMBlockHash, BlockHash] = {}
        self._holders: Counter[BlockHash] = Counter()
        self._names: OrderedDict[VLLMBlockHash, BlockHash] = OrderedDict()
        self._tiers: dict[Medium, dict[VLLMBlockHash, BlockHash]] = {}

    @property
    def block_hashes(self) -> list[BlockHash]:
        """Every herd block hash vLLM's device cache holds now."""
        return list(self._holders)

    @property
    def tier_block_hashes(self) -> dict[Medium, list[BlockHash]]:
        """Every herd block hash each tier below the device holds now."""
        return {medium: list(set(held.values())) for medium, held in self._tiers.items()}

    def translate(self, event: VLLMEvent) -> Translated | None:
        match event:
            case BlockStored() if event.medium in _DEVICE_MEDIA:
                return "stored", self._stored(event)
            case BlockRemoved() if event.medium in _DEVICE_MEDIA:
                return "removed", self._removed(event.block_hashes)
            case BlockStored() if event.medium in _TIER_MEDIA:
                medium = _TIER_MEDIA[event.medium]
                return "stored", self._tier_stored(medium, event.block_hashes), medium
            case BlockRemoved() if event.medium in _TIER_MEDIA:
                medium = _TIER_MEDIA[event.medium]
                return "removed", self._tier_removed(medium, event.block_hashes), medium
            case AllBlocksCleared():
                self._herd_of.clear()
                self._holders.clear()
                self._tiers.clear()
                return "cleared", []
        return None

    def _tier_stored(self, medium: Medium, vllm_hashes: list[VLLMBlockHash]) -> list[BlockHash]:
        held = self._tiers.setdefault(medium, {})
        stored: list[BlockHash] = []
        for vllm_hash in vllm_hashes:
            herd_hash = self._names.get(vllm_hash)
            if herd_hash is None:
                self.num_skipped_blocks += 1
            elif vllm_hash not in held:
                if herd_hash not in held.values():
                    stored.append(herd_hash)
                held[vllm_hash] = herd_hash
        return stored

    def _tier_removed(self, medium: Medium, vllm_hashes: list[VLLMBlockHash]) -> list[BlockHash]:
        held = self._tiers.get(medium, {})
        gone = [
            herd_hash for vllm_hash in vllm_hashes if (herd_hash := held.pop(vllm_hash, None)) is not None
        ]
        remaining = set(held.values())
        return [herd_hash for herd_hash in dict.fromkeys(gone) if herd_hash not in remaining]

    def _stored(self, event: BlockStored) -> list[BlockHash]:
        parent = self._parent(event)
        if parent is None or event.block_size != self.block_size:
            self.num_skipped_blocks += len(event.block_hashes)
            return []
        stored: list[BlockHash] = []
        for index, vllm_hash in enumerate(event.block_hashes):
            start = index * self.block_size
            parent = hash_block(parent, event.token_ids[start : start + self.block_size])
            if vllm_hash in self._herd_of:  # vLLM reports a reused block again
                continue
            self._herd_of[vllm_hash] = parent
            self._remember(vllm_hash, parent)
            self._holders[parent] += 1
            if self._holders[parent] == 1:
                stored.append(parent)
        return stored

    def _remember(self, vllm_hash: VLLMBlockHash, herd_hash: BlockHash) -> None:
        self._names[vllm_hash] = herd_hash
        self._names.move_to_end(vllm_hash)
        if len(self._names) > _MAX_NAMES:
            self._names.popitem(last=False)

    def _parent(self, event: BlockStored) -> BlockHash | None:
        if event.parent_block_hash is None:
            return root_hash(self.model_id, _cache_salt(event), event.lora_name)
        return self._herd_of.get(event.parent_block_hash)

    def _removed(self, vllm_hashes: list[VLLMBlockHash]) -> list[BlockHash]:
        removed: list[BlockHash] = []
        for vllm_hash in vllm_hashes:
            herd_hash = self._herd_of.pop(vllm_hash, None)
            if herd_hash is None:
                continue
            self._holders[herd_hash] -= 1
            if not self._holders[herd_hash]:
                del self._holders[herd_hash]
                removed.append(herd_hash)
        return removed


def _cache_salt(event: BlockStored) -> str | None:
    """The salt among the first block's extra keys: its strings, after the LoRA name when there is one."""
    keys = (event.extra_keys or [None])[0] or []
    strings = [key for key in keys if isinstance(key, str)]
    if event.lora_name is not None:
        strings = strings[1:]
    return strings[0] if strings else None
