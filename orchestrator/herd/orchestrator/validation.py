"""Validating a request where it enters: its route's OpenAI wire model, then its length.

A request is parsed with the model of its route (``ChatCompletionRequest`` for
``/v1/chat/completions``, ``CompletionRequest`` for ``/v1/completions``, ``EmbeddingRequest`` for
``/v1/embeddings``) and refused with a 400 whose
``param`` is the first error's location and whose message is one sentence, never a pydantic dump.
Once its prompt's tokens are known, prompt plus requested output must fit the model's
``maxModelLen``, by the rule the worker applies too (``SamplingFields.output_budget``), so a too-long request never
occupies a worker. The raw body still goes to the worker as it came.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from herd.api.body import BodyError, json_object
from herd.api.errors import HttpError, invalid_request
from herd.api.openai import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    LengthError,
    SamplingFields,
)
from herd.api.resume import RESUME_FIELD

__all__ = ["INTERNAL_FIELDS", "WIRE_MODELS", "ParsedRequest", "check_length", "parse_request"]

INTERNAL_FIELDS = ("kv_transfer_params", RESUME_FIELD)
"""Fields a worker takes only from herd's gateway (which sends its internal token with every request):
a disaggregated or peer handoff and a resumed stream's output so far. The gateway sets them itself,
so a client's would reach a worker as the gateway's: refused where the request enters."""

WireRequest = ChatCompletionRequest | CompletionRequest | EmbeddingRequest
WIRE_MODELS: dict[str, type[WireRequest]] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
    "/v1/embeddings": EmbeddingRequest,
}


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    payload: dict[str, Any]
    """The body's JSON object, every field the client sent included."""
    request: WireRequest

    @property
    def prompt_param(self) -> str:
        """The field that holds the prompt, for errors about it."""
        match self.request:
            case ChatCompletionRequest():
                return "messages"
            case EmbeddingRequest():
                return "input"
            case _:
                return "prompt"

    @property
    def generates(self) -> bool:
        """A completion (it has a prompt to cache and to prefill apart), not an embedding, which is
        routed by load alone: no prefix cache holds an encoder's work."""
        return not isinstance(self.request, EmbeddingRequest)


def parse_request(path: str, body: bytes) -> ParsedRequest:
    """``body`` as the wire model of ``path``'s route; ``HttpError`` (400 / 413) names what is wrong."""
    try:
        payload = json_object(body)
    except BodyError as error:
        raise HttpError(error.status, str(error)) from None
    if internal := next((name for name in INTERNAL_FIELDS if name in payload), None):
        raise HttpError(
            400,
            f"{internal} is herd's own field between its gateway and its workers; a client may not send it: "
            "remove it",
            param=internal,
        )
    try:
        return ParsedRequest(payload, WIRE_MODELS[path].model_validate(payload))
    except ValidationError as error:
        raise invalid_request(error.errors(include_url=False)) from None


def check_length(parsed: ParsedRequest, num_prompt_tokens: int, max_model_len: int) -> None:
    """400 when the prompt, or the prompt plus the output the request asks for, passes ``max_model_len``
    (``SamplingFields.output_budget``, the worker's rule)."""
    request = parsed.request
    if not isinstance(request, SamplingFields):
        return
    try:
        request.output_budget(num_prompt_tokens, max_model_len, prompt_param=parsed.prompt_param)
    except LengthError as error:
        raise HttpError(400, str(error), param=error.param) from None
