"""Batched multi-LoRA for the linear layers: a step's adapters without a loop over its sequences.

Each adapted ``Linear`` holds its adapters' weights stacked by slot: ``a`` is ``[in, slots * width]``
and ``b`` is ``[slots * width, out]``, where a slot's ``width`` is ``shards * max_rank`` (a fused
layer such as ``qkv_proj`` runs one LoRA per checkpoint projection: ``q_proj``'s ``A`` fills its
slot's first ``max_rank`` columns, and its ``B`` only the rows of ``b`` that write ``q``'s output
columns, so each shard's delta lands on its own rows of the fused output). A step's rows come in two
kinds (``LoraContext``, shared by every layer of the model, set by the runner before the forward):

* the leading rows of one-token chunks (the decodes, of many sequences and adapters): one shrink and
  one expand GEMM over the slots in use, with a per-row mask keeping each row's own slot:
  ``delta = ((x @ a[:, :m * width]) * mask) @ b[:m * width]``, ``m`` the highest slot used plus one;
* the rows of each longer chunk (a prefill chunk: one sequence, so one adapter): a segment, run on
  its own slot's columns alone, ``x[rows] @ a_slot @ b_slot`` (a loop over the step's prefill
  chunks, never over its decodes).

Then ``out += delta`` in place. Slots are views, never gathered copies. The cost: the decodes' GEMMs
run every slot of the prefix for every row, ``m`` times the FLOPs of a per-row gather (punica's SGMV
kernels avoid it on a GPU), small beside the layer's own at decode batch sizes; a prefill segment pays
only its own adapter's; a step with no adapter skips it all. Slots are padded to ``maxLoraRank``,
so that setting is best the largest rank served.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

__all__ = ["LoraContext", "LoraWeights"]


class LoraContext:
    """The step's rows and their slots, set by the runner before each forward."""

    def __init__(self) -> None:
        self.mask: torch.Tensor | None = None  # [num_masked_rows, m, 1]: the leading one-token rows
        self.num_slots = 0  # m
        self.segments: list[tuple[int, int, int]] = []  # (first row, end row, slot) of longer chunks

    def set(self, runs: list[tuple[int, int]], device: torch.device, dtype: torch.dtype) -> None:
        """``runs`` are the step's chunks in row order, ``(slot or -1 for the base model, num_tokens)``."""
        self.clear()
        num_masked = next((index for index, (_, count) in enumerate(runs) if count != 1), len(runs))
        masked = [slot for slot, _ in runs[:num_masked]]
        if masked and max(masked) >= 0:
            self.num_slots = max(masked) + 1
            token_slots = torch.tensor(masked, device=device).unsqueeze(1)
            self.mask = (token_slots == torch.arange(self.num_slots, device=device)).to(dtype).unsqueeze(2)
        row = num_masked
        for slot, count in runs[num_masked:]:
            if slot >= 0:
                self.segments.append((row, row + count, slot))
            row += count

    def clear(self) -> None:
        self.mask, self.num_slots, self.segments = None, 0, []


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
        """``out`` (the layer's output for ``x``) plus each row's own adapter delta, in place."""
        context = self.context
        if context.mask is not None:
            rows, span = context.mask.shape[0], context.num_slots * self.width
            shrunk = x[:rows] @ self.a[:, :span]
            shrunk.view(rows, context.num_slots, self.width).mul_(context.mask)
            out[:rows].addmm_(shrunk, self.b[:span])
        for start, end, slot in context.segments:
            columns = slice(slot * self.width, (slot + 1) * self.width)
            out[start:end].addmm_(x[start:end] @ self.a[:, columns], self.b[columns])
        return out
