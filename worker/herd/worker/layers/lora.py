"""Batched multi-LoRA for the linear layers: a step's adapters without a loop over its sequences.

Each adapted ``Linear`` holds its adapters' weights stacked by slot: ``a`` is ``[slots, in, width]``
and ``b`` is ``[slots, width, out]``, where a slot's ``width`` is ``shards * max_rank`` (a fused
layer such as ``qkv_proj`` runs one LoRA per checkpoint projection: ``q_proj``'s ``A`` fills its
slot's first ``max_rank`` columns, and its ``B`` only the rows of ``b`` that write ``q``'s output
columns, so each shard's delta lands on its own rows of the fused output). A step's rows come in two
kinds (``LoraContext``, shared by every layer of the model, set by the runner before the forward):

* the leading rows of one-token chunks (the decodes, of many sequences and adapters) are gathered
  by slot into ``[m, rows per slot, in]`` (short slots padded with a zero row; ``m`` the highest slot
  used plus one), run through two ``torch.bmm`` over the slots' weights ``a[:m]``, ``b[:m]`` (views,
  never copies) and added back to their rows (``index_add_``);
* the rows of each longer chunk (a prefill chunk: one sequence, so one adapter) are a segment, run
  on its own slot's weights alone: ``x[rows] @ a[slot] @ b[slot]`` (a loop over the step's prefill
  chunks, never over its decodes).

The cost is about that of each row running its own adapter only, plus the padding of uneven slots
and, in a fused layer, the zero blocks of ``b`` (the expand of ``qkv_proj`` runs ``3 * max_rank``
rows for each of its outputs); a step with no adapter skips it all. Slots are padded to
``maxLoraRank``, so that setting is best the largest rank served.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

__all__ = ["LoraContext", "LoraWeights"]


class LoraContext:
    """The step's rows and their slots, set by the runner before each forward."""

    def __init__(self) -> None:
        self.num_decode_rows = 0  # the leading one-token rows
        self.num_slots = 0  # m: 0 when no decode row has an adapter
        self.gather: torch.Tensor | None = None  # [m * rows per slot]: decode rows, num_decode_rows pads
        self.scatter: torch.Tensor | None = None  # the same rows, 0 for pads (which add zeros)
        self.segments: list[tuple[int, int, int]] = []  # (first row, end row, slot) of longer chunks

    def set(self, runs: list[tuple[int, int]], device: torch.device) -> None:
        """``runs`` are the step's chunks in row order, ``(slot or -1 for the base model, num_tokens)``."""
        self.clear()
        self.num_decode_rows = next((index for index, (_, count) in enumerate(runs) if count != 1), len(runs))
        by_slot: dict[int, list[int]] = {}
        for row, (slot, _) in enumerate(runs[: self.num_decode_rows]):
            if slot >= 0:
                by_slot.setdefault(slot, []).append(row)
        if by_slot:
            self.num_slots, width = max(by_slot) + 1, max(map(len, by_slot.values()))
            pad = self.num_decode_rows
            rows = [
                [*by_slot.get(slot, []), *[pad] * (width - len(by_slot.get(slot, [])))]
                for slot in range(self.num_slots)
            ]
            self.gather = torch.tensor(rows, device=device).flatten()
            self.scatter = torch.where(self.gather == pad, 0, self.gather)
        row = self.num_decode_rows
        for slot, count in runs[self.num_decode_rows :]:
            if slot >= 0:
                self.segments.append((row, row + count, slot))
            row += count

    def clear(self) -> None:
        self.num_decode_rows, self.num_slots, self.gather, self.scatter, self.segments = 0, 0, None, None, []


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
        self.a = torch.zeros(num_slots, in_features, self.width, dtype=dtype, device=device)
        self.b = torch.zeros(num_slots, self.width, out_features, dtype=dtype, device=device)

    def set_slot(self, slot: int, weights: Mapping[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Fill ``slot`` with ``weights[shard] = (A [r, in], scaled B [out_shard, r])``; shards absent
        from ``weights`` (projections the adapter leaves alone) stay zero."""
        self.a[slot] = 0
        self.b[slot] = 0
        column = 0
        for index, (shard, size) in enumerate(self.shards.items()):
            if shard in weights:
                lora_a, lora_b = weights[shard]
                ranks = slice(index * self.max_rank, index * self.max_rank + lora_a.shape[0])
                self.a[slot, :, ranks] = lora_a.T.to(self.a.device)
                self.b[slot, ranks, column : column + size] = lora_b.T.to(self.b.device)
            column += size

    def add_to(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``out`` (the layer's output for ``x``) plus each row's own adapter delta, in place."""
        context = self.context
        if context.gather is not None and context.scatter is not None:
            rows, slots = context.num_decode_rows, context.num_slots
            padded = torch.cat([x[:rows], x.new_zeros(1, x.shape[1])])
            gathered = padded.index_select(0, context.gather).view(slots, -1, x.shape[1])
            delta = torch.bmm(torch.bmm(gathered, self.a[:slots]), self.b[:slots])
            out.index_add_(0, context.scatter, delta.view(-1, out.shape[1]))
        for start, end, slot in context.segments:
            out[start:end].addmm_(x[start:end] @ self.a[slot], self.b[slot])
        return out
