"""Turns a scheduler decision into the flat tensors of one batched forward."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, replace

import torch

from herd.worker.layers.attention import AttentionGroup, AttentionMetadata, WindowView
from herd.worker.scheduler import ScheduledChunk

__all__ = ["StepInputs", "prepare_inputs"]


@dataclass(frozen=True)
class StepInputs:
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    metadata: AttentionMetadata
    sample_index: torch.Tensor  # rows whose hidden state is projected to logits, in chunk order
    lora_rows: tuple[tuple[str | None, int], ...]
    """Each chunk's LoRA adapter and its number of rows, in row order (plain values: a tensor-parallel
    step is pickled to the other ranks)."""

    def to(self, device: torch.device) -> StepInputs:
        """The same inputs on ``device`` (a tensor-parallel rank receives them on the CPU)."""
        if device.type == "cpu":
            return self
        metadata = self.metadata
        groups = tuple(
            replace(
                group,
                block_tables=group.block_tables.to(device),
                attn_mask=group.attn_mask.to(device),
                windows={
                    size: WindowView(view.block_tables.to(device), view.attn_mask.to(device))
                    for size, view in group.windows.items()
                },
            )
            for group in metadata.groups
        )
        moved = replace(metadata, slot_mapping=metadata.slot_mapping.to(device), groups=groups)
        return StepInputs(
            self.input_ids.to(device),
            self.positions.to(device),
            moved,
            self.sample_index.to(device),
            self.lora_rows,
        )


def prepare_inputs(
    chunks: list[ScheduledChunk],
    block_size: int,
    device: torch.device,
    window_sizes: Collection[int] = (),
) -> StepInputs:
    """Lay the chunks' tokens out group by group: decodes in groups of similar context length
    (``decode_groups``), then each prefill chunk alone. Every group is then a contiguous run of
    rows and no query is padded; ``sample_index`` keeps the chunks' own order for the sampler.
    Each group carries a mask for each of the model's sliding ``window_sizes``."""
    decodes = [chunk for chunk in chunks if chunk.num_tokens == 1]
    prefills = [[chunk] for chunk in chunks if chunk.num_tokens > 1]
    token_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    last_rows: dict[ScheduledChunk, int] = {}
    groups: list[AttentionGroup] = []
    lora_rows: list[tuple[str | None, int]] = []
    for group in [*decode_groups(decodes, block_size), *prefills]:
        groups.append(_group(group, len(token_ids), block_size, device, window_sizes))
        lora_rows.extend((chunk.seq.lora_name, chunk.num_tokens) for chunk in group)
        for chunk in group:
            start, end = chunk.start, chunk.start + chunk.num_tokens
            token_ids.extend(chunk.seq.tokens_between(start, end))
            positions.extend(range(start, end))
            table = chunk.seq.block_table
            slots.extend(
                table[pos // block_size] * block_size + pos % block_size for pos in range(start, end)
            )
            last_rows[chunk] = len(token_ids) - 1
    sample_rows = [last_rows[chunk] for chunk in chunks if chunk.is_sampled]
    metadata = AttentionMetadata(
        slot_mapping=_tensor(slots, device), groups=tuple(groups), num_tokens=len(token_ids)
    )
    return StepInputs(
        _tensor(token_ids, device),
        _tensor(positions, device),
        metadata,
        _tensor(sample_rows, device),
        tuple(lora_rows),
    )


MIN_SPLIT_BLOCKS = 16
"""Decodes whose contexts differ by fewer blocks share a group whatever the ratio: another group
costs more gathers and SDPA calls per layer than padding a few blocks does."""


def decode_groups(decodes: list[ScheduledChunk], block_size: int) -> list[list[ScheduledChunk]]:
    """The decodes in groups of similar context length, shortest first.

    A group pads every context to its longest, so one long context in a batch of short ones would
    make each of them attend over the long one's length. A new group starts where a context is over
    twice as long as the group's shortest and at least ``MIN_SPLIT_BLOCKS`` blocks longer: padding
    stays under half of each group's work, and the number of groups under log2 of the longest.
    """
    ordered = sorted(decodes, key=lambda chunk: chunk.start)
    groups: list[list[ScheduledChunk]] = []
    first_blocks = 0
    for chunk in ordered:
        blocks = chunk.start // block_size + 1
        if not groups or (blocks > 2 * first_blocks and blocks - first_blocks >= MIN_SPLIT_BLOCKS):
            groups.append([])
            first_blocks = blocks
        groups[-1].append(chunk)
    return groups


def _group(
    chunks: list[ScheduledChunk],
    first_row: int,
    block_size: int,
    device: torch.device,
    window_sizes: Collection[int],
) -> AttentionGroup:
    """Decodes (one token each) or a single prefill chunk: ``len(chunks) * query_len`` rows either way."""
    query_len = chunks[0].num_tokens
    max_blocks = max(-(-(chunk.start + chunk.num_tokens) // block_size) for chunk in chunks)
    query_positions: list[int] = []
    block_tables: list[int] = []
    for chunk in chunks:
        query_positions.extend(range(chunk.start, chunk.start + chunk.num_tokens))
        table = chunk.seq.block_table[:max_blocks]
        block_tables.extend([*table, *[0] * (max_blocks - len(table))])
    positions = _tensor(query_positions, device).view(len(chunks), query_len, 1)
    key_positions = torch.arange(max_blocks * block_size, device=device)
    return AttentionGroup(
        first_row=first_row,
        block_tables=_tensor(block_tables, device).view(len(chunks), max_blocks),
        attn_mask=(key_positions <= positions).unsqueeze(1),
        batch_size=len(chunks),
        query_len=query_len,
        windows={window: _window(chunks, positions, block_size, window) for window in window_sizes},
    )


def _window(
    chunks: list[ScheduledChunk], positions: torch.Tensor, block_size: int, window: int
) -> WindowView:
    """The blocks from each sequence's first block in reach (its first query's position - window + 1),
    as many as the group's widest reach, and the mask over their key positions."""
    first_blocks = [max(0, chunk.start - window + 1) // block_size for chunk in chunks]
    ends = [-(-(chunk.start + chunk.num_tokens) // block_size) for chunk in chunks]
    num_blocks = max(end - first for first, end in zip(first_blocks, ends, strict=True))
    block_tables: list[int] = []
    for chunk, first in zip(chunks, first_blocks, strict=True):
        table = chunk.seq.block_table[first : first + num_blocks]
        block_tables.extend([*table, *[0] * (num_blocks - len(table))])
    device = positions.device
    offsets = _tensor(first_blocks, device).view(-1, 1, 1) * block_size
    key_positions = offsets + torch.arange(num_blocks * block_size, device=device)
    allowed = (key_positions <= positions) & (key_positions > positions - window)
    return WindowView(_tensor(block_tables, device).view(len(chunks), num_blocks), allowed.unsqueeze(1))


def _tensor(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long).to(device, non_blocking=True)
