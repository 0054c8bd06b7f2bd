"""From OpenAI request fields to engine SamplingParams and choices: pure logic, table-driven."""

from __future__ import annotations

from typing import Any

import pytest

from herd.api.openai import ChatCompletionRequest, CompletionRequest
from herd.worker.server._errors import ApiError
from herd.worker.server._params import plan_choices

HELLO = [{"role": "user", "content": "hi"}]


def _plan(
    fields: dict[str, Any], prompts: list[list[int]] | None = None, max_model_len: int = 64
) -> list[Any]:
    request = ChatCompletionRequest.model_validate({"model": "m", "messages": HELLO, **fields})
    return plan_choices(
        request,
        prompts or [[1, 2, 3, 4]],
        max_model_len=max_model_len,
        num_logprobs=request.num_logprobs,
        prompt_param="messages",
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
    with pytest.raises(ApiError) as caught:
        _plan(fields, max_model_len=max_model_len)
    assert (caught.value.status, caught.value.param) == (400, param)
    assert words in caught.value.message


def test_completion_logprobs_are_an_integer() -> None:
    request = CompletionRequest.model_validate({"model": "m", "prompt": "x", "logprobs": 2})
    (choice,) = plan_choices(
        request, [[1]], max_model_len=8, num_logprobs=request.num_logprobs, prompt_param="prompt"
    )
    assert choice.params.logprobs == 2
