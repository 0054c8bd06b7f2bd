"""From OpenAI request fields to engine SamplingParams and choices: pure logic, table-driven."""

from __future__ import annotations

from typing import Any

import pytest

from herd.api.errors import HttpError
from herd.api.openai import ChatCompletionRequest, CompletionRequest
from herd.worker.server._params import handoff_params, plan_choices

HELLO = [{"role": "user", "content": "hi"}]
VOCAB = 100


def _plan(
    fields: dict[str, Any], prompts: list[list[int]] | None = None, max_model_len: int = 64
) -> list[Any]:
    request = ChatCompletionRequest.model_validate({"model": "m", "messages": HELLO, **fields})
    return plan_choices(
        request,
        prompts or [[1, 2, 3, 4]],
        max_model_len=max_model_len,
        vocab_size=VOCAB,
        num_logprobs=request.num_logprobs,
        prompt_param="messages",
        handoff=handoff_params(request),
    )


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        (
            {},
            {"max_tokens": 60, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "seed": None, "logprobs": None},
        ),
        ({"max_tokens": 5}, {"max_tokens": 5}),
        ({"max_tokens": 5, "max_completion_tokens": 7}, {"max_tokens": 7}),
        (
            {"temperature": 0, "top_k": 4, "top_p": 0.5, "min_p": 0.1},
            {"temperature": 0.0, "top_k": 4, "top_p": 0.5, "min_p": 0.1},
        ),
        ({"stop": "x", "stop_token_ids": [7]}, {"stop": ("x",), "stop_token_ids": (7,)}),
        ({"logit_bias": {"12": 3.5}}, {"logit_bias": {12: 3.5}}),
        ({"logprobs": True, "top_logprobs": 3}, {"logprobs": 3}),
        ({"logprobs": True}, {"logprobs": 0}),
        ({"ignore_eos": True, "min_tokens": 2, "seed": 9}, {"ignore_eos": True, "min_tokens": 2, "seed": 9}),
        (
            {"presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.2},
            {"presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.2},
        ),
    ],
    ids=[
        "defaults",
        "max-tokens",
        "max-completion-tokens-wins",
        "filters",
        "stops",
        "logit-bias",
        "top-logprobs",
        "logprobs-only",
        "eos-min-seed",
        "penalties",
    ],
)
def test_request_fields_become_sampling_params(fields: dict[str, Any], expected: dict[str, Any]) -> None:
    (choice,) = _plan(fields)
    assert {name: getattr(choice.params, name) for name in expected} == expected


def test_n_seeded_choices_get_consecutive_seeds_per_prompt() -> None:
    choices = _plan({"n": 2, "seed": 10, "max_tokens": 4}, prompts=[[1], [2, 3]])
    assert [(c.index, c.prompt_index, c.params.seed) for c in choices] == [
        (0, 0, 10),
        (1, 0, 11),
        (2, 1, 10),
        (3, 1, 11),
    ]
    assert choices[2].prompt_token_ids == [2, 3]


@pytest.mark.parametrize(
    ("fields", "max_model_len", "param", "words"),
    [
        ({}, 4, "messages", "maxModelLen is 4"),
        ({"max_tokens": 61}, 64, "max_tokens", "at most 60"),
        ({"max_completion_tokens": 61}, 64, "max_completion_tokens", "at most 60"),
        ({"max_tokens": 2, "min_tokens": 3}, 64, "min_tokens", "min_tokens"),
    ],
    ids=["prompt-fills-context", "max-tokens-over", "max-completion-tokens-over", "min-over-max"],
)
def test_impossible_limits_are_400(
    fields: dict[str, Any], max_model_len: int, param: str, words: str
) -> None:
    with pytest.raises(HttpError) as caught:
        _plan(fields, max_model_len=max_model_len)
    assert (caught.value.status, caught.value.param) == (400, param)
    assert words in caught.value.message


def test_completion_logprobs_are_an_integer() -> None:
    request = CompletionRequest.model_validate({"model": "m", "prompt": "x", "logprobs": 2})
    (choice,) = plan_choices(
        request,
        [[1]],
        max_model_len=8,
        vocab_size=VOCAB,
        num_logprobs=request.num_logprobs,
        prompt_param="prompt",
        handoff=None,
    )
    assert choice.params.logprobs == 2


@pytest.mark.parametrize(
    ("fields", "prompts", "param", "words"),
    [
        (
            {"logit_bias": {"-1": 1}},
            None,
            "logit_bias",
            "token id -1 in logit_bias is outside this model's vocabulary (0..99)",
        ),
        ({"logit_bias": {"100": 1}}, None, "logit_bias", "token id 100 in logit_bias"),
        ({"logit_bias": {str(i): 1 for i in range(1025)}}, None, "logit_bias", "at most 1024"),
        (
            {"stop_token_ids": [100], "min_tokens": 1},
            None,
            "stop_token_ids",
            "token id 100 in stop_token_ids",
        ),
        ({"stop_token_ids": list(range(1025))}, None, "stop_token_ids", "at most 1024"),
        ({"stop": "x" * 1025}, None, "stop", "at most 1024 characters"),
        ({}, [[1, 2, 100]], "messages", "token id 100 in messages"),
        ({}, [[1, -5]], "messages", "token id -5 in messages"),
        ({"top_k": 101}, None, "top_k", "exceeds this model's vocabulary of 100"),
        ({"seed": 2**63}, None, "seed", "seed must lie in"),
        ({"seed": 2**63 - 1, "n": 2}, None, "seed", "seed must lie in"),
        ({"seed": -(2**63) - 1}, None, "seed", "seed must lie in"),
        ({"n": 16}, [[1]] * 9, "n", "144 sequences"),
        ({}, [[1]] * 129, "messages", "at most 128"),
        ({"max_tokens": 4, "min_tokens": 5}, None, "min_tokens", "min_tokens (5)"),
        ({"min_tokens": 61}, None, "min_tokens", "max_tokens (60)"),
        (
            {"kv_transfer_params": {"do_remote_prefill": True, "first_token_ids": [100]}},
            None,
            "kv_transfer_params",
            "token id 100 in kv_transfer_params",
        ),
        (
            {"kv_transfer_params": {"do_remote_prefill": "maybe"}},
            None,
            "kv_transfer_params.do_remote_prefill",
            "`kv_transfer_params.do_remote_prefill`: input should be a valid boolean",
        ),
    ],
    ids=[
        "negative-bias-id",
        "bias-id-past-vocab",
        "too-many-biases",
        "stop-id-past-vocab",
        "too-many-stop-ids",
        "long-stop-string",
        "prompt-id-past-vocab",
        "negative-prompt-id",
        "top-k-past-vocab",
        "seed-past-int64",
        "seed-plus-choice-past-int64",
        "seed-below-int64",
        "n-times-prompts",
        "too-many-prompts",
        "min-over-max",
        "min-over-room",
        "handed-token-past-vocab",
        "bad-handoff",
    ],
)
def test_values_the_model_cannot_take_are_400_naming_the_field(
    fields: dict[str, Any], prompts: list[list[int]] | None, param: str, words: str
) -> None:
    with pytest.raises(HttpError) as caught:
        _plan(fields, prompts=prompts)
    assert (caught.value.status, caught.value.param) == (400, param)
    assert words in caught.value.message
