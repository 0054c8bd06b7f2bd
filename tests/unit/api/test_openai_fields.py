"""Nothing the OpenAI API defines is dropped silently (issue 15): every request field of
``/v1/chat/completions`` and ``/v1/completions``, read from the openai SDK's own parameter types, is
honoured by herd, refused with a 400 naming it, or accepted as a hint with its type checked."""

from __future__ import annotations

import typing
from typing import Any

import pytest
from openai.types import completion_create_params as text_params
from openai.types.chat import completion_create_params as chat_params
from pydantic import BaseModel, ValidationError

from herd.api.errors import invalid_request
from herd.api.openai import HINT_FIELDS, REFUSED_FIELDS, ChatCompletionRequest, CompletionRequest

BASE: dict[type[BaseModel], dict[str, Any]] = {
    ChatCompletionRequest: {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
    CompletionRequest: {"model": "m", "prompt": "hi"},
}
SDK_FIELDS = {
    ChatCompletionRequest: {*typing.get_type_hints(chat_params.CompletionCreateParamsBase), "stream"},
    CompletionRequest: {*typing.get_type_hints(text_params.CompletionCreateParamsBase), "stream"},
}
HONOURED = {
    "messages", "prompt", "model", "frequency_penalty", "presence_penalty", "logit_bias", "logprobs",
    "top_logprobs", "max_tokens", "max_completion_tokens", "n", "seed", "stop", "stream", "stream_options",
    "temperature", "top_p", "response_format", "tools", "tool_choice", "parallel_tool_calls",
}  # fmt: skip
"""What each of these does is tested where it is implemented (sampling, stopping, streaming, tools)."""
REFUSED_SAMPLES: dict[str, Any] = {
    "audio": {"voice": "alloy", "format": "mp3"},
    "functions": [{"name": "f", "parameters": {}}],
    "function_call": "auto",
    "modalities": ["text", "audio"],
    "moderation": {"model": "omni-moderation-latest"},
    "reasoning_effort": "low",
    "verbosity": "low",
    "web_search_options": {},
    "store": True,
    "best_of": 3,
    "echo": True,
    "suffix": "and so on",
}
HINT_SAMPLES: dict[str, tuple[Any, Any]] = {
    "metadata": ({"team": "search"}, {"team": 7}),
    "prediction": ({"type": "content", "content": "x"}, "x"),
    "prompt_cache_key": ("tenant-7", 7),
    "prompt_cache_options": ({"mode": "auto"}, "auto"),
    "prompt_cache_retention": ("24h", 24),
    "safety_identifier": ("user-1", {"id": 1}),
    "service_tier": ("flex", 3),
    "user": ("user-1", 1),
}
"""A valid and an invalid value of each hint field."""


def _cases(kind: str) -> list[Any]:
    return [
        pytest.param(model, field, id=f"{model.__name__}.{field}")
        for model, fields in SDK_FIELDS.items()
        for field in sorted(fields)
        if (field in REFUSED_FIELDS) == (kind == "refused") and (field in HINT_FIELDS) == (kind == "hint")
    ]


def _param_of(model: type[BaseModel], body: dict[str, Any]) -> str | None:
    try:
        model.model_validate(body)
    except ValidationError as error:
        return invalid_request(error.errors(include_url=False)).param
    return None


def test_every_sdk_field_is_classified_once() -> None:
    for model, fields in SDK_FIELDS.items():
        for field in fields:
            kinds = [field in HONOURED, field in REFUSED_FIELDS, field in HINT_FIELDS]
            assert sum(kinds) == 1, f"{model.__name__}.{field}: classify it as honoured, refused or hint"
            assert field in model.model_fields, f"{model.__name__} does not declare {field}"


@pytest.mark.parametrize(("model", "field"), _cases("refused"))
def test_a_refused_field_is_a_400_naming_it_unless_neutral(model: type[BaseModel], field: str) -> None:
    assert _param_of(model, {**BASE[model], field: REFUSED_SAMPLES[field]}) == field
    neutral, _ = REFUSED_FIELDS[field]
    for value in neutral:
        assert _param_of(model, {**BASE[model], field: value}) is None


@pytest.mark.parametrize(("model", "field"), _cases("hint"))
def test_a_hint_is_accepted_with_its_type_checked(model: type[BaseModel], field: str) -> None:
    valid, invalid = HINT_SAMPLES[field]
    assert _param_of(model, {**BASE[model], field: valid}) is None
    assert (_param_of(model, {**BASE[model], field: invalid}) or "").startswith(field)


@pytest.mark.parametrize(("model", "field"), _cases("honoured"))
def test_an_honoured_field_is_declared_with_a_type(model: type[BaseModel], field: str) -> None:
    assert model.model_fields[field].annotation is not Any


def test_fields_the_api_does_not_define_are_still_ignored() -> None:
    for model, base in BASE.items():
        assert _param_of(model, {**base, "frobnicate": [1, 2]}) is None
