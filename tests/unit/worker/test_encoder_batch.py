"""An encoder step's attention groups: similar lengths together, every token back in its flat row."""

from __future__ import annotations

import pytest
import torch

from herd.worker.models.bert import EncoderBatch


@pytest.mark.parametrize(
    ("lengths", "group_sizes"),
    [
        ([5], [(1, 5)]),
        ([3, 60, 4, 20], [(2, 4), (1, 20), (1, 60)]),
        ([40, 50, 80], [(3, 80)]),
        ([40, 50, 100], [(2, 50), (1, 100)]),
        ([2, 17], [(2, 17)]),
    ],
    ids=["one", "short-and-long", "within-twice", "past-twice", "close-in-tokens"],
)
def test_groups_and_order(lengths: list[int], group_sizes: list[tuple[int, int]]) -> None:
    batch = EncoderBatch.of(lengths, torch.device("cpu"))
    assert [(group.batch_size, group.max_len) for group in batch.groups] == group_sizes
    flat = torch.arange(sum(lengths))
    gathered = torch.cat([flat[group.padded_rows][group.real_slots] for group in batch.groups])
    assert torch.equal(gathered[batch.order], flat)  # every token back in its own row
    masked = sum(int(group.key_mask.sum()) for group in batch.groups)
    assert masked == sum(lengths)
