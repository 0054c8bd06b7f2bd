"""The scheduler's plans without a model: token budget, chunked prefill, batch cap, preemption."""

from __future__ import annotations

import pytest
from conftest import make_seq

from herd.worker.block_manager import BlockManager
from herd.worker.sampling_params import SamplingParams
from herd.worker.scheduler import Scheduler, SchedulerOutput
from herd.worker.sequence import Sequence, SequenceStatus

BS = 4
Step = list[tuple[str, int]]


def make_scheduler(num_blocks: int, budget: int, max_batch_size: int = 8) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, BS), max_batch_tokens=budget, max_batch_size=max_batch_size)


def add(scheduler: Scheduler, name: str, prompt_len: int, max_tokens: int = 2, priority: int = 0) -> Sequence:
    seq = make_seq([1000 * (ord(name) - 96) + i for i in range(prompt_len)], request_id=name)
    seq.params = SamplingParams(max_tokens=max_tokens, priority=priority)
    scheduler.add(seq)
    return seq


def run_step(scheduler: Scheduler) -> SchedulerOutput:
    """Plan a step, then do what the engine does: advance, append a token to sampled ones, retire."""
    output = scheduler.schedule()
    sampled = [chunk.seq for chunk in output.chunks if chunk.is_sampled]
    scheduler.update(output)
    for seq in sampled:
        seq.append_token(7, None)
        if seq.num_output_tokens >= seq.params.max_tokens:
            scheduler.finish(seq)
    return output


def plan(output: SchedulerOutput) -> Step:
    return [(chunk.seq.request_id, chunk.num_tokens) for chunk in output.chunks]


@pytest.mark.parametrize(
    ("prompts", "budget", "max_batch_size", "expected"),
    [
        ({"a": 10}, 4, 8, [[("a", 4)], [("a", 4)], [("a", 2)], [("a", 1)], []]),
        ({"a": 3, "b": 10}, 6, 8, [[("a", 3), ("b", 3)], [("a", 1), ("b", 5)], [("b", 2)], [("b", 1)], []]),
        (
            {"a": 2, "b": 2, "c": 2},
            64,
            2,
            [[("a", 2), ("b", 2)], [("a", 1), ("b", 1)], [("c", 2)], [("c", 1)], []],
        ),
        (
            {"a": 2, "b": 2, "c": 2},
            5,
            8,
            [[("a", 2), ("b", 2), ("c", 1)], [("a", 1), ("b", 1), ("c", 1)], [("c", 1)], []],
        ),
    ],
    ids=["chunked-prefill", "running-first-then-chunk", "batch-size-cap", "budget-splits-third-prompt"],
)
def test_step_plans(prompts: dict[str, int], budget: int, max_batch_size: int, expected: list[Step]) -> None:
    scheduler = make_scheduler(64, budget, max_batch_size)
    for name, length in prompts.items():
        add(scheduler, name, length)
    assert [plan(run_step(scheduler)) for _ in expected] == expected
    assert not scheduler.has_unfinished()


def test_preempts_the_newest_and_requeues_it_first() -> None:
    scheduler = make_scheduler(num_blocks=3, budget=64)
    a, b = add(scheduler, "a", 4, max_tokens=8), add(scheduler, "b", 4, max_tokens=8)
    add(scheduler, "c", 2, max_tokens=1)
    first = run_step(scheduler)
    assert plan(first) == [("a", 4), ("b", 4), ("c", 2)]
    second = run_step(scheduler)
    assert plan(second) == [("a", 1)]
    assert second.preempted == [b]
    assert b.status is SequenceStatus.WAITING
    assert b.num_computed_tokens == 0
    assert b.output_token_ids == [7]
    assert scheduler.waiting[0] is b
    assert a.status is SequenceStatus.RUNNING


@pytest.mark.parametrize(
    ("arrivals", "order"),
    [
        ([("a", 0), ("b", 0), ("c", 0)], "abc"),
        ([("a", 2), ("b", 1), ("c", 0)], "cba"),
        ([("a", 1), ("b", 0), ("c", 1), ("d", 0)], "bdac"),
        ([("a", 0), ("b", 5), ("c", 5), ("d", 3)], "adbc"),
    ],
    ids=["fifo", "reversed", "interleaved", "ties-keep-arrival"],
)
def test_waiting_sequences_start_by_priority_then_arrival(
    arrivals: list[tuple[str, int]], order: str
) -> None:
    scheduler = make_scheduler(64, budget=64, max_batch_size=1)
    for name, priority in arrivals:
        add(scheduler, name, 2, max_tokens=1, priority=priority)
    started = [plan(run_step(scheduler))[0][0] for _ in order]
    assert "".join(started) == order


def test_an_urgent_arrival_preempts_the_least_urgent_running_sequence() -> None:
    scheduler = make_scheduler(num_blocks=4, budget=64)
    low = add(scheduler, "a", 4, max_tokens=8, priority=5)
    mid = add(scheduler, "b", 4, max_tokens=8, priority=1)
    run_step(scheduler)
    run_step(scheduler)  # a and b hold two blocks each: the pool is full
    urgent = add(scheduler, "c", 4, max_tokens=2, priority=0)
    third = run_step(scheduler)
    assert third.preempted == [low] and mid.status is SequenceStatus.RUNNING
    # it starts in the step that preempted for it; the preempted one waits (no bounce back)
    assert ("c", 4) in plan(third) and urgent.status is SequenceStatus.RUNNING
    assert list(scheduler.waiting) == [low]


@pytest.mark.parametrize(
    ("running", "arrival", "max_batch_size", "preempted", "starts"),
    [
        ([("a", 5), ("b", 1)], ("c", 0), 2, "a", True),  # every seat taken: the least urgent gives it up
        ([("a", 1), ("b", 1)], ("c", 0), 2, "b", True),  # equally urgent ones: the newest
        ([("a", 5), ("b", 1)], ("c", 0), 3, "", True),  # a seat is free: nobody
        ([("a", 0), ("b", 1)], ("c", 1), 2, "", False),  # nothing less urgent runs: it waits
    ],
)
def test_an_urgent_arrival_takes_a_seat_of_a_full_batch(
    running: list[tuple[str, int]],
    arrival: tuple[str, int],
    max_batch_size: int,
    preempted: str,
    starts: bool,
) -> None:
    scheduler = make_scheduler(num_blocks=64, budget=64, max_batch_size=max_batch_size)
    for name, priority in running:
        add(scheduler, name, 4, max_tokens=8, priority=priority)
    run_step(scheduler)
    urgent = add(scheduler, arrival[0], 4, max_tokens=2, priority=arrival[1])
    step = run_step(scheduler)
    assert "".join(seq.request_id for seq in step.preempted) == preempted
    assert any(chunk.seq is urgent for chunk in step.chunks) == starts  # in the step that preempted
    assert len(scheduler.running) <= max_batch_size


def test_an_arrival_never_preempts_an_equally_urgent_sequence() -> None:
    scheduler = make_scheduler(num_blocks=4, budget=64)
    add(scheduler, "a", 4, max_tokens=8, priority=1)
    add(scheduler, "b", 4, max_tokens=8, priority=1)
    run_step(scheduler)
    run_step(scheduler)
    add(scheduler, "c", 4, max_tokens=2, priority=1)
    assert run_step(scheduler).preempted == []


def test_a_full_pool_preempts_the_least_urgent_not_the_newest() -> None:
    scheduler = make_scheduler(num_blocks=2, budget=64)
    a = add(scheduler, "a", 3, max_tokens=8, priority=3)
    run_step(scheduler)
    b = add(scheduler, "b", 4, max_tokens=8, priority=0)
    assert plan(run_step(scheduler)) == [("a", 1), ("b", 4)]
    third = run_step(scheduler)  # both need a third block: the older but less urgent a goes
    assert third.preempted == [a] and b.status is SequenceStatus.RUNNING
    assert plan(third) == [("b", 1)]


def test_no_admission_in_a_step_that_preempted() -> None:
    scheduler = make_scheduler(num_blocks=2, budget=64)
    add(scheduler, "a", 4, max_tokens=8)
    add(scheduler, "b", 4, max_tokens=8)
    run_step(scheduler)
    second = run_step(scheduler)
    assert [seq.request_id for seq in second.preempted] == ["b"]
    assert plan(second) == [("a", 1)]


def test_preempted_sequences_finish_after_the_pool_frees() -> None:
    scheduler = make_scheduler(num_blocks=3, budget=64)
    seqs = [add(scheduler, name, 4, max_tokens=6) for name in "abc"]
    for _ in range(60):
        if not scheduler.has_unfinished():
            break
        run_step(scheduler)
    assert all(seq.status is SequenceStatus.FINISHED for seq in seqs)
    assert all(seq.num_output_tokens == 6 for seq in seqs)
    assert scheduler.block_manager.num_free_blocks == 3


def test_waiting_sequence_starts_after_its_cache_hit() -> None:
    scheduler = make_scheduler(num_blocks=16, budget=64)
    add(scheduler, "a", 9, max_tokens=1)
    run_step(scheduler)
    twin = make_seq([1000 + i for i in range(9)] + [5, 6], request_id="twin")
    scheduler.add(twin)
    output = run_step(scheduler)
    assert plan(output) == [("twin", 3)]
    assert (output.num_cache_queries, output.num_cache_hits) == (11, 8)


@pytest.mark.parametrize(
    ("prompt_len", "budget", "steps_before_twin", "expected_twin_plan", "expected_hits"),
    [
        (9, 64, 0, ("twin", 3), 8),
        (12, 8, 1, ("twin", 2), 12),
        (12, 8, 0, None, 0),
    ],
    ids=["admitted-in-the-same-step", "while-the-prompt-prefills", "no-budget-left-this-step"],
)
def test_a_twin_shares_blocks_planned_before_it(
    prompt_len: int,
    budget: int,
    steps_before_twin: int,
    expected_twin_plan: tuple[str, int] | None,
    expected_hits: int,
) -> None:
    """A prompt's full blocks are cached when planned, not when computed: a twin planned after them
    (in the same step, or while the prompt's later chunks run) starts after them."""
    scheduler = make_scheduler(num_blocks=16, budget=budget)
    add(scheduler, "a", prompt_len, max_tokens=1)
    for _ in range(steps_before_twin):
        run_step(scheduler)
    scheduler.add(make_seq([1000 + i for i in range(prompt_len)] + [5, 6], request_id="twin"))
    output = run_step(scheduler)
    twin_plans = [chunk for chunk in plan(output) if chunk[0] == "twin"]
    assert twin_plans == ([expected_twin_plan] if expected_twin_plan else [])
    assert output.num_cache_hits == expected_hits


def test_a_step_lists_the_blocks_it_cached() -> None:
    scheduler = make_scheduler(num_blocks=16, budget=6)
    a = add(scheduler, "a", 10, max_tokens=1)
    first = scheduler.schedule()
    scheduler.update(first)
    second = scheduler.schedule()
    assert first.cached_block_ids == a.block_table[:1]
    assert second.cached_block_ids == a.block_table[1:2]


def test_finish_removes_a_waiting_sequence() -> None:
    scheduler = make_scheduler(num_blocks=16, budget=64)
    seq = add(scheduler, "a", 4)
    scheduler.finish(seq)
    assert not scheduler.has_unfinished()
    assert seq.is_finished


@pytest.mark.parametrize(
    ("prompts", "budget", "expected"),
    [
        ({"a": 3, "b": 4, "c": 2}, 8, [[("a", 3), ("b", 4)], [("c", 2)], []]),
        ({"a": 10, "b": 2}, 4, [[("a", 10)], [("b", 2)], []]),  # above the whole budget: alone
        ({"a": 2, "b": 10, "c": 1}, 4, [[("a", 2)], [("b", 10)], [("c", 1)], []]),  # order kept
        ({"a": 4, "b": 4}, 8, [[("a", 4), ("b", 4)], []]),
    ],
    ids=["fills-the-budget", "over-budget-runs-alone", "waits-its-turn", "exact-fit"],
)
def test_unchunked_plans_run_whole_prompts(
    prompts: dict[str, int], budget: int, expected: list[Step]
) -> None:
    """An encoder's scheduler (``is_chunked`` off) never splits a prompt: it runs whole or waits."""
    scheduler = Scheduler(
        BlockManager(64, BS, enable_prefix_caching=False),
        max_batch_tokens=budget,
        max_batch_size=8,
        is_chunked=False,
    )
    for name, length in prompts.items():
        add(scheduler, name, length, max_tokens=1)
    assert [plan(run_step(scheduler)) for _ in expected] == expected
