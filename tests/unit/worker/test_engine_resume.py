"""An engine resumes a stream another engine began: handed the output tokens already sent, it goes on
exactly as the first engine would have (greedy, seeded sampling, penalties, budgets, stop strings
across the cut, a grammar), and a resumed stream's text is the rest of the undisturbed one's."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from support.engine import make_engine, random_prompts

from herd.api.prompt import PromptRenderer
from herd.worker.engine import LLMEngine
from herd.worker.grammar import GrammarCompiler, GrammarSpec
from herd.worker.outputs import RequestOutput
from herd.worker.sampling_params import InvalidParamError, SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "tags": {"type": "array", "maxItems": 3}},
    "required": ["name", "tags"],
    "additionalProperties": False,
}

CASES = {
    "greedy": SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
    "seeded": SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=7, ignore_eos=True),
    "seeded-top-k": SamplingParams(max_tokens=12, temperature=1.3, top_k=40, seed=-3, ignore_eos=True),
    "penalties-and-bias": SamplingParams(
        max_tokens=12,
        temperature=0.0,
        presence_penalty=1.5,
        frequency_penalty=0.7,
        repetition_penalty=1.3,
        logit_bias={5: 3.0, 9: -100.0},
        ignore_eos=True,
    ),
    "min-tokens-over-the-cut": SamplingParams(max_tokens=12, min_tokens=8, temperature=0.8, seed=11),
}


@pytest.fixture(scope="module")
def engine(tiny_llama: Path) -> LLMEngine:
    return make_engine(tiny_llama, num_blocks=64)


@pytest.fixture(scope="module")
def renderer(tiny_llama: Path) -> PromptRenderer:
    return PromptRenderer.from_pretrained(tiny_llama)


def run(engine: LLMEngine, request_id: str, max_steps: int = 64) -> list[RequestOutput]:
    outputs: list[RequestOutput] = []
    for _ in range(max_steps):
        outputs += [output for output in engine.step() if output.request_id == request_id]
        if outputs and outputs[-1].finished:
            return outputs
    raise AssertionError(f"{request_id} did not finish in {max_steps} steps")


def tokens(outputs: list[RequestOutput]) -> list[int]:
    return [token for output in outputs for token in output.new_token_ids]


def text(outputs: list[RequestOutput]) -> str:
    return "".join(output.new_text for output in outputs)


def assert_resumes(engine: LLMEngine, prompt: list[int], params: SamplingParams, cut: int) -> None:
    engine.add_request("whole", prompt, params)
    whole = run(engine, "whole")
    sent, rest = whole[:cut], whole[cut:]
    resumed = engine.add_request(f"resumed-{cut}", prompt, params, resumed_token_ids=tokens(sent))
    assert resumed is not None and resumed.is_resumed and not resumed.finished
    assert resumed.new_token_ids == tokens(sent) and resumed.new_text == text(sent)
    after = run(engine, f"resumed-{cut}")
    assert tokens(after) == tokens(rest)
    assert text(after) == text(rest)
    assert after[-1].finish_reason == whole[-1].finish_reason
    assert after[-1].num_output_tokens == whole[-1].num_output_tokens
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_total_blocks


@pytest.mark.parametrize("cut", [1, 5, 10])
@pytest.mark.parametrize("params", CASES.values(), ids=CASES.keys())
def test_a_resumed_request_goes_on_as_the_undisturbed_one(
    engine: LLMEngine, params: SamplingParams, cut: int
) -> None:
    prompt = random_prompts([37], vocab_size=200)[0]
    assert_resumes(engine, prompt, params, cut)


def test_a_stop_string_that_spans_the_cut_stops_the_resumed_request(engine: LLMEngine) -> None:
    prompt = random_prompts([29], vocab_size=200)[0]
    plain = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    engine.add_request("plain", prompt, plain)
    outputs = run(engine, "plain")
    boundary = len(text(outputs[:4]))
    stop = text(outputs)[boundary - 2 : boundary + 3]  # two characters before token 5, three after
    assert len(stop) == 5 and stop not in text(outputs)[: boundary - 2]
    params = replace(plain, stop=(stop,))
    engine.add_request("stopped", prompt, params)
    whole = run(engine, "stopped")
    assert whole[-1].finish_reason == "stop" and stop not in text(whole)
    for cut in (3, 4):  # the stop string's first characters are held back at the cut
        assert_resumes(engine, prompt, params, cut)


@pytest.mark.parametrize("cut", [2, 6])
def test_a_grammar_constrained_request_resumes_in_its_grammar(
    engine: LLMEngine, renderer: PromptRenderer, cut: int
) -> None:
    compiler = GrammarCompiler(renderer.tokenizer.to_str(), engine.vocab_size, renderer.eos_token_ids)
    grammar = compiler.compile(GrammarSpec.json_schema(SCHEMA, "response_format"))
    params = SamplingParams(max_tokens=40, temperature=0.7, seed=5, grammar=grammar)
    prompt = random_prompts([21], vocab_size=200)[0]
    assert_resumes(engine, prompt, params, cut)


@pytest.mark.parametrize(
    ("params", "resumed", "problem"),
    [
        (SamplingParams(max_tokens=4, temperature=0.0), [1, 2, 3, 4], "would have finished"),
        (
            SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=(7,)),
            [3, 7, 4],
            "would have finished",
        ),
        (SamplingParams(max_tokens=8, temperature=0.0), [3, 10**6], "outside this model's vocabulary"),
    ],
    ids=["past-max-tokens", "past-a-stop-token", "not-a-token"],
)
def test_tokens_the_request_cannot_have_produced_are_refused(
    engine: LLMEngine, params: SamplingParams, resumed: list[int], problem: str
) -> None:
    prompt = random_prompts([12], vocab_size=200)[0]
    with pytest.raises(InvalidParamError, match=problem) as refused:
        engine.add_request("refused", prompt, params, resumed_token_ids=resumed)
    assert refused.value.param == "herd_resume"
    assert not engine.has_unfinished_requests()


def test_a_speculating_engine_refuses_to_resume_a_seeded_stream(tiny_llama: Path) -> None:
    """Speculation draws its randomness per proposal, not one race per token: a seeded stream could
    not go on as the first worker's would, so it is refused by name; greedy streams still resume."""
    speculating = make_engine(
        tiny_llama, num_blocks=64, speculative={"method": "ngram", "numTokens": 3, "adaptive": False}
    )
    prompt = random_prompts([12], vocab_size=200)[0]
    with pytest.raises(InvalidParamError, match="cannot resume on a worker that speculates") as refused:
        speculating.add_request("seeded", prompt, CASES["seeded"], resumed_token_ids=[3, 4])
    assert refused.value.param == "herd_resume"
    assert speculating.add_request("greedy", prompt, CASES["greedy"], resumed_token_ids=[3, 4]) is not None
