"""Turns a scheduler decision into the flat tensors of one batched forward."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, replace
from typing import Protocol, TypeVar

import torch

from herd.worker.layers.attention import AttentionGroup, AttentionMetadata, WindowView
from herd.worker.scheduler import ScheduledChunk
from herd.worker.sequence import Sequence

__all__ = ["Query", "StepInputs", "prepare_inputs", "prepare_queries"]


@dataclass(frozen=True, eq=False)
class Query:
    """Tokens ``token_ids`` of ``seq`` at positions ``start..`` whose last ``num_logits`` rows are
    projected to logits. A decode-like query (a decode, or one with proposed tokens to verify) is
    batched with others of its length; any other runs alone, as a prefill chunk."""

    seq: Sequence
    start: int
    token_ids: list[int]
    num_logits: int
    is_decode: bool

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


class _Span(Protocol):
    @property
    def seq(self) -> Sequence: ...
    @property
    def start(self) -> int: ...
    @property
    def num_tokens(self) -> int: ...


_S = TypeVar("_S", bound=_Span)


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
    proposals: Mapping[ScheduledChunk, list[int]] | None = None,
) -> StepInputs:
    """The plan's forward (``prepare_queries``): each chunk's tokens, then the tokens ``proposals``
    puts after a chunk, each with its logits; a sampled chunk's last row gives logits."""
    proposals = proposals or {}
    queries = []
    for chunk in chunks:
        proposal = proposals.get(chunk, [])
        own = chunk.seq.tokens_between(chunk.start, chunk.start + chunk.num_tokens)
        num_logits = len(proposal) + 1 if chunk.is_sampled else 0
        queries.append(Query(chunk.seq, chunk.start, own + proposal, num_logits, chunk.num_tokens == 1))
    return prepare_queries(queries, block_size, device, window_sizes)


def prepare_queries(
    queries: list[Query], block_size: int, device: torch.device, window_sizes: Collection[int] = ()
) -> StepInputs:
    """Lay the queries' tokens out group by group: decode-like ones of one length in groups of
    similar context length (``decode_groups``), then each other one alone. Every group is then a
    contiguous run of rows and no query is padded; ``sample_index`` lists each query's logit rows
    in the queries' own order. Each group carries a mask for each of the model's sliding
    ``window_sizes``."""
    by_length: dict[int, list[Query]] = {}
    for query in queries:
        if query.is_decode:
            by_length.setdefault(query.num_tokens, []).append(query)
    decodes = [group for same in by_length.values() for group in decode_groups(same, block_size)]
    prefills = [[query] for query in queries if not query.is_decode]
    token_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    end_rows: dict[Query, int] = {}
    groups: list[AttentionGroup] = []
    lora_rows: list[tuple[str | None, int]] = []
    for group in [*decodes, *prefills]:
        groups.append(_group(group, len(token_ids), block_size, device, window_sizes))
        lora_rows.extend((query.seq.lora_name, query.num_tokens) for query in group)
        for query in group:
            start, end = query.start, query.start + query.num_tokens
            token_ids.extend(query.token_ids)
            positions.extend(range(start, end))
            table = query.seq.block_table
            slots.extend(
                table[pos // block_size] * block_size + pos % block_size for pos in range(start, end)
            )
            end_rows[query] = len(token_ids)
    sample_rows = [row for q in queries for row in range(end_rows[q] - q.num_logits, end_rows[q])]
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


def decode_groups(decodes: list[_S], block_size: int) -> list[list[_S]]:
    """The decodes in groups of similar context length, shortest first.

    A group pads every context to its longest, so one long context in a batch of short ones would
    make each of them attend over the long one's length. A new group starts where a context is over
    twice as long as the group's shortest and at least ``MIN_SPLIT_BLOCKS`` blocks longer: padding
    stays under half of each group's work, and the number of groups under log2 of the longest.
    """
    ordered = sorted(decodes, key=lambda chunk: chunk.start)
    groups: list[list[_S]] = []
    first_blocks = 0
    for chunk in ordered:
        blocks = chunk.start // block_size + 1
        if not groups or (blocks > 2 * first_blocks and blocks - first_blocks >= MIN_SPLIT_BLOCKS):
            groups.append([])
            first_blocks = blocks
        groups[-1].append(chunk)
    return groups


def _group(
    chunks: list[_S],
    first_row: int,
    block_size: int,
    device: torch.device,
    window_sizes: Collection[int],
) -> AttentionGroup:
    """Decode-like queries of one length, or a single prefill chunk: ``len(chunks) * query_len`` rows."""
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


def _window(chunks: list[_S], positions: torch.Tensor, block_size: int, window: int) -> WindowView:
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
