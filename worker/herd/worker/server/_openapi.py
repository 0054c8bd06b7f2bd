"""The public port's OpenAPI document: every route with its request body and its answers.

The handlers read their bodies themselves (size limit, tolerant parsing, errors in the OpenAI
envelope), so FastAPI sees no body models: each route names its body and answers here
(``route_docs``, FastAPI's ``openapi_extra``), and ``build_openapi`` adds the models' JSON schemas
as components. ``model`` is pinned to the served name, so that generated requests (schemathesis)
reach the engine instead of stopping at a 404.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import JsonSchemaMode, models_json_schema

from herd.api.openai import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    EmbeddingRequest,
    EmbeddingResponse,
    ErrorResponse,
    LoadLoraAdapterRequest,
    ModelList,
    UnloadLoraAdapterRequest,
)
from herd.worker.server._peer_routes import (
    FlushCacheRequest,
    FlushCacheResponse,
    RenderedPrompt,
    RenderedPrompts,
)
from herd.worker.server._tokenize import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)

__all__ = ["build_openapi", "route_docs"]

_REF = "#/components/schemas/{model}"
_BODIES: dict[str, tuple[type[BaseModel], type[BaseModel]]] = {
    "/v1/chat/completions": (ChatCompletionRequest, ChatCompletionResponse),
    "/v1/completions": (CompletionRequest, CompletionResponse),
    "/v1/embeddings": (EmbeddingRequest, EmbeddingResponse),
    "/tokenize": (TokenizeRequest, TokenizeResponse),
    "/detokenize": (DetokenizeRequest, DetokenizeResponse),
    "/v1/chat/completions/render": (ChatCompletionRequest, RenderedPrompt),
    "/v1/completions/render": (CompletionRequest, RenderedPrompts),
    "/flush_cache": (FlushCacheRequest, FlushCacheResponse),
}
_OPTIONAL_BODIES = frozenset({"/flush_cache"})
_TEXT_ANSWERS: dict[str, type[BaseModel]] = {
    "/v1/load_lora_adapter": LoadLoraAdapterRequest,
    "/v1/unload_lora_adapter": UnloadLoraAdapterRequest,
}
"""Routes that answer 200 with a line of text, as vLLM's do; they need the internal token (401)."""
_ERRORS = {
    400: "A field is invalid for this model (``param`` names it)",
    404: "The model is not served here",
    413: "The body is larger than the worker's limit",
    415: "The Content-Type is not JSON",
    429: "The queue is full; retry after Retry-After seconds",
    500: "The engine failed this request",
    503: "The worker is loading or draining; retry elsewhere",
}
_STREAMED = frozenset({"/v1/chat/completions", "/v1/completions"})


def route_docs(path: str) -> dict[str, Any]:
    """``openapi_extra`` for the route at ``path``: its request body (if any) and its answers."""
    if path in _TEXT_ANSWERS:
        return _text_route_docs(_TEXT_ANSWERS[path])
    if path not in _BODIES:
        return {"responses": {"503": _error("The model is loading or the engine failed")}}
    request, response = _BODIES[path]
    ok: dict[str, Any] = {"application/json": {"schema": _ref(response)}}
    if path in _STREAMED:
        ok["text/event-stream"] = {"schema": {"type": "string", "description": "stream=true: SSE chunks"}}
    return {
        "requestBody": {
            "required": path not in _OPTIONAL_BODIES,
            "content": {"application/json": {"schema": _ref(request)}},
        },
        "responses": {
            "200": {"description": "OK", "content": ok},
            **{str(status): _error(text) for status, text in _ERRORS.items()},
        },
    }


def _text_route_docs(request: type[BaseModel]) -> dict[str, Any]:
    ok = {"text/plain": {"schema": {"type": "string"}}}
    errors = {
        **_ERRORS,
        401: "The internal token is missing or wrong",
        403: "The worker has no internal token",
    }
    return {
        "requestBody": {"required": True, "content": {"application/json": {"schema": _ref(request)}}},
        "responses": {
            "200": {"description": "OK", "content": ok},
            **{str(status): _error(text) for status, text in errors.items()},
        },
    }


def build_openapi(app: FastAPI, served_name: str) -> dict[str, Any]:
    """The whole document: FastAPI's paths plus the bodies' schemas, ``model`` pinned to ``served_name``."""
    if app.openapi_schema is None:
        document = get_openapi(title=app.title, version=app.version, routes=app.routes)
        # Beside FastAPI's own schemas: the routes with response models (peer routes) refer to them.
        document.setdefault("components", {}).setdefault("schemas", {}).update(_schemas(served_name))
        app.openapi_schema = document
    return app.openapi_schema


def _schemas(served_name: str) -> dict[str, Any]:
    models: list[tuple[type[BaseModel], JsonSchemaMode]] = [
        *((request, "validation") for request, _ in _BODIES.values()),
        *((response, "serialization") for _, response in _BODIES.values()),
        *((request, "validation") for request in _TEXT_ANSWERS.values()),
        (ModelList, "serialization"),
        (ErrorResponse, "serialization"),
    ]
    _, top = models_json_schema(models, ref_template=_REF)
    schemas: dict[str, Any] = top["$defs"]
    for request in (ChatCompletionRequest, CompletionRequest, EmbeddingRequest):
        schemas[request.__name__]["properties"]["model"] = {"type": "string", "enum": [served_name]}
    return schemas


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": _REF.format(model=model.__name__)}


def _error(description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": _ref(ErrorResponse)}}}
