"""The engine's request API: limits, aborts, stopping rules, seeds, logprobs, load and info."""

from __future__ import annotations

import pytest
from support.engine import make_engine, random_prompts

from herd.worker.engine import LLMEngine, PromptTooLongError, QueueFullError
from herd.worker.outputs import RequestOutput
from herd.worker.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> LLMEngine:
    from support.tiny_models import make_tiny_model

    path = make_tiny_model(tmp_path_factory.mktemp("tiny-llama-requests"), "llama")
    return make_engine(path, maxQueueLen=3, maxModelLen=256)


PROMPT = random_prompts([12], vocab_size=384, seed=1)[0]


def drain(engine: LLMEngine) -> list[RequestOutput]:
    outputs: list[RequestOutput] = []
    for _ in range(500):
        if not engine.has_unfinished_requests():
            break
        outputs.extend(engine.step())
    return outputs


def test_queue_full_is_refused(engine: LLMEngine) -> None:
    for index in range(3):
        engine.add_request(f"q{index}", PROMPT, SamplingParams(max_tokens=1))
    with pytest.raises(QueueFullError, match="maxQueueLen"):
        engine.add_request("q3", PROMPT, SamplingParams(max_tokens=1))
    drain(engine)
    engine.add_request("q4", PROMPT, SamplingParams(max_tokens=1))
    drain(engine)


def test_prompt_too_long_names_the_limit_and_lengths(engine: LLMEngine) -> None:
    with pytest.raises(PromptTooLongError, match=r"256 tokens.*250 prompt tokens plus max_tokens 16 \(266\)"):
        engine.add_request("long", [5] * 250, SamplingParams(max_tokens=16))
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize(
    ("prompt", "request_id", "match"),
    [([], "empty", "empty"), (PROMPT, "dup", "already")],
    ids=["empty-prompt", "duplicate-id"],
)
def test_bad_requests_are_refused(engine: LLMEngine, prompt: list[int], request_id: str, match: str) -> None:
    engine.add_request("dup", PROMPT, SamplingParams(max_tokens=1))
    try:
        with pytest.raises(ValueError, match=match):
            engine.add_request(request_id, prompt, SamplingParams(max_tokens=1))
    finally:
        engine.abort_request("dup")


def test_abort_frees_blocks_at_once_and_is_idempotent(engine: LLMEngine) -> None:
    total = engine.load_report().num_total_blocks
    engine.add_request("a", PROMPT * 4, SamplingParams(max_tokens=50))
    engine.step()
    assert engine.load_report().num_free_blocks < total
    assert engine.load_report().num_running == 1
    engine.abort_request("a")
    engine.abort_request("a")
    report = engine.load_report()
    assert (report.num_free_blocks, report.num_running, report.kv_usage) == (total, 0, 0.0)
    assert not engine.has_unfinished_requests()


def greedy_text(engine: LLMEngine, **params: object) -> RequestOutput:
    return engine.generate([PROMPT], SamplingParams(temperature=0.0, **params))[0]  # type: ignore[arg-type]


def test_stop_rules(engine: LLMEngine) -> None:
    free = greedy_text(engine, max_tokens=24, ignore_eos=True)
    assert (free.finish_reason, free.num_output_tokens) == ("length", 24)
    stop_id = free.new_token_ids[5]
    by_id = greedy_text(engine, max_tokens=24, ignore_eos=True, stop_token_ids=(stop_id,))
    first = free.new_token_ids.index(stop_id)
    assert by_id.new_token_ids == free.new_token_ids[: first + 1]
    assert by_id.finish_reason == "stop"
    held = greedy_text(
        engine, max_tokens=24, ignore_eos=True, stop_token_ids=(stop_id,), min_tokens=first + 2
    )
    assert stop_id not in held.new_token_ids[: first + 2]
    stop_text = free.new_text[10:14]
    by_text = greedy_text(engine, max_tokens=24, ignore_eos=True, stop=(stop_text,))
    assert by_text.finish_reason == "stop"
    assert by_text.new_text == free.new_text[: free.new_text.index(stop_text)]


def test_seed_reproducible_across_batches(engine: LLMEngine) -> None:
    seeded = SamplingParams(max_tokens=16, temperature=1.0, seed=1234, ignore_eos=True)
    plain = SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True)
    alone = engine.generate([PROMPT], seeded)[0]
    batched = engine.generate([PROMPT[:5], PROMPT, PROMPT[3:]], [plain, seeded, plain])[1]
    assert alone.new_token_ids == batched.new_token_ids
    other = engine.generate(
        [PROMPT], SamplingParams(max_tokens=16, temperature=1.0, seed=99, ignore_eos=True)
    )[0]
    assert other.new_token_ids != alone.new_token_ids


def test_logprobs_per_token(engine: LLMEngine) -> None:
    result = greedy_text(engine, max_tokens=6, ignore_eos=True, logprobs=3)
    assert result.logprobs is not None
    assert [lp.token_id for lp in result.logprobs] == result.new_token_ids
    assert all(len(lp.top) == 3 and lp.top[0][0] == lp.token_id for lp in result.logprobs)
    assert all(lp.logprob <= 0.0 for lp in result.logprobs)


def test_info_and_stats(engine: LLMEngine) -> None:
    info = engine.info
    assert (info.model, info.role, info.block_size, info.max_model_len) == ("test-model", "unified", 16, 256)
    assert (info.num_layers, info.num_kv_heads, info.head_dim, info.dtype) == (2, 2, 16, "float32")
    before = engine.stats.generation_tokens
    greedy_text(engine, max_tokens=4, ignore_eos=True)
    assert engine.stats.generation_tokens == before + 4
    assert engine.stats.prompt_tokens >= len(PROMPT)
