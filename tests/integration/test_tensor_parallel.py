"""Tensor parallelism on the CPU (gloo): TP=2 gives the greedy tokens of TP=1, on a tiny random
Llama (its heads split evenly) and on SmolLM2 (9 query and 3 KV heads: split 2 + 1 KV groups)."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.worker_server import engine_config

from herd.worker.engine import LLMEngine
from herd.worker.model_runner import TorchRunner, torch_engine
from herd.worker.models import UnsupportedModelError
from herd.worker.parallel import partition
from herd.worker.sampling_params import SamplingParams

pytestmark = [pytest.mark.timeout(600)]

PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
QUESTIONS = ["What is the capital of France?", "Tell me a story about a cat.", "Kubernetes runs pods on"]


def greedy(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    return [output.new_token_ids for output in engine.generate(prompts, PARAMS)]


def tokens_at(model: Path, size: int, prompts: list[str], **engine: object) -> list[list[int]]:
    """The greedy tokens of ``prompts`` (a batch, then a prefix-cached rerun) on ``size`` ranks."""
    built = torch_engine(engine_config(model, tensorParallelSize=size, **engine))
    try:
        ids = [built.renderer.encode(prompt) for prompt in prompts]
        first, again = greedy(built, ids), greedy(built, ids)
        assert first == again  # the second run reads the prefix cache the first one wrote, per rank
        return first
    finally:
        runner = built.runner
        assert isinstance(runner, TorchRunner)
        runner.close()


@pytest.mark.parametrize(
    ("total", "parts", "expected"),
    [
        (4, 2, [(0, 2), (2, 2)]),
        (3, 2, [(0, 2), (2, 1)]),
        (1536, 2, [(0, 768), (768, 768)]),
        (5, 3, [(0, 2), (2, 2), (4, 1)]),
    ],
)
def test_partition_cuts_near_equal_runs(total: int, parts: int, expected: list[tuple[int, int]]) -> None:
    assert [partition(total, parts, index) for index in range(parts)] == expected


def test_tp2_matches_tp1_on_a_tiny_llama(tiny_llama: Path) -> None:
    assert tokens_at(tiny_llama, 2, QUESTIONS, maxBatchTokens=32) == tokens_at(
        tiny_llama, 1, QUESTIONS, maxBatchTokens=32
    )


@pytest.mark.slow
def test_tp2_matches_tp1_on_the_demo_model(demo_model: Path) -> None:
    engine = {"maxModelLen": 512, "kvCache": {"blockSize": 16, "memoryGiB": 0.05}}
    expected = tokens_at(demo_model, 1, QUESTIONS, **engine)
    assert tokens_at(demo_model, 2, QUESTIONS, **engine) == expected


def test_a_model_with_fewer_kv_heads_than_ranks_is_refused(tiny_llama: Path) -> None:
    with pytest.raises(UnsupportedModelError, match="2 KV heads cannot split over 3 ranks"):
        torch_engine(engine_config(tiny_llama, tensorParallelSize=3))
