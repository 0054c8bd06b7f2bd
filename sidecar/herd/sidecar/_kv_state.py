"""What the sidecar knows of vLLM's prefix cache: herd's events and snapshot, from vLLM's batches.

Event-loop side only. ``epoch`` is fresh at the sidecar's start and again when vLLM's numbering
starts over (vLLM restarted): the orchestrator then drops what it knew and reads a snapshot.
"""

from __future__ import annotations

import uuid

from herd.api.kv_events import KVEventBuffer, KVEventFeed
from herd.api.protocol import KVSnapshot
from herd.sidecar._translate import KVTranslator
from herd.sidecar._wire import VLLMEvent

__all__ = ["KVState"]


class KVState:
    def __init__(self, model_id: str, block_size: int) -> None:
        self.feed = KVEventFeed()
        self.epoch = uuid.uuid4().hex
        self._buffer = KVEventBuffer()
        self._translator = KVTranslator(model_id, block_size)

    @property
    def num_skipped_blocks(self) -> int:
        return self._translator.num_skipped_blocks

    def apply(self, events: list[VLLMEvent]) -> None:
        """One vLLM batch, translated, numbered and published."""
        for event in events:
            if (translated := self._translator.translate(event)) is not None:
                self._buffer.record(*translated)
        if drained := self._buffer.drain():
            self.feed.publish(drained)

    def restart(self) -> None:
        """vLLM started over with an empty cache: a new epoch, nothing held."""
        translator = self._translator
        self._translator = KVTranslator(translator.model_id, translator.block_size)
        self.epoch = uuid.uuid4().hex

    def snapshot(self) -> KVSnapshot:
        return KVSnapshot(
            epoch=self.epoch,
            seq=self._buffer.last_seq,
            block_size=self._translator.block_size,
            block_hashes=self._translator.block_hashes,
            tier_block_hashes=self._translator.tier_block_hashes,
        )
