"""The runner seam: the same engine on the torch runner and on the cost-model runner.

Both engines get the same prompts (a shared prefix, a pool too small for the batch) and must make
the same scheduling decisions step by step: the same chunks, the same preemptions, the same prefix
cache hits and the same shape of KV events. Only the sampled tokens differ (a model's against a
hash), and no decision depends on them: no two prompts are equal.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support.engine import make_config, random_prompts

from herd.api.prompt import PromptRenderer
from herd.api.protocol import KVEvent
from herd.worker.cache_geometry import CacheGeometry
from herd.worker.engine import LLMEngine
from herd.worker.kv_tiers import KVMove
from herd.worker.model_runner import TorchRunner
from herd.worker.outputs import RequestOutput
from herd.worker.pooling import PoolingConfig
from herd.worker.runner import Measured, Runner, StepResult
from herd.worker.sampling_params import SamplingParams
from herd.worker.scheduler import SchedulerOutput
from herd.worker.simulated_runner import SimulatedRunner, VirtualClock, simulated_engine

pytestmark = pytest.mark.timeout(120)

PREFIX = random_prompts([40], vocab_size=384, seed=5)[0]
PROMPTS = [PREFIX + tail for tail in random_prompts([9, 30, 17, 4, 25, 12], vocab_size=384, seed=6)]
PARAMS = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
MAX_STEPS = 500

Plan = tuple[tuple[tuple[str, int, int], ...], tuple[str, ...]]


class RecordingRunner:
    """A runner that notes each plan it executes: (request id, first token, tokens) per chunk, and
    the sequences preempted for it."""

    def __init__(self, runner: Runner) -> None:
        self.runner = runner
        self.plans: list[Plan] = []

    @property
    def geometry(self) -> CacheGeometry:
        return self.runner.geometry

    @property
    def vocab_size(self) -> int:
        return self.runner.vocab_size

    @property
    def measured(self) -> Measured:
        return self.runner.measured

    @property
    def pooling(self) -> PoolingConfig | None:
        return self.runner.pooling

    def move_blocks(self, moves: list[KVMove]) -> None:
        self.runner.move_blocks(moves)

    def execute(self, plan: SchedulerOutput) -> list[StepResult]:
        chunks = tuple((chunk.seq.request_id, chunk.start, chunk.num_tokens) for chunk in plan.chunks)
        self.plans.append((chunks, tuple(seq.request_id for seq in plan.preempted)))
        return self.runner.execute(plan)

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        return self.runner.read_blocks(block_ids)

    def write_blocks(self, block_ids: list[int | None], kv: torch.Tensor) -> None:
        self.runner.write_blocks(block_ids, kv)

    def check_health(self) -> None:
        self.runner.check_health()


def _run(engine: LLMEngine) -> tuple[dict[str, RequestOutput], list[KVEvent]]:
    """Every prompt to completion under a fixed id; each request's last output, and the KV events."""
    for index, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{index}", prompt, PARAMS)
    finished: dict[str, RequestOutput] = {}
    events: list[KVEvent] = []
    for _ in range(MAX_STEPS):
        if not engine.has_unfinished_requests():
            return finished, events
        finished |= {output.request_id: output for output in engine.step() if output.finished}
        events += engine.drain_kv_events()
    raise AssertionError(f"requests still unfinished after {MAX_STEPS} steps")


def test_the_cost_model_schedules_as_the_torch_runner_does(tiny_llama: Path) -> None:
    config = make_config(tiny_llama, num_blocks=10, maxBatchSize=3)
    renderer = PromptRenderer.from_pretrained(tiny_llama)
    torch_runner = RecordingRunner(TorchRunner(config, renderer.eos_token_ids))
    clock = VirtualClock()
    cost_runner = RecordingRunner(
        SimulatedRunner(
            torch_runner.geometry,
            torch_runner.vocab_size,
            clock=clock,
            avoid_token_ids=renderer.eos_token_ids,
        )
    )
    real, simulated = LLMEngine(config, torch_runner, renderer), LLMEngine(config, cost_runner, renderer)
    real_outputs, real_events = _run(real)
    simulated_outputs, simulated_events = _run(simulated)

    assert cost_runner.plans == torch_runner.plans
    assert any(preempted for _, preempted in torch_runner.plans)
    assert real.stats == simulated.stats
    assert simulated.stats.prefix_cache_hits > 0 and simulated.stats.num_preemptions > 0
    cached = {rid: (out.num_cached_tokens, out.num_output_tokens) for rid, out in real_outputs.items()}
    assert {
        rid: (out.num_cached_tokens, out.num_output_tokens) for rid, out in simulated_outputs.items()
    } == cached
    assert [(e.kind, len(e.block_hashes)) for e in simulated_events] == [
        (e.kind, len(e.block_hashes)) for e in real_events
    ]
    assert {e.kind for e in simulated_events} == {"stored", "removed"}
    num_tokens = sum(n for chunks, _ in cost_runner.plans for _, _, n in chunks)
    assert clock.now == pytest.approx((60.0 * len(cost_runner.plans) + 1.5 * num_tokens) / 1000)
    assert simulated.load_report().num_free_blocks == simulated.block_manager.num_total_blocks


def test_a_simulated_engine_announces_the_real_models_layout(tiny_llama: Path) -> None:
    config = make_config(tiny_llama, num_blocks=14)
    real = TorchRunner(config, ())
    simulated = simulated_engine(config, num_blocks=99)
    assert simulated.runner.geometry == CacheGeometry(**{**vars(real.geometry), "num_blocks": 99})
    assert simulated.vocab_size == real.vocab_size
    assert simulated.info.model == "test-model" and simulated.info.num_layers == real.geometry.num_layers


def test_the_torch_runner_copies_the_plans_blocks_before_its_forward(tiny_llama: Path) -> None:
    config = make_config(tiny_llama, num_blocks=8)
    runner = TorchRunner(config, ())
    engine = LLMEngine(config, runner, PromptRenderer.from_pretrained(tiny_llama))
    kv = torch.randn(runner.read_blocks([1]).shape)
    runner.write_blocks([None, 1], torch.cat([torch.zeros_like(kv), kv], dim=2))
    engine.add_request("r", PROMPTS[0], PARAMS)
    plan = engine.scheduler.schedule()
    assert 1 in plan.chunks[0].seq.block_table and 7 not in plan.chunks[0].seq.block_table
    plan.block_copies.append((1, 7))
    [token] = runner.execute(plan)
    assert not isinstance(token, Exception)
    assert torch.equal(runner.read_blocks([7]), kv)  # copied before the forward wrote block 1
    assert not torch.equal(runner.read_blocks([1]), kv)
