"""Draft slots in the scheduler's plans and their rollback, without a model."""

from __future__ import annotations

import pytest
import torch
from conftest import make_seq

from herd.worker.block_manager import BlockManager
from herd.worker.input_batch import prepare_inputs
from herd.worker.sampling_params import SamplingParams
from herd.worker.scheduler import Scheduler
from herd.worker.sequence import Sequence

BS = 4


def decoding(scheduler: Scheduler, names: str, prompt_len: int, max_tokens: int = 32) -> list[Sequence]:
    """Sequences past their prefill: prompt computed, one output token each to decode next."""
    seqs = []
    for name in names:
        seq = make_seq([100 * (ord(name) - 96) + i for i in range(prompt_len)], request_id=name)
        seq.params = SamplingParams(max_tokens=max_tokens)
        scheduler.add(seq)
        seqs.append(seq)
    scheduler.update(scheduler.schedule())
    for seq in seqs:
        seq.append_token(1, None)
    return seqs


def make_scheduler(num_blocks: int = 64, budget: int = 64, max_model_len: int | None = None) -> Scheduler:
    return Scheduler(
        BlockManager(num_blocks, BS), max_batch_tokens=budget, max_batch_size=8, max_model_len=max_model_len
    )


@pytest.mark.parametrize(
    ("draft_tokens", "draft_seqs", "budget", "max_tokens", "max_model_len", "expected"),
    [
        pytest.param(0, None, 64, 32, None, [0, 0], id="off"),
        pytest.param(3, None, 64, 32, None, [3, 3], id="every-decode"),
        pytest.param(3, 1, 64, 32, None, [3, 0], id="one-sequence-probe"),
        pytest.param(3, None, 5, 32, None, [3, 0], id="budget-first-come"),
        pytest.param(3, None, 64, 3, None, [1, 1], id="max-tokens-left"),
        pytest.param(3, None, 64, 32, 8, [1, 1], id="positions-left"),
    ],
)
def test_draft_slots(
    draft_tokens: int,
    draft_seqs: int | None,
    budget: int,
    max_tokens: int,
    max_model_len: int | None,
    expected: list[int],
) -> None:
    scheduler = make_scheduler(budget=64, max_model_len=max_model_len)
    seqs = decoding(scheduler, "ab", 6, max_tokens)
    scheduler.max_batch_tokens = budget
    output = scheduler.schedule(draft_tokens, draft_seqs)
    assert [chunk.num_draft_slots for chunk in output.chunks] == expected
    for seq, chunk in zip(seqs, output.chunks, strict=True):
        assert chunk.num_tokens == 1
        assert len(seq.block_table) * BS >= seq.num_computed_tokens + 1 + chunk.num_draft_slots


def test_slots_shrink_to_the_free_blocks_and_never_preempt() -> None:
    scheduler = make_scheduler(num_blocks=6)
    decoding(scheduler, "ab", 8)  # 2 blocks each, 2 free; each next token needs a third block
    output = scheduler.schedule(4)
    assert not output.preempted
    assert [chunk.num_draft_slots for chunk in output.chunks] == [3, 3]  # 4 would need a fourth block
    assert scheduler.block_manager.num_free_blocks == 0


def test_settle_keeps_the_accepted_and_releases_the_rejected() -> None:
    scheduler = make_scheduler()
    [seq] = decoding(scheduler, "a", 6)  # 7 tokens, 6 computed: blocks for 8
    manager = scheduler.block_manager
    free_before = manager.num_free_blocks
    output = scheduler.schedule(5)  # slots for positions 6..11: 3 blocks
    assert output.chunks[0].num_draft_slots == 5
    assert len(seq.block_table) == 3
    scheduler.update(output)
    for token_id in (2, 3):  # one proposed token accepted, then the model's own
        seq.append_token(token_id, None)
    scheduler.settle_drafts(seq, num_accepted=1)
    assert seq.num_computed_tokens == 8 == seq.num_tokens - 1
    assert len(seq.block_table) == 2
    assert manager.num_free_blocks == free_before
    manager.check_references([seq.block_table])


def test_rejected_slots_never_enter_the_prefix_cache() -> None:
    scheduler = make_scheduler()
    [seq] = decoding(scheduler, "a", 3)  # 4 tokens: the 4th (uncomputed) fills block 0 once planned
    cached_before = len(scheduler.block_manager.cached)
    output = scheduler.schedule(4)
    assert len(scheduler.block_manager.cached) == cached_before + 1  # block 0, real tokens only
    scheduler.update(output)
    seq.append_token(9, None)
    scheduler.settle_drafts(seq, num_accepted=0)
    assert len(scheduler.block_manager.cached) == cached_before + 1
    assert len(seq.block_table) == 1


def test_verifications_of_one_length_share_a_group() -> None:
    scheduler = make_scheduler()
    seqs = decoding(scheduler, "abc", 6)
    output = scheduler.schedule(2)
    proposals = {output.chunks[0]: [5, 6], output.chunks[1]: [7, 8], output.chunks[2]: [9]}
    inputs = prepare_inputs(output.chunks, BS, torch.device("cpu"), proposals=proposals)
    shapes = sorted((group.batch_size, group.query_len) for group in inputs.metadata.groups)
    assert shapes == [(1, 2), (2, 3)]
    assert inputs.sample_index.numel() == 3 + 3 + 2  # every row of a verification gives logits
    queries = inputs.input_ids.view(-1).tolist()
    assert sorted(queries) == sorted([seq.last_token_id for seq in seqs] + [5, 6, 7, 8, 9])
