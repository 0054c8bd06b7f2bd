"""A decode engine continues from a first token sampled elsewhere (a prefill worker's)."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.engine import make_engine, random_prompts

from herd.worker.engine import LLMEngine
from herd.worker.outputs import RequestOutput
from herd.worker.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture
def engine(tiny_llama: Path) -> LLMEngine:
    return make_engine(tiny_llama, num_blocks=32)


def run(engine: LLMEngine, request_id: str, max_steps: int = 16) -> list[RequestOutput]:
    outputs: list[RequestOutput] = []
    for _ in range(max_steps):
        outputs += [output for output in engine.step() if output.request_id == request_id]
        if outputs and outputs[-1].finished:
            break
    return outputs


def tokens(outputs: list[RequestOutput]) -> list[int]:
    return [token for output in outputs for token in output.new_token_ids]


@pytest.mark.parametrize("prompt_len", [16 * 3, 16 * 3 + 5], ids=["block-aligned", "partial-block"])
def test_greedy_output_continuing_from_the_handed_token_equals_a_plain_run(
    engine: LLMEngine, prompt_len: int
) -> None:
    prompt = random_prompts([prompt_len], vocab_size=200)[0]
    engine.add_request("plain", prompt, GREEDY)
    expected = tokens(run(engine, "plain"))
    first = engine.add_request("handed", prompt, GREEDY, first_token_id=expected[0])
    assert first is not None and first.new_token_ids == [expected[0]] and not first.finished
    assert first.num_output_tokens == 1
    rest = run(engine, "handed")
    assert [first.new_token_ids[0], *tokens(rest)] == expected
    assert rest[-1].num_output_tokens == GREEDY.max_tokens
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_total_blocks


def test_the_engine_continues_from_whatever_token_it_is_handed(engine: LLMEngine) -> None:
    prompt = random_prompts([40], vocab_size=200)[0]
    engine.add_request("plain", prompt, GREEDY)
    greedy_first = tokens(run(engine, "plain"))[0]
    other = (greedy_first + 1) % 200
    engine.add_request("handed", prompt, GREEDY, first_token_id=other)
    handed = tokens(run(engine, "handed"))
    engine.add_request("reference", [*prompt, other], GREEDY)
    assert handed == tokens(run(engine, "reference"))[: GREEDY.max_tokens - 1]


@pytest.mark.parametrize(
    ("params", "reason"),
    [
        (SamplingParams(max_tokens=1, temperature=0.0), "length"),
        (SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=(7,)), "stop"),
    ],
    ids=["max-tokens-1", "stop-token"],
)
def test_a_handed_token_that_ends_the_request_finishes_it_without_a_step(
    engine: LLMEngine, params: SamplingParams, reason: str
) -> None:
    first = engine.add_request("r", random_prompts([40], vocab_size=200)[0], params, first_token_id=7)
    assert first is not None and first.finished and first.finish_reason == reason
    assert not engine.has_unfinished_requests()
    assert engine.stats.num_steps == 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_total_blocks


def test_without_a_handed_token_nothing_is_returned(engine: LLMEngine) -> None:
    assert engine.add_request("r", [1, 2, 3], GREEDY) is None


@pytest.mark.parametrize("token", [-1, 10**9], ids=["negative", "beyond-vocab"])
def test_a_token_outside_the_vocabulary_is_refused(engine: LLMEngine, token: int) -> None:
    with pytest.raises(ValueError, match="outside this model's vocabulary"):
        engine.add_request("r", [1, 2, 3], GREEDY, first_token_id=token)
    assert not engine.has_unfinished_requests()
