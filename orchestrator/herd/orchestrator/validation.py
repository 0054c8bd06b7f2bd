"""Validating a request where it enters: its route's OpenAI wire model, then its length.

A request is parsed with the model of its route (``ChatCompletionRequest`` for
``/v1/chat/completions``, ``CompletionRequest`` for ``/v1/completions``) and refused with a 400 whose
``param`` is the first error's location and whose message is one sentence, never a pydantic dump.
Once its prompt's tokens are known, prompt plus requested output must fit the model's
``maxModelLen``, by the rule the worker applies too (``SamplingFields.output_budget``), so a too-long request never
occupies a worker. The raw body still goes to the worker as it came.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError
from pydantic_core import ErrorDetails

from herd.api.body import BodyError, json_object
from herd.api.openai import ChatCompletionRequest, CompletionRequest, LengthError, SamplingFields
from herd.orchestrator.errors import GatewayError

__all__ = ["WIRE_MODELS", "ParsedRequest", "check_length", "parse_request"]

WIRE_MODELS: dict[str, type[ChatCompletionRequest] | type[CompletionRequest]] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
}

_UNION_TAGS = frozenset({"str", "int", "float", "bool", "none", "dict", "list"})
"""Locations pydantic adds for the member of a union that failed; a client's field is never one."""


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    payload: dict[str, Any]
    """The body's JSON object, every field the client sent included."""
    request: ChatCompletionRequest | CompletionRequest

    @property
    def prompt_param(self) -> str:
        """The field that holds the prompt, for errors about it."""
        return "messages" if isinstance(self.request, ChatCompletionRequest) else "prompt"


def parse_request(path: str, body: bytes) -> ParsedRequest:
    """``body`` as the wire model of ``path``'s route; ``GatewayError`` (400 / 413) names what is wrong."""
    try:
        payload = json_object(body)
    except BodyError as error:
        raise GatewayError(error.status, str(error)) from None
    try:
        return ParsedRequest(payload, WIRE_MODELS[path].model_validate(payload))
    except ValidationError as error:
        raise _invalid(error.errors(include_url=False)[0]) from None


def _invalid(first: ErrorDetails) -> GatewayError:
    location = [str(part) for part in first["loc"] if not _is_union_tag(part)]
    param = ".".join(location) or None
    if first["type"] == "missing":
        return GatewayError(400, f"invalid request: `{param}` is required", param=param)
    reason = first["msg"].removeprefix("Value error, ")
    where = f"`{param}`: " if param else ""
    return GatewayError(400, f"invalid request: {where}{reason[:1].lower()}{reason[1:]}", param=param)


def _is_union_tag(part: int | str) -> bool:
    return isinstance(part, str) and (part in _UNION_TAGS or "[" in part)


def check_length(parsed: ParsedRequest, num_prompt_tokens: int, max_model_len: int) -> None:
    """400 when the prompt, or the prompt plus the output the request asks for, passes ``max_model_len``
    (``SamplingFields.output_budget``, the worker's rule)."""
    request: SamplingFields = parsed.request
    try:
        request.output_budget(num_prompt_tokens, max_model_len, prompt_param=parsed.prompt_param)
    except LengthError as error:
        raise GatewayError(400, str(error), param=error.param) from None
