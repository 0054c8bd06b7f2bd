"""Turns a scheduler decision into the flat tensors of one batched forward."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from herd.worker.layers.attention import AttentionGroup, AttentionMetadata
from herd.worker.scheduler import ScheduledChunk

__all__ = ["StepInputs", "prepare_inputs"]

_Span = tuple[int, ScheduledChunk]  # (first row in the flat step, chunk)


@dataclass(frozen=True)
class StepInputs:
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    metadata: AttentionMetadata
    sample_index: torch.Tensor  # rows whose hidden state is projected to logits, in chunk order


def prepare_inputs(chunks: list[ScheduledChunk], block_size: int, device: torch.device) -> StepInputs:
    """Flatten every chunk's tokens; decodes form groups of similar context length (``decode_groups``),
    each prefill chunk a group of its own."""
    token_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    sample_rows: list[int] = []
    spans: list[_Span] = []
    for chunk in chunks:
        start, end = chunk.start, chunk.start + chunk.num_tokens
        spans.append((len(token_ids), chunk))
        token_ids.extend(chunk.seq.tokens_between(start, end))
        positions.extend(range(start, end))
        table = chunk.seq.block_table
        slots.extend(table[pos // block_size] * block_size + pos % block_size for pos in range(start, end))
        if chunk.is_sampled:
            sample_rows.append(len(token_ids) - 1)
    decodes = [span for span in spans if span[1].num_tokens == 1]
    prefills = [[span] for span in spans if span[1].num_tokens > 1]
    groups = tuple(
        _group(group, len(token_ids), block_size, device)
        for group in [*decode_groups(decodes, block_size), *prefills]
    )
    metadata = AttentionMetadata(
        slot_mapping=_tensor(slots, device), groups=groups, num_tokens=len(token_ids)
    )
    return StepInputs(
        _tensor(token_ids, device), _tensor(positions, device), metadata, _tensor(sample_rows, device)
    )


MIN_SPLIT_BLOCKS = 16
"""Decodes whose contexts differ by fewer blocks share a group whatever the ratio: another group
costs more gathers and SDPA calls per layer than padding a few blocks does."""


def decode_groups(decodes: list[_Span], block_size: int) -> list[list[_Span]]:
    """The decodes in groups of similar context length, shortest first.

    A group pads every context to its longest, so one long context in a batch of short ones would
    make each of them attend over the long one's length. A new group starts where a context is over
    twice as long as the group's shortest and at least ``MIN_SPLIT_BLOCKS`` blocks longer: padding
    stays under half of each group's work, and the number of groups under log2 of the longest.
    """
    ordered = sorted(decodes, key=lambda span: span[1].start)
    groups: list[list[_Span]] = []
    first_blocks = 0
    for span in ordered:
        blocks = span[1].start // block_size + 1
        if not groups or (blocks > 2 * first_blocks and blocks - first_blocks >= MIN_SPLIT_BLOCKS):
            groups.append([])
            first_blocks = blocks
        groups[-1].append(span)
    return groups


def _group(spans: list[_Span], num_tokens: int, block_size: int, device: torch.device) -> AttentionGroup:
    max_query_len = max(chunk.num_tokens for _, chunk in spans)
    max_blocks = max(-(-(chunk.start + chunk.num_tokens) // block_size) for _, chunk in spans)
    token_index: list[int] = []
    query_positions: list[int] = []
    block_tables: list[int] = []
    for offset, chunk in spans:
        padding = max_query_len - chunk.num_tokens
        token_index.extend([*range(offset, offset + chunk.num_tokens), *[num_tokens] * padding])
        query_positions.extend([*range(chunk.start, chunk.start + chunk.num_tokens), *[0] * padding])
        table = chunk.seq.block_table[:max_blocks]
        block_tables.extend([*table, *[0] * (max_blocks - len(table))])
    positions = _tensor(query_positions, device).view(len(spans), max_query_len, 1)
    key_positions = torch.arange(max_blocks * block_size, device=device)
    return AttentionGroup(
        token_index=_tensor(token_index, device),
        block_tables=_tensor(block_tables, device).view(len(spans), max_blocks),
        attn_mask=(key_positions <= positions).unsqueeze(1),
        batch_size=len(spans),
        max_query_len=max_query_len,
    )


def _tensor(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long).to(device, non_blocking=True)
