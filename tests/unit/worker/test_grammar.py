"""Grammar-constrained decoding (issue 15): compiling specs, the LRU cache, bitmasks, and the engine
(torch and cost-model runners) holding constrained and free requests in one batch."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import torch
from support.engine import make_config, make_engine

from herd.api.prompt import PromptRenderer
from herd.worker.engine import LLMEngine
from herd.worker.grammar import (
    CompiledGrammar,
    GrammarCompiler,
    GrammarError,
    GrammarSpec,
    MaskFiller,
    allowed_token_ids,
    apply_bitmask,
)
from herd.worker.sampling_params import InvalidParamError, SamplingParams
from herd.worker.simulated_runner import simulated_engine

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def renderer(tiny_llama: Path) -> PromptRenderer:
    return PromptRenderer.from_pretrained(tiny_llama)


@pytest.fixture(scope="module")
def compiler(renderer: PromptRenderer) -> GrammarCompiler:
    return GrammarCompiler(renderer.tokenizer.to_str(), renderer.vocab_size, renderer.eos_token_ids)


@pytest.fixture(scope="module")
def engine(tiny_llama: Path) -> LLMEngine:
    return make_engine(tiny_llama)


def _person(compiler: GrammarCompiler) -> CompiledGrammar:
    return compiler.compile(GrammarSpec.json_schema(PERSON, "response_format"))


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (GrammarSpec("regex", "[a-", "structured_outputs.regex"), "unclosed character class"),
        (GrammarSpec.json_schema({"type": "strin"}, "response_format"), "Invalid type"),
        (GrammarSpec("grammar", "start: nothing_here", "structured_outputs.grammar"), "unknown name"),
        (GrammarSpec("regex", "[^\\s\\S]", "structured_outputs.regex"), "admits no output"),
    ],
    ids=["bad-regex", "bad-schema-type", "bad-lark", "empty-language"],
)
def test_a_spec_that_does_not_compile_names_its_field(
    compiler: GrammarCompiler, spec: GrammarSpec, message: str
) -> None:
    with pytest.raises(InvalidParamError, match=message) as raised:
        compiler.compile(spec)
    assert raised.value.param == spec.param


def test_compiled_grammars_are_cached_and_evicted_least_recently_used(renderer: PromptRenderer) -> None:
    compiler = GrammarCompiler(
        renderer.tokenizer.to_str(), renderer.vocab_size, renderer.eos_token_ids, cache_size=2
    )
    first = compiler.compile(GrammarSpec("regex", "a+"))
    assert compiler.compile(GrammarSpec("regex", "a+")) is first
    compiler.compile(GrammarSpec("regex", "b+"))
    compiler.compile(GrammarSpec("regex", "a+"))  # a+ is now the most recent
    compiler.compile(GrammarSpec("regex", "c+"))  # evicts b+
    assert compiler.num_compiled == 3
    compiler.compile(GrammarSpec("regex", "b+"))
    assert compiler.num_compiled == 4
    assert (
        compiler.compile(
            GrammarSpec("regex", "a+"),
        )
        is not first
    )  # evicted by b+ just now


def test_a_schema_is_keyed_by_its_content_and_its_order(compiler: GrammarCompiler) -> None:
    assert compiler.compile(GrammarSpec.json_schema(json.loads(json.dumps(PERSON)), "x")) is _person(compiler)
    swapped = {**PERSON, "properties": dict(reversed(list(PERSON["properties"].items())))}  # type: ignore[call-overload]
    assert compiler.compile(GrammarSpec.json_schema(swapped, "x")) is not _person(compiler)


def test_matchers_walk_their_grammar_and_refuse_a_token_outside_it(
    compiler: GrammarCompiler, renderer: PromptRenderer
) -> None:
    matcher = _person(compiler).matcher()
    ids = renderer.encode('{"name": "Bo", "age": 7}', add_special_tokens=False)
    bad = renderer.encode("x", add_special_tokens=False)[0]
    assert not matcher.accepts(bad)
    for token_id in ids:
        assert not matcher.is_finished
        matcher.advance(token_id)
    assert matcher.is_finished
    other = _person(compiler).matcher()  # a fresh copy starts at the beginning
    with pytest.raises(GrammarError):
        other.advance(bad)


def test_bitmasks_allow_exactly_the_grammar_tokens(
    compiler: GrammarCompiler, renderer: PromptRenderer
) -> None:
    grammar = compiler.compile(GrammarSpec("choice", json.dumps(["Paris", "Rome"])))
    bitmask = MaskFiller.fill_now([grammar.matcher(), _person(compiler).matcher()])
    allowed = allowed_token_ids(bitmask[0], renderer.vocab_size)
    texts = {renderer.decode([token_id]) for token_id in allowed}
    assert texts and all("Paris".startswith(text) or "Rome".startswith(text) for text in texts)
    assert {renderer.decode([t]) for t in allowed_token_ids(bitmask[1], renderer.vocab_size)} <= {"{", '{"'}


def test_apply_bitmask_touches_only_the_constrained_rows() -> None:
    logits = torch.zeros(3, 40)
    bitmask = torch.tensor([[0b101, 0]], dtype=torch.int32)  # tokens 0 and 2 of row 1
    apply_bitmask(logits, [1], bitmask)
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [0, 2]
    assert torch.isfinite(logits[[0, 2]]).all()


def test_the_grammar_wins_when_edits_left_it_nothing() -> None:
    logits = torch.zeros(1, 8)
    logits[0, 3] = float("-inf")  # min_tokens hid the one token the grammar allows
    apply_bitmask(logits, [0], torch.tensor([[0b1000]], dtype=torch.int32))
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [3]


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_a_mixed_batch_keeps_free_requests_free_and_constrained_ones_valid(
    engine: LLMEngine, compiler: GrammarCompiler, temperature: float
) -> None:
    prompt = engine.renderer.encode("What is the capital of France?")
    free = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    alone = engine.generate([prompt], free)[0]
    constrained = SamplingParams(max_tokens=64, temperature=temperature, seed=3, grammar=_person(compiler))
    regex = SamplingParams(
        max_tokens=16,
        temperature=temperature,
        seed=4,
        grammar=compiler.compile(GrammarSpec("regex", "[0-9]{3}-[a-z]{2}")),
    )
    outputs = engine.generate([prompt] * 3, [constrained, free, regex])
    jsonschema.validate(json.loads(outputs[0].new_text), PERSON)
    assert outputs[0].finish_reason == "stop"
    assert outputs[1].new_token_ids == alone.new_token_ids  # same tokens as without the others
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", outputs[2].new_text)


def test_a_handed_first_token_advances_the_matcher_or_is_sampled_again(
    engine: LLMEngine, compiler: GrammarCompiler
) -> None:
    prompt = engine.renderer.encode("Rome is the capital of Italy.")
    params = SamplingParams(max_tokens=64, temperature=0.0, grammar=_person(compiler))
    whole = engine.generate([prompt], params)[0]
    for first, expect_handed in ((whole.new_token_ids[0], True), (engine.renderer.encode("x")[0], False)):
        output = engine.add_request("handed", prompt, params, first_token_id=first)
        assert (output is not None) == expect_handed
        tokens = [] if output is None else list(output.new_token_ids)
        while engine.has_unfinished_requests():
            for step in engine.step():
                tokens.extend(step.new_token_ids)
        assert tokens == whole.new_token_ids


def test_a_preempted_constrained_request_resumes_where_its_grammar_was(
    tiny_llama: Path, compiler: GrammarCompiler
) -> None:
    small = make_engine(tiny_llama, num_blocks=5)  # 80 tokens: three requests need up to 114
    prompt = small.renderer.encode("What is the capital of France?")
    params = SamplingParams(max_tokens=30, temperature=0.0, grammar=_person(compiler))
    alone = small.generate([prompt], params)[0]
    together = small.generate([prompt, prompt[:-1], prompt[1:]], params)
    assert small.stats.num_preemptions > 0
    assert together[0].new_token_ids == alone.new_token_ids
    for output in together:
        if output.finish_reason == "stop":
            jsonschema.validate(json.loads(output.new_text), PERSON)


def test_the_simulated_runner_draws_inside_the_grammar(tiny_llama: Path, compiler: GrammarCompiler) -> None:
    engine = simulated_engine(make_config(tiny_llama), num_blocks=32)
    prompt = engine.renderer.encode("hello")
    choice = compiler.compile(GrammarSpec("choice", json.dumps(["Paris", "Berlin", "Rome"])))
    regex = compiler.compile(GrammarSpec("regex", "[0-9]{4}"))
    outputs = engine.generate(
        [prompt] * 3,
        [
            SamplingParams(max_tokens=16, grammar=choice),
            SamplingParams(max_tokens=16, grammar=regex),
            SamplingParams(max_tokens=16, ignore_eos=True),
        ],
    )
    assert outputs[0].new_text in {"Paris", "Berlin", "Rome"} and outputs[0].finish_reason == "stop"
    assert re.fullmatch("[0-9]{4}", outputs[1].new_text) and outputs[1].finish_reason == "stop"
    assert outputs[2].num_output_tokens == 16
