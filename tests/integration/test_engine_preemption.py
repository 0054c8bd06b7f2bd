"""Preemption by recompute: a KV pool too small for the batch still completes every request, unchanged."""

from __future__ import annotations

from pathlib import Path

from support.engine import make_engine, random_prompts

from herd.worker.sampling_params import SamplingParams

PARAMS = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


def test_small_pool_preempts_and_matches_unconstrained(tiny_llama: Path) -> None:
    prompts = random_prompts([30, 45, 20, 38, 50, 25], vocab_size=384, seed=21)
    reference = make_engine(tiny_llama).generate(prompts, PARAMS)
    small = make_engine(tiny_llama, num_blocks=12)  # the batch needs ~30 blocks at its peak
    constrained = small.generate(prompts, PARAMS)
    assert small.stats.num_preemptions > 0
    assert [r.new_token_ids for r in constrained] == [r.new_token_ids for r in reference]
    assert all(r.finish_reason == "length" and r.num_output_tokens == 40 for r in constrained)
    assert small.load_report().num_free_blocks == 12


def test_seeded_sampling_survives_preemption(tiny_qwen3: Path) -> None:
    prompts = random_prompts([30, 45, 20, 38], vocab_size=384, seed=22)
    params = [
        SamplingParams(max_tokens=30, temperature=0.8, top_p=0.9, seed=i, ignore_eos=True) for i in range(4)
    ]
    reference = make_engine(tiny_qwen3).generate(prompts, params)
    small = make_engine(tiny_qwen3, num_blocks=9)
    constrained = small.generate(prompts, params)
    assert small.stats.num_preemptions > 0
    assert [r.new_token_ids for r in constrained] == [r.new_token_ids for r in reference]
