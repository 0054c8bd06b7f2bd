"""More of the Llama family against transformers: Qwen2 (q/k/v biases, tied embeddings), Mistral,
Llama 3 rope scaling; each saved as a sharded checkpoint (``model.safetensors.index.json``); and the
half-precision dtypes run."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.engine import REFERENCE_GREEDY, hf_greedy, make_engine, make_tiny_variant, random_prompts


@pytest.mark.parametrize("arch", ["qwen2", "mistral", "llama3-rope"])
def test_variant_matches_transformers(tmp_path: Path, tiny_llama: Path, arch: str) -> None:
    folder = make_tiny_variant(tmp_path / arch, tiny_llama, arch)
    assert (folder / "model.safetensors.index.json").exists()
    prompts = random_prompts([90, 5], vocab_size=384, seed=2)  # 90 > 64 original positions: scaling matters
    results = make_engine(folder).generate(prompts, REFERENCE_GREEDY)
    for prompt, result in zip(prompts, results, strict=True):
        assert result.new_token_ids == hf_greedy(folder, prompt, 32)[0]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_runs(tiny_qwen3: Path, dtype: str) -> None:
    engine = make_engine(tiny_qwen3, dtype=dtype)
    assert engine.info.dtype == dtype
    assert str(engine.runner.kv_cache.dtype) == f"torch.{dtype}"
    [result] = engine.generate(random_prompts([20], vocab_size=384), REFERENCE_GREEDY)
    assert result.num_output_tokens == 32
