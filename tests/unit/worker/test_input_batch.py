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
    chunks = [decode(context, f"r{row}") for row, context in enumerate(contexts)]
    groups = decode_groups(chunks, BLOCK)
    assert [[chunk.start for chunk in group] for group in groups] == expected


def prefill(length: int, request_id: str) -> ScheduledChunk:
    seq = make_seq(list(range(3, 3 + length)), request_id=request_id)
    seq.block_table = list(range(100, 100 + -(-length // BLOCK)))
    return ScheduledChunk(seq, length)


def test_groups_are_contiguous_rows_in_group_order_and_samples_keep_chunk_order() -> None:
    chunks = [decode(1130, "long"), prefill(5, "p"), decode(100, "a"), decode(120, "b"), decode(700, "c")]
    inputs = prepare_inputs(chunks, BLOCK, torch.device("cpu"))
    groups = inputs.metadata.groups
    assert [(g.first_row, g.batch_size, g.query_len) for g in groups] == [(0, 2, 1), (2, 2, 1), (4, 1, 5)]
    assert [g.block_tables.shape[1] for g in groups] == [8, 71, 1]
    # rows: a, b, c (context 100, 120, 700), long, then p's five tokens
    assert inputs.positions.tolist() == [100, 120, 700, 1130, 0, 1, 2, 3, 4]
    assert inputs.sample_index.tolist() == [3, 8, 0, 1, 2]
    assert inputs.metadata.slot_mapping[4:].tolist() == [100 * BLOCK + offset for offset in range(5)]


@pytest.mark.parametrize(
    ("chunk", "expected_allowed"),
    [(decode(20, "d"), [[21]]), (prefill(3, "p"), [[1, 2, 3]])],
    ids=["decode-sees-its-context-and-itself", "prefill-is-causal"],
)
def test_the_mask_allows_each_query_its_positions_so_far(
    chunk: ScheduledChunk, expected_allowed: list[list[int]]
) -> None:
    [group] = prepare_inputs([chunk], BLOCK, torch.device("cpu")).metadata.groups
    allowed = group.attn_mask.sum(dim=-1).squeeze(1)  # [batch, query_len]
    assert allowed.tolist() == expected_allowed


@pytest.mark.parametrize(
    ("chunks", "window", "expected_blocks", "expected_keys"),
    [
        ([decode(40, "d")], 20, [[1, 2]], [[list(range(21, 41))]]),
        ([decode(10, "d")], 20, [[0]], [[list(range(11))]]),  # a context shorter than the window: all of it
        ([decode(47, "d")], 16, [[2]], [[list(range(32, 48))]]),  # the window is exactly block 2
        # decodes of different reach in one group: as many blocks as the widest needs, padded with 0
        (
            [decode(40, "a"), decode(48, "b")],
            20,
            [[1, 2, 0], [1, 2, 3]],
            [[list(range(21, 41))], [list(range(29, 49))]],
        ),
        ([prefill(4, "p")], 2, [[100]], [[[0], [0, 1], [1, 2], [2, 3]]]),
    ],
    ids=[
        "decode-sees-its-window",
        "short-decode-sees-all",
        "decode-window-on-a-block-edge",
        "decodes",
        "prefill",
    ],
)
def test_a_window_view_gathers_the_blocks_in_reach_and_allows_each_query_its_window(
    chunks: list[ScheduledChunk],
    window: int,
    expected_blocks: list[list[int]],
    expected_keys: list[list[list[int]]],
) -> None:
    [group] = prepare_inputs(chunks, BLOCK, torch.device("cpu"), window_sizes=[window]).metadata.groups
    block_tables, mask = group.view(window)
    assert block_tables.tolist() == expected_blocks
    for chunk, table, rows, keys in zip(
        chunks, block_tables.tolist(), mask[:, 0], expected_keys, strict=True
    ):
        first_position = chunk.seq.block_table.index(table[0]) * BLOCK  # the view's first key position
        assert [[first_position + int(j) for j in row.nonzero().flatten()] for row in rows] == keys
    assert group.view(None) == (group.block_tables, group.attn_mask)
