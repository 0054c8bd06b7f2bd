"""The gateway's OpenAPI document: the OpenAI routes with their request bodies and error answers.

The OpenAI routes read their bodies themselves (to forward them as they came), so FastAPI cannot see
their request models. This module describes them: each route's wire model (``WIRE_MODELS``) as its
``requestBody``, with the models it refers to in ``components.schemas``, and the OpenAI error envelope
for each error status the route answers. API fuzzers (schemathesis) generate requests from it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from herd.api.openai import (
    ChatCompletionResponse,
    CompletionResponse,
    EmbeddingResponse,
    ErrorResponse,
    ModelList,
)
from herd.orchestrator.validation import WIRE_MODELS

__all__ = ["build_openapi", "route_docs"]

_ERRORS = {
    400: "The request is invalid; `param` names the field.",
    401: "An API key is required (`Authorization: Bearer <key>`).",
    404: "The model is not served here.",
    408: "The body did not arrive in time.",
    413: "The body is too large.",
    415: "The body is not JSON.",
    429: "Every worker is at capacity; retry after `Retry-After` seconds.",
    500: "The gateway failed on the request.",
    502: "The worker failed on the request.",
    503: "No worker can take the request now; retry after `Retry-After` seconds.",
    504: "The worker did not answer in time.",
}
_MODELS_ERRORS = (401, 500)
_ANSWERS: dict[str, type[BaseModel]] = {
    "/v1/chat/completions": ChatCompletionResponse,
    "/v1/completions": CompletionResponse,
    "/v1/embeddings": EmbeddingResponse,
}
_STREAMED = frozenset({"/v1/chat/completions", "/v1/completions"})


def route_docs(path: str) -> dict[str, Any]:
    """``add_api_route`` arguments that document ``path``: its body, its answer and its errors."""
    if path == "/v1/models":
        responses = {200: {"model": ModelList}, **_errors(_MODELS_ERRORS)}
        return {"responses": responses}
    answer: dict[str, Any] = {"model": _ANSWERS[path]}
    if path in _STREAMED:
        answer["content"] = {"text/event-stream": {"schema": {"type": "string"}}}
    body_schema = {"$ref": f"#/components/schemas/{WIRE_MODELS[path].__name__}"}
    request_body = {"required": True, "content": {"application/json": {"schema": body_schema}}}
    return {"responses": {200: answer, **_errors(_ERRORS)}, "openapi_extra": {"requestBody": request_body}}


def _errors(statuses: Iterable[int]) -> dict[int | str, dict[str, Any]]:
    return {status: {"model": ErrorResponse, "description": _ERRORS[status]} for status in statuses}


def build_openapi(app: FastAPI, *, requires_key: bool) -> dict[str, Any]:
    """The document for ``app``'s routes, with the wire models added to its components."""
    document = get_openapi(title=app.title, version=app.version, routes=app.routes)
    schemas = document.setdefault("components", {}).setdefault("schemas", {})
    for model in WIRE_MODELS.values():
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
    if requires_key:
        document["components"]["securitySchemes"] = {"apiKey": {"type": "http", "scheme": "bearer"}}
        document["security"] = [{"apiKey": []}]
    return document
