"""vLLM's KV event wire format (``vllm/distributed/kv_events.py``, 0.32), read with msgpack.

A message on vLLM's PUB socket is three frames: the topic, an 8-byte big-endian sequence number
(from 0 at vLLM's start) and a msgpack payload. The payload is msgspec's encoding of ``KVEventBatch``:
an array ``[ts, events, data_parallel_rank]``, each event a map tagged ``"type"`` with its class name,
fields at their default value left out. Block hashes are ints (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``,
the default) or bytes. Event types this module does not know are skipped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "VLLMBlockHash",
    "VLLMEvent",
    "WireError",
    "decode_batch",
    "decode_seq",
]

VLLMBlockHash = int | bytes


class WireError(ValueError):
    """A message that is not a vLLM KV event batch."""


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: list[VLLMBlockHash]
    parent_block_hash: VLLMBlockHash | None
    token_ids: list[int]
    block_size: int
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[list[Any] | None] | None = None
    """Per block: the LoRA name, multimodal ``(identifier, offset)`` pairs, the cache salt, prompt
    embedding digests, untagged, in that order; only the first block of a prompt carries the salt."""


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: list[VLLMBlockHash]
    medium: str | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


VLLMEvent = BlockStored | BlockRemoved | AllBlocksCleared


def decode_seq(frame: bytes) -> int:
    if len(frame) != 8:
        raise WireError(f"a KV event sequence number is 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big", signed=True)


def decode_batch(payload: bytes) -> list[VLLMEvent]:
    """The events of one batch, in order."""
    try:
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
        events = [_event(item) for item in batch[1]]
    except (ValueError, TypeError, KeyError, IndexError, msgpack.UnpackException) as error:
        raise WireError(f"not a vLLM KV event batch: {error}") from error
    return [event for event in events if event is not None]


def _event(item: dict[str, Any]) -> VLLMEvent | None:
    kind = item.get("type")
    if kind == "BlockStored":
        return BlockStored(
            block_hashes=list(item["block_hashes"]),
            parent_block_hash=item["parent_block_hash"],
            token_ids=list(item["token_ids"]),
            block_size=int(item["block_size"]),
            medium=item.get("medium"),
            lora_name=item.get("lora_name"),
            extra_keys=item.get("extra_keys"),
        )
    if kind == "BlockRemoved":
        return BlockRemoved(block_hashes=list(item["block_hashes"]), medium=item.get("medium"))
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    return None
