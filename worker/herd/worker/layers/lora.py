"""Batched multi-LoRA for the linear layers: every adapter of a step in two GEMMs per layer.

Each adapted ``Linear`` holds its adapters' weights stacked by slot: ``a`` is ``[in, slots * width]``
and ``b`` is ``[slots * width, out]``, where a slot's ``width`` is ``shards * max_rank`` (a fused
layer such as ``qkv_proj`` runs one LoRA per checkpoint projection: ``q_proj``'s ``A`` fills its
slot's first ``max_rank`` columns, and its ``B`` only the rows of ``b`` that write ``q``'s output
columns, so each shard's delta lands on its own rows of the fused output). A step's tokens carry the
slot of their sequence's adapter (``LoraContext``, shared by every layer of the model):

    delta = ((x @ a[:, :m * width]) * mask) @ b[:m * width]

with ``m`` the highest slot in use plus one and ``mask[t]`` one on token ``t``'s own slot's columns
(all zero for a base-model token), then ``out += delta``. No loop over adapters or sequences, no
gather of weights: slots are views. The cost is that the shrink and expand GEMMs run every slot of
the prefix for every token, ``m`` times the FLOPs of a per-token gather (punica's SGMV kernels on a
GPU avoid it); with ranks of 8-64 and a handful of adapters the two GEMMs stay small beside the
layer's own, and a step with no adapter skips them.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

__all__ = ["LoraContext", "LoraWeights"]


class LoraContext:
    """The step's token-to-slot mask, set by the runner before each forward."""

    def __init__(self) -> None:
        self.mask: torch.Tensor | None = None  # [num_tokens, m, 1]
        self.num_slots = 0  # m; 0: no token of this step has an adapter

    def set(self, token_slots: torch.Tensor, dtype: torch.dtype) -> None:
        """``token_slots[t]`` is token ``t``'s slot, ``-1`` for the base model."""
        self.num_slots = int(token_slots.max()) + 1 if token_slots.numel() else 0
        if self.num_slots == 0:
            self.mask = None
            return
        slots = torch.arange(self.num_slots, device=token_slots.device)
        self.mask = (token_slots.unsqueeze(1) == slots).to(dtype).unsqueeze(2)

    def clear(self) -> None:
        self.mask, self.num_slots = None, 0


class LoraWeights:
    """One linear layer's adapters, stacked by slot (see the module docstring for the layout)."""

    def __init__(
        self,
        in_features: int,
        shards: Mapping[str, int],
        context: LoraContext,
        *,
        num_slots: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.shards = dict(shards)
        self.context = context
        self.max_rank = max_rank
        self.width = len(self.shards) * max_rank
        out_features = sum(self.shards.values())
        self.a = torch.zeros(in_features, num_slots * self.width, dtype=dtype, device=device)
        self.b = torch.zeros(num_slots * self.width, out_features, dtype=dtype, device=device)

    def set_slot(self, slot: int, weights: Mapping[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Fill ``slot`` with ``weights[shard] = (A [r, in], scaled B [out_shard, r])``; shards absent
        from ``weights`` (projections the adapter leaves alone) stay zero."""
        first = slot * self.width
        self.a[:, first : first + self.width] = 0
        self.b[first : first + self.width] = 0
        column = 0
        for index, (shard, size) in enumerate(self.shards.items()):
            if shard in weights:
                lora_a, lora_b = weights[shard]
                rows = slice(first + index * self.max_rank, first + index * self.max_rank + lora_a.shape[0])
                self.a[:, rows] = lora_a.T.to(self.a.device)
                self.b[rows, column : column + size] = lora_b.T.to(self.b.device)
            column += size

    def add_to(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``out`` (the layer's output for ``x``) plus each token's own adapter delta, in place."""
        mask, num_slots = self.context.mask, self.context.num_slots
        if mask is None:
            return out
        span = num_slots * self.width
        shrunk = x @ self.a[:, :span]
        shrunk.view(-1, num_slots, self.width).mul_(mask)
        return out.addmm_(shrunk, self.b[:span])
