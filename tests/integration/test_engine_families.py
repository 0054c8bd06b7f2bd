"""Each model family herd runs beside Llama, against transformers on a tiny random checkpoint:
sliding windows (Mistral's on every layer, Qwen2/Qwen3's from ``max_window_layers``, Qwen3-MoE's),
Gemma 2 (soft-capped attention and logits, local and global layers), Gemma 3 (q/k norms, the local
layers' own rope, the global ones' scaled) and Qwen3-MoE (top-k experts, renormalized or not,
dense layers among the sparse ones).

Every run has chunked prefill and prefix caching on: a 70-token prompt is over the window (20) and
over the step's token budget (32), and a second request reuses its first 64 tokens from the cache.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from support.engine import (
    REFERENCE_GREEDY,
    WINDOW,
    assert_matches_reference,
    make_engine,
    make_tiny_variant,
    random_prompts,
)

FAMILIES = [
    "mistral-window",
    "qwen2-window",
    "qwen3-window",
    "gemma2",
    "gemma3",
    "qwen3-moe",
    "qwen3-moe-window",
]
BUDGET = 32


@pytest.fixture(scope="module", params=FAMILIES)
def family(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path
) -> Path:
    return make_tiny_variant(tmp_path_factory.mktemp(request.param), tiny_llama, request.param)


def test_family_matches_transformers_with_chunked_prefill_and_cached_prefix(family: Path) -> None:
    long, short, medium, tail = random_prompts([70, 5, 33, 9], vocab_size=384, seed=2)
    assert len(long) > max(WINDOW, BUDGET)
    engine = make_engine(family, maxBatchTokens=BUDGET)
    batch = [long, short, medium]
    assert_matches_reference(family, batch, engine.generate(batch, REFERENCE_GREEDY))
    sharing = long[:64] + tail
    [warm] = engine.generate([sharing], REFERENCE_GREEDY)
    assert warm.num_cached_tokens == 64
    assert_matches_reference(family, [sharing], [warm])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("arch", ["gemma2", "gemma3", "qwen3-moe"])
def test_family_runs_in_half_precision(tmp_path: Path, tiny_llama: Path, arch: str, dtype: str) -> None:
    engine = make_engine(make_tiny_variant(tmp_path / arch, tiny_llama, arch), dtype=dtype)
    assert str(engine.runner.kv_cache.dtype) == f"torch.{dtype}"
    [result] = engine.generate(random_prompts([40], vocab_size=384), REFERENCE_GREEDY)
    assert result.num_output_tokens == 32
    assert result.logprobs is not None and all(lp.logprob <= 0.0 for lp in result.logprobs)
