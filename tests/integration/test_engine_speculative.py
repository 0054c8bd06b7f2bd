"""Speculative decoding in herd's engine: greedy tokens equal those without speculation, with the
n-gram proposer and with a draft model, through batching, chunked prefill, the prefix cache,
preemption and stops; KV slots of rejected proposals go back to the pool; the counters add up.

The prompts repeat themselves (a passage, then the passage again), as an input-grounded request's
output repeats its input, so that the n-gram proposer has something to propose. The draft model
is either the target itself (every proposal accepted) or another tiny random model with the same
tokenizer (most proposals rejected): both must give the target's own tokens. With the engine's
other features: LoRA requests (verified with their adapter; n-gram proposals beside a draft model,
which has none), grammar-constrained requests (no proposals, their masks kept), KV tiers (n-gram);
an embedding model refuses speculation.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from support.engine import GREEDY, generate_with_adapters, make_config, make_engine, random_prompts

from herd.worker.engine import LLMEngine
from herd.worker.outputs import RequestOutput
from herd.worker.sampling_params import SamplingParams
from herd.worker.simulated_runner import simulated_engine

NGRAM = {"method": "ngram", "numTokens": 4, "adaptive": False, "promptLookupMin": 1}


@pytest.fixture(scope="module")
def other_llama(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A smaller draft for ``tiny_llama``: its first layer alone (same embeddings, head and
    tokenizer), which agrees with it on some tokens and not on others."""
    import shutil

    from transformers import AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("tiny-llama-draft")
    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    model.model.layers = model.model.layers[:1]
    model.config.num_hidden_layers = 1
    model.save_pretrained(folder, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_llama / name, folder / name)
    return folder


def grounded_prompts(seed: int = 0) -> list[list[int]]:
    """Prompts whose tail repeats their head, and two without any repeat."""
    passages = random_prompts([24, 40, 17], vocab_size=384, seed=seed)
    return [passage + passage[: len(passage) // 2] for passage in passages] + random_prompts(
        [9, 30], vocab_size=384, seed=seed + 1
    )


def tokens(results: list[RequestOutput]) -> list[list[int]]:
    return [result.new_token_ids for result in results]


def assert_same_as_plain(path: Path, prompts: list[list[int]], params: Any, **engine: Any) -> LLMEngine:
    """Speculation (``engine``) gives the plain engine's tokens; returns the speculating engine."""
    plain = make_engine(path).generate(prompts, params)
    speculating = make_engine(path, **engine)
    results = speculating.generate(prompts, params)
    assert tokens(results) == tokens(plain)
    assert [r.finish_reason for r in results] == [r.finish_reason for r in plain]
    assert speculating.load_report().num_free_blocks == speculating.block_manager.num_total_blocks
    return speculating


def draft_spec(path: Path, num_tokens: int = 3) -> dict[str, Any]:
    return {"method": "draft", "draftModel": f"file://{path}", "numTokens": num_tokens, "adaptive": False}


@pytest.mark.parametrize("model", ["tiny_llama", "tiny_qwen3"])
def test_ngram_greedy_tokens_equal_plain_decoding(model: str, request: pytest.FixtureRequest) -> None:
    path: Path = request.getfixturevalue(model)
    engine = assert_same_as_plain(path, grounded_prompts(), GREEDY, speculative=NGRAM)
    stats = engine.stats
    assert stats.spec_num_drafts > 0
    assert 0 < stats.spec_num_accepted_tokens <= stats.spec_num_draft_tokens
    per_pos = stats.spec_accepted_per_pos
    assert sum(per_pos) == stats.spec_num_accepted_tokens
    assert all(a >= b for a, b in zip([stats.spec_num_drafts, *per_pos], per_pos, strict=False))
    assert stats.generation_tokens == 32 * len(grounded_prompts())


def test_draft_model_greedy_tokens_equal_plain_decoding(tiny_llama: Path, other_llama: Path) -> None:
    engine = assert_same_as_plain(tiny_llama, grounded_prompts(), GREEDY, speculative=draft_spec(other_llama))
    stats = engine.stats
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens  # some rejected


def test_the_target_as_its_own_draft_accepts_everything(tiny_llama: Path) -> None:
    engine = assert_same_as_plain(tiny_llama, grounded_prompts(), GREEDY, speculative=draft_spec(tiny_llama))
    stats = engine.stats
    assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens > 0
    assert stats.num_steps < 16  # 32 tokens at up to 4 a step, plus the prefill


@pytest.mark.parametrize("draft", ["ngram", "draft"])
def test_chunked_prefill_and_prefix_cache_with_speculation(
    draft: str, tiny_llama: Path, other_llama: Path
) -> None:
    spec = NGRAM if draft == "ngram" else draft_spec(other_llama)
    [prefix] = random_prompts([40], vocab_size=384, seed=5)
    prompts = [prefix + prefix[:20] + tail for tail in random_prompts([3, 11], vocab_size=384, seed=6)]
    plain = make_engine(tiny_llama, maxBatchTokens=16).generate(prompts, GREEDY)
    engine = make_engine(tiny_llama, maxBatchTokens=16, speculative=spec)
    first = engine.generate(prompts, GREEDY)
    again = engine.generate(prompts, GREEDY)  # a prefix-cache hit on blocks computed with proposals
    assert tokens(first) == tokens(again) == tokens(plain)
    assert all(result.num_cached_tokens >= 48 for result in again)


@pytest.mark.parametrize("draft", ["ngram", "draft"])
def test_preemption_with_speculation(draft: str, tiny_llama: Path, other_llama: Path) -> None:
    spec = NGRAM if draft == "ngram" else draft_spec(other_llama)
    prompts = [p + p for p in random_prompts([15, 22, 10, 19, 25, 12], vocab_size=384, seed=21)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    plain = make_engine(tiny_llama).generate(prompts, params)
    small = make_engine(tiny_llama, num_blocks=14, speculative=spec)
    assert tokens(small.generate(prompts, params)) == tokens(plain)
    assert small.stats.num_preemptions > 0
    assert small.load_report().num_free_blocks == small.block_manager.num_total_blocks


def test_a_stop_among_accepted_tokens_ends_the_request_there(tiny_llama: Path) -> None:
    prompts = grounded_prompts()
    plain = make_engine(tiny_llama).generate(prompts, GREEDY)
    stops = {tokens[10] for tokens in tokens(plain)}  # each request stops by its 11th token at the latest
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, stop_token_ids=tuple(stops))
    engine = assert_same_as_plain(tiny_llama, prompts, params, speculative=draft_spec(tiny_llama, 4))
    assert engine.stats.spec_num_accepted_tokens > 0


def test_penalties_and_min_tokens_see_the_proposed_tokens(tiny_llama: Path) -> None:
    params = SamplingParams(
        max_tokens=24, min_tokens=12, temperature=0.0, frequency_penalty=0.7, repetition_penalty=1.3
    )
    assert_same_as_plain(tiny_llama, grounded_prompts(seed=3), params, speculative=draft_spec(tiny_llama))


@pytest.mark.parametrize("draft", ["ngram", "draft"])
def test_sampled_requests_with_logprobs(draft: str, tiny_qwen3: Path) -> None:
    spec = NGRAM if draft == "ngram" else draft_spec(tiny_qwen3)
    engine = make_engine(tiny_qwen3, speculative=spec)
    params = [
        SamplingParams(max_tokens=20, temperature=0.7, top_p=0.9, seed=i, logprobs=2, ignore_eos=True)
        for i in range(4)
    ]
    results = engine.generate(grounded_prompts()[:4], params)
    assert all(r.error is None and r.num_output_tokens == 20 for r in results)
    assert all(r.logprobs is not None and len(r.logprobs) == 20 for r in results)
    assert engine.stats.spec_num_drafts > 0
    again = make_engine(tiny_qwen3, speculative=spec).generate(grounded_prompts()[:4], params)
    assert tokens(again) == tokens(results)  # seeded requests repeat, speculation or not


def test_adaptive_speculation_keeps_the_tokens(tiny_llama: Path) -> None:
    spec = {**NGRAM, "adaptive": True}
    assert_same_as_plain(tiny_llama, grounded_prompts() * 3, GREEDY, speculative=spec)


def test_the_simulated_engine_speculates_by_ngram(tiny_llama: Path) -> None:
    prompts = grounded_prompts()
    params = SamplingParams(max_tokens=24, temperature=0.0)
    plain = simulated_engine(make_config(tiny_llama, backend="simulated"), num_blocks=256)
    speculating = simulated_engine(
        make_config(tiny_llama, backend="simulated", speculative=NGRAM), num_blocks=256
    )
    assert tokens(speculating.generate(prompts, params)) == tokens(plain.generate(prompts, params))
    assert speculating.stats.spec_num_draft_tokens > 0


def test_the_simulated_engine_refuses_a_draft_model(tiny_llama: Path) -> None:
    with pytest.raises(ValueError, match="simulated"):
        make_config(tiny_llama, backend="simulated", speculative=draft_spec(tiny_llama))


@pytest.mark.parametrize("draft", ["ngram", "draft"])
def test_lora_requests_speculate_with_their_adapter(
    draft: str, tiny_llama: Path, other_llama: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The target verifies with each sequence's adapter; the draft model has none, so an adapter's
    sequence gets n-gram proposals from it (its tokens are still the plain LoRA engine's)."""
    from support.lora import make_peft_adapter

    from herd.worker.model_runner import torch_engine

    adapter = make_peft_adapter(tiny_llama, tmp_path_factory.mktemp("spec-lora"), rank=8, seed=1)
    prompts = grounded_prompts()
    requests = [(prompt, "a" if index % 2 == 0 else None) for index, prompt in enumerate(prompts)]

    def engine(**spec: Any) -> LLMEngine:
        config = make_config(tiny_llama, **spec).model_copy(update={"lora_modules": {"a": adapter}})
        return torch_engine(config)

    plain = generate_with_adapters(engine(), requests, GREEDY)
    speculating = engine(speculative=NGRAM if draft == "ngram" else draft_spec(other_llama))
    assert generate_with_adapters(speculating, requests, GREEDY) == plain
    assert plain[0] != make_engine(tiny_llama).generate([prompts[0]], GREEDY)[0].new_token_ids  # adapted
    assert speculating.stats.spec_num_drafts > 0


def test_a_constrained_request_decodes_under_its_grammar_beside_speculating_ones(tiny_llama: Path) -> None:
    """A grammar masks one row a step: its sequence gets no draft slots, the others speculate."""
    from herd.api.prompt import PromptRenderer
    from herd.worker.grammar import GrammarCompiler, GrammarSpec

    renderer = PromptRenderer.from_pretrained(tiny_llama)
    compiler = GrammarCompiler(renderer.tokenizer.to_str(), renderer.vocab_size, renderer.eos_token_ids)
    regex = SamplingParams(
        max_tokens=16, temperature=0.0, grammar=compiler.compile(GrammarSpec("regex", "[0-9]{3}-[a-z]{2}"))
    )
    prompts = grounded_prompts()
    params = [regex, *[GREEDY] * (len(prompts) - 1)]
    engine = assert_same_as_plain(tiny_llama, prompts, params, speculative=NGRAM)
    assert engine.stats.spec_num_drafts > 0
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", engine.generate(prompts[:1], regex)[0].new_text)


def test_ngram_speculation_with_kv_tiers_keeps_the_tokens(tiny_llama: Path) -> None:
    """Blocks evicted to the host tier and restored on a hit hold accepted tokens' KV only."""
    prompts = grounded_prompts()
    tiers = {"hostMemoryGiB": 1 / 64}
    plain = make_engine(tiny_llama, num_blocks=16).generate(prompts, GREEDY)
    engine = make_engine(tiny_llama, num_blocks=16, kvCache=tiers, speculative=NGRAM)
    for _ in range(2):  # the second pass restores the first pass's evicted prompts from the tier
        assert tokens(engine.generate(prompts, GREEDY)) == tokens(plain)
    assert engine.stats.kv_tiers.restored.get("host", 0) > 0
    assert engine.stats.spec_num_accepted_tokens > 0


def test_an_embedding_model_refuses_speculation(tiny_bert: Path) -> None:
    from herd.worker.model_runner import torch_engine
    from herd.worker.models import UnsupportedModelError

    with pytest.raises(UnsupportedModelError, match=r"engine\.speculative applies to generation"):
        torch_engine(make_config(tiny_bert, speculative=NGRAM))
