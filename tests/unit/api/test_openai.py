from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from herd.api.openai import ChatCompletionRequest, CompletionRequest, ErrorResponse


def chat(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    )


def test_unknown_fields_and_extensions_are_accepted() -> None:
    request = chat(
        ignore_eos=True,
        max_completion_tokens=8,
        max_tokens=99,
        stop_token_ids=[3],
        min_tokens=2,
        stream_options={"include_usage": True},
        cache_salt="t1",
        some_future_field={"x": 1},
    )
    assert request.output_limit == 8
    assert request.stream_options is not None and request.stream_options.include_usage
    assert request.cache_salt == "t1"


def test_list_of_text_parts_content_is_joined() -> None:
    request = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
            ],
        }
    )
    assert request.messages[0].text == "ab"


@pytest.mark.parametrize(
    ("fields", "loc"),
    [
        ({"max_tokens": -1}, ("max_tokens",)),
        ({"temperature": 3.0}, ("temperature",)),
        ({"messages": []}, ("messages",)),
        ({"top_p": 0}, ("top_p",)),
        ({"logit_bias": {"abc": 1.0}}, ("logit_bias",)),
        ({"top_logprobs": 3}, ()),
        ({"n": "two"}, ("n",)),
    ],
    ids=[
        "negative-max-tokens",
        "temperature-range",
        "empty-messages",
        "top-p",
        "logit-bias-key",
        "top-logprobs-needs-logprobs",
        "wrong-type",
    ],
)
def test_bad_values_fail_naming_the_field(fields: dict[str, Any], loc: tuple[str, ...]) -> None:
    with pytest.raises(ValidationError) as error:
        chat(**fields)
    assert tuple(error.value.errors()[0]["loc"]) == loc


def test_completion_prompt_forms() -> None:
    for prompt in ("text", ["a", "b"], [1, 2, 3], [[1, 2], [3]]):
        assert CompletionRequest.model_validate({"model": "m", "prompt": prompt}).prompt == prompt
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({"model": "m", "prompt": []})


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (400, "invalid_request_error"),
        (401, "authentication_error"),
        (404, "not_found_error"),
        (405, "invalid_request_error"),
        (408, "invalid_request_error"),
        (415, "invalid_request_error"),
        (429, "rate_limit_error"),
        (431, "invalid_request_error"),
        (409, "invalid_request_error"),
        (503, "service_unavailable"),
        (500, "server_error"),
    ],
    ids=str,
)
def test_error_envelope(status: int, kind: str) -> None:
    body = ErrorResponse.of(status, "what went wrong", param="x").model_dump()
    assert body == {"error": {"message": "what went wrong", "type": kind, "param": "x", "code": status}}
