"""Engine vs transformers (the reference): greedy tokens and logprobs, alone, batched, cached, chunked.

Logprob tolerance: ``support.engine.LOGPROB_ATOL`` (1e-3 absolute, float32; its docstring says why).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from support.engine import GREEDY, REFERENCE_GREEDY, assert_matches_reference, make_engine, random_prompts

LENGTHS = [19, 3, 70, 1]


@pytest.fixture(params=["tiny_llama", "tiny_qwen3"])
def tiny_model(request: pytest.FixtureRequest) -> Path:
    path: Path = request.getfixturevalue(request.param)
    return path


def prompts_for(path: Path, lengths: list[int] = LENGTHS) -> list[list[int]]:
    return random_prompts(lengths, vocab_size=384 if "tiny" in str(path) else 49152)


def assert_matches_transformers(path: Path, prompts: list[list[int]], **engine: object) -> None:
    assert_matches_reference(path, prompts, make_engine(path, **engine).generate(prompts, REFERENCE_GREEDY))


def test_greedy_batch_matches_transformers(tiny_model: Path) -> None:
    assert_matches_transformers(tiny_model, prompts_for(tiny_model))


def test_tiny_chunked_prefill_budget_matches_transformers(tiny_model: Path) -> None:
    assert_matches_transformers(tiny_model, prompts_for(tiny_model), maxBatchTokens=32)


def test_batch_equals_each_prompt_alone(tiny_model: Path) -> None:
    prompts = prompts_for(tiny_model)
    batched = make_engine(tiny_model).generate(prompts, GREEDY)
    alone = [make_engine(tiny_model).generate([prompt], GREEDY)[0] for prompt in prompts]
    assert [r.new_token_ids for r in batched] == [r.new_token_ids for r in alone]


def test_prefix_cache_hits_give_the_same_tokens(tiny_model: Path) -> None:
    [prefix] = prompts_for(tiny_model, [64])
    prompts = [prefix + tail for tail in prompts_for(tiny_model, [5, 17, 1])]
    engine = make_engine(tiny_model, maxBatchTokens=48)
    cold = engine.generate([prefix], GREEDY)
    warm = engine.generate(prompts, GREEDY)
    again = engine.generate([prefix], GREEDY)
    assert all(result.num_cached_tokens >= 64 for result in warm)
    assert again[0].num_cached_tokens == 48  # 64 tokens: the last full block is recomputed for its logits
    fresh = [
        make_engine(tiny_model, kvCache={"prefixCaching": False}).generate([p], GREEDY)[0] for p in prompts
    ]
    assert [r.new_token_ids for r in warm] == [r.new_token_ids for r in fresh]
    assert again[0].new_token_ids == cold[0].new_token_ids


@pytest.mark.slow
def test_demo_model_matches_transformers(demo_model: Path) -> None:
    from herd.api.prompt import PromptRenderer

    renderer = PromptRenderer.from_pretrained(demo_model)
    texts = ["The capital of France is", "def fibonacci(n):"]
    prompts = [renderer.encode(text) for text in texts]
    assert_matches_transformers(demo_model, prompts, maxBatchTokens=16)
