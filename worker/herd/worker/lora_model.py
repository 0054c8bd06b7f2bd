"""A model's LoRA adapters: host copies, the device slots, and each step's token-to-slot mask.

``LoraModel`` gives every attention and MLP ``Linear`` of the model (not ``lm_head``) its stacked
``LoraWeights`` and keeps the adapters read from disk on the host. Before a forward, ``prepare``
assigns the step's adapters to slots (``SlotTable``: the least recently used adapter leaves when a
new one needs its slot), copies the newly placed adapters' weights into their slots, and sets the
mask that tells each token's rows their slot.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from herd.worker.layers.linear import Linear
from herd.worker.layers.lora import LoraContext, LoraWeights
from herd.worker.lora import LoraAdapter, SlotTable, read_adapter

__all__ = ["LoraModel"]

_UNADAPTED = frozenset({"lm_head"})


class LoraModel:
    """The adapters of one model, ``num_slots`` of them runnable in a step, rank ``max_rank`` at most."""

    def __init__(
        self, model: nn.Module, *, num_slots: int, max_rank: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.context = LoraContext()
        self.max_rank = max_rank
        self.dtype = dtype
        self.device = device
        self.layers: dict[str, LoraWeights] = {}
        self._shard_of: dict[str, tuple[str, str]] = {}  # checkpoint module -> (herd layer, shard)
        self._shapes: dict[str, tuple[int, int]] = {}  # checkpoint module -> (in, out)
        for name, module in model.named_modules():
            if not isinstance(module, Linear) or name in _UNADAPTED:
                continue
            module.lora = self.layers[name] = LoraWeights(
                module.in_features,
                module.shards,
                self.context,
                num_slots=num_slots,
                max_rank=max_rank,
                dtype=dtype,
                device=device,
            )
            parent = name.rpartition(".")[0]
            for shard, size in module.shards.items():
                checkpoint_name = f"{parent}.{shard}" if parent else shard
                self._shard_of[checkpoint_name] = (name, shard)
                self._shapes[checkpoint_name] = (module.in_features, size)
        self.adapters: dict[str, LoraAdapter] = {}
        self.slots = SlotTable(num_slots)

    def load(self, name: str, path: Path) -> LoraAdapter:
        """Read the adapter at ``path`` into host memory as ``name`` (``ValueError`` if it does not fit)."""
        adapter = read_adapter(name, path, self._shapes, max_rank=self.max_rank, dtype=self.dtype)
        self.adapters[name] = adapter
        return adapter

    def unload(self, name: str) -> None:
        self.adapters.pop(name, None)
        self.slots.evict(name)

    def prepare(self, token_adapters: Sequence[tuple[str | None, int]]) -> None:
        """Set the context for a step whose rows are runs of ``(adapter or None, num_tokens)``."""
        names = [name for name, _ in token_adapters if name is not None]
        if not names:
            self.context.clear()
            return
        slot_of, loads = self.slots.assign(names)
        for slot, name in loads:
            self._fill(slot, self.adapters[name])
        runs = [(-1 if name is None else slot_of[name], count) for name, count in token_adapters]
        self.context.set(runs, self.device)

    def _fill(self, slot: int, adapter: LoraAdapter) -> None:
        """Copy ``adapter`` from the host into ``slot`` of every layer (layers it skips get zeros)."""
        by_layer: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
        for module, weights in adapter.weights.items():
            layer, shard = self._shard_of[module]
            by_layer.setdefault(layer, {})[shard] = weights
        for layer, stacked in self.layers.items():
            stacked.set_slot(slot, by_layer.get(layer, {}))
