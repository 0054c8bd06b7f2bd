"""How a step's chunks become attention groups: decodes by context length, prefill chunks alone."""

from __future__ import annotations

import pytest
import torch
from conftest import make_seq

from herd.worker.input_batch import decode_groups, prepare_inputs
from herd.worker.scheduler import ScheduledChunk

BLOCK = 16


def decode(context: int, request_id: str) -> ScheduledChunk:
    """A decode of the token at position ``context`` (``context`` tokens already computed)."""
    seq = make_seq(list(range(3, 3 + context + 1)), request_id=request_id)
    seq.num_computed_tokens = context
    seq.block_table = list(range(context // BLOCK + 1))
    return ScheduledChunk(seq, 1)


@pytest.mark.parametrize(
    ("contexts", "expected"),
    [
        ([40], [[40]]),
        ([10, 200, 90], [[10, 90, 200]]),  # within MIN_SPLIT_BLOCKS of each other: one group
        ([1130, 100, 120, 90], [[90, 100, 120], [1130]]),  # one long context among short ones
        ([16 * 20, 16 * 39], [[16 * 20, 16 * 39]]),  # 40 blocks is not over twice 21
        ([16 * 20, 16 * 42], [[16 * 20], [16 * 42]]),
        ([50, 600, 640, 1900], [[50], [600, 640], [1900]]),
    ],
)
def test_decodes_group_by_context_length(contexts: list[int], expected: list[list[int]]) -> None:
    spans = [(row, decode(context, f"r{row}")) for row, context in enumerate(contexts)]
    groups = decode_groups(spans, BLOCK)
    assert [[chunk.start for _, chunk in group] for group in groups] == expected


def test_every_decode_lands_in_exactly_one_group_with_its_own_row() -> None:
    chunks = [decode(context, f"r{index}") for index, context in enumerate([1130, 100, 120, 700])]
    inputs = prepare_inputs(chunks, BLOCK, torch.device("cpu"))
    rows = sorted(row for group in inputs.metadata.groups for row in group.token_index.tolist())
    assert rows == [0, 1, 2, 3]
    assert [group.batch_size for group in inputs.metadata.groups] == [2, 2]
    assert [group.block_tables.shape[1] for group in inputs.metadata.groups] == [8, 71]
