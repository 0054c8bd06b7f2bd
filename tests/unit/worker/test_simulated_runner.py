"""The cost-model runner under herd's engine: time spent, tokens drawn, KV blocks as placeholders."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from support.engine import make_config, random_prompts

from herd.api.kv_hash import block_hashes
from herd.api.prompt import PromptRenderer
from herd.worker.engine import LLMEngine
from herd.worker.sampling_params import SamplingParams
from herd.worker.simulated_runner import (
    CostModel,
    DiskWrites,
    SimulatedRunner,
    SleepingClock,
    VirtualClock,
    simulated_engine,
)

PROMPTS = random_prompts([20, 37, 5], vocab_size=384, seed=8)
NUM_BLOCKS = 32


def _engine(
    model: Path,
    *,
    clock: VirtualClock | SleepingClock | None = None,
    cost: CostModel | None = None,
    seed: int = 0,
    eos_after: int | None = None,
) -> LLMEngine:
    config = make_config(model, num_blocks=NUM_BLOCKS).model_copy(update={"seed": seed})
    base = simulated_engine(config, num_blocks=NUM_BLOCKS)
    runner = SimulatedRunner(
        base.runner.geometry,
        base.vocab_size,
        cost=cost,
        clock=clock,
        avoid_token_ids=base.renderer.eos_token_ids,
        eos_after=eos_after,
        seed=seed,
    )
    return LLMEngine(config, runner, base.renderer)


@pytest.mark.parametrize(
    ("cost", "num_tokens", "seconds"),
    [(CostModel(), 0, 0.06), (CostModel(), 300, 0.51), (CostModel(step_ms=1.0, token_ms=0.0), 999, 0.001)],
    ids=["empty", "prefill-300", "flat"],
)
def test_a_step_costs_step_ms_plus_token_ms_per_token(
    cost: CostModel, num_tokens: int, seconds: float
) -> None:
    assert cost.step_seconds(num_tokens) == pytest.approx(seconds)


def test_a_virtual_clock_adds_up_every_step(tiny_llama: Path) -> None:
    clock = VirtualClock(now=100.0)
    engine = _engine(tiny_llama, clock=clock, cost=CostModel(step_ms=10.0, token_ms=1.0))
    engine.generate([PROMPTS[0]], SamplingParams(max_tokens=3, ignore_eos=True))
    # One 20-token prefill that samples the first token, then two one-token decodes.
    assert clock.now == pytest.approx(100.0 + (10 + 20) / 1000 + 2 * (10 + 1) / 1000)


def test_a_sleeping_clock_takes_the_steps_time(tiny_llama: Path) -> None:
    engine = _engine(tiny_llama, clock=SleepingClock(), cost=CostModel(step_ms=40.0, token_ms=0.0))
    started = time.perf_counter()
    engine.generate([PROMPTS[0]], SamplingParams(max_tokens=2, ignore_eos=True))
    assert time.perf_counter() - started >= 2 * 0.04


@pytest.mark.parametrize("host_share", [0.0, 0.5, 1.0], ids=["asleep", "half-busy", "busy"])
def test_a_sleeping_clock_spends_the_host_share_on_the_cpu(host_share: float) -> None:
    started, started_cpu = time.perf_counter(), time.thread_time()
    SleepingClock().advance(0.2, host_share)
    cpu = time.thread_time() - started_cpu
    assert time.perf_counter() - started >= 0.2
    assert 0.2 * host_share <= cpu < 0.2 * host_share + 0.05


def test_tokens_are_a_deterministic_hash_that_avoids_stop_tokens(tiny_llama: Path) -> None:
    params = SamplingParams(max_tokens=40, logprobs=1)
    first, again, other_seed = (
        _engine(tiny_llama, seed=seed).generate(PROMPTS, params) for seed in (0, 0, 1)
    )
    eos = PromptRenderer.from_pretrained(tiny_llama).eos_token_ids
    assert [r.new_token_ids for r in first] == [r.new_token_ids for r in again]
    assert [r.new_token_ids for r in first] != [r.new_token_ids for r in other_seed]
    assert all(r.finish_reason == "length" and not eos & set(r.new_token_ids) for r in first)
    assert all(len(set(r.new_token_ids)) > 10 for r in first)
    assert first[0].logprobs is not None and first[0].logprobs[0].top == ((first[0].new_token_ids[0], 0.0),)


def test_eos_after_ends_requests_with_a_stop_token(tiny_llama: Path) -> None:
    results = _engine(tiny_llama, eos_after=2).generate(PROMPTS, SamplingParams(max_tokens=40))
    assert [(r.finish_reason, r.num_output_tokens) for r in results] == [("stop", 3)] * len(PROMPTS)


def test_kv_blocks_are_placeholders_of_the_layout_and_imports_hit_the_cache(tiny_llama: Path) -> None:
    engine = _engine(tiny_llama)
    geometry = engine.runner.geometry
    kv = engine.read_blocks([3, 4])
    layers, pair, _, size, heads, dim = geometry.shape
    assert kv.shape == (layers, pair, 2, size, heads, dim) and kv.dtype == geometry.dtype
    assert not kv.any()
    prompt = PROMPTS[1]
    hashes = block_hashes(prompt, size, model_id="test-model")
    tokens = [prompt[i * size : (i + 1) * size] for i in range(len(hashes))]
    assert engine.write_blocks(hashes, tokens, kv) == 2
    [result] = engine.generate([prompt], SamplingParams(max_tokens=1))
    assert result.num_cached_tokens == 2 * size
    with pytest.raises(ValueError, match="do not fit this pool"):
        engine.runner.write_blocks([5], torch.zeros(1))


@pytest.mark.parametrize(
    ("depth", "writes", "waits"),
    [
        (4, [(0.0, 1.0)] * 4, [0.0] * 4),  # room for all: the step never waits
        (2, [(0.0, 1.0)] * 3, [0.0, 0.0, 1.0]),  # the third waits for the first
        (2, [(0.0, 1.0), (0.0, 1.0), (0.5, 1.0)], [0.0, 0.0, 0.5]),  # the first is done at 1.0
        (2, [(0.0, 1.0), (0.0, 1.0), (1.5, 1.0)], [0.0, 0.0, 0.0]),  # and gone by 1.5
        (1, [(0.0, 1.0), (5.0, 1.0)], [0.0, 0.0]),  # the disk went idle in between
        (2, [(0.0, 3.0), (0.0, 1.0), (0.0, 1.0)], [0.0, 0.0, 3.0]),  # each write after the one before
    ],
)
def test_disk_writes_hold_a_step_only_while_the_queue_is_full(
    depth: int, writes: list[tuple[float, float]], waits: list[float]
) -> None:
    queue = DiskWrites(depth)
    assert [queue.queue(now, seconds) for now, seconds in writes] == pytest.approx(waits)
