"""The public port: vLLM's OpenAI API passed through, with herd's ``/ready`` and ``/health``.

Bodies and answers stream through as they come (an SSE stream is never buffered); a client that
hangs up closes the connection to vLLM, which aborts the request. What herd's gateway sends a herd
worker that vLLM must not see is taken out: the internal token header, the resumable-stream
request header, and ``kv_transfer_params`` (herd's disaggregation handoff, which a vLLM worker does
not take part in). A vLLM worker streams no resume marks, so the gateway never resumes its streams
on another worker; a continuation (``herd_resume``) is refused with a 400: vLLM cannot append tokens
as its own output (its seeded generator, penalties over the output, grammar state and stop-string
window would all start again), so it could not go on exactly. An error vLLM answers
outside the OpenAI envelope (FastAPI's ``{"detail": ...}``) is put in one; vLLM unreachable is a 503
with ``Retry-After``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from herd.api.body import BodyError, json_value
from herd.api.errors import HttpError, enveloped, route_message
from herd.api.openai import ErrorResponse
from herd.api.protocol import TOKEN_HEADER
from herd.api.resume import RESUMABLE_HEADER, RESUME_FIELD

__all__ = ["RETRY_AFTER_S", "build_public_app", "error_response"]

RETRY_AFTER_S = "1"
_NOT_FORWARDED = frozenset(
    {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "te", "upgrade",
     "accept-encoding", "date", "server", TOKEN_HEADER.lower(), RESUMABLE_HEADER.lower()}
)  # fmt: skip
_HERD_ONLY_FIELDS = ("kv_transfer_params",)
_METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH"]
_NO_RESUME = (
    f"the vLLM backend cannot resume a stream ({RESUME_FIELD}): vLLM cannot continue a seeded sampler, "
    "its penalties, a grammar or a stop string over tokens it did not sample; send the request again"
)


def error_response(error: HttpError) -> JSONResponse:
    body = ErrorResponse.of(error.status, error.message, param=error.param).model_dump()
    return JSONResponse(body, status_code=error.status, headers=error.headers)


def build_public_app(vllm: httpx.AsyncClient, is_ready: Callable[[], bool]) -> Starlette:
    """``vllm`` has vLLM's URL as its base URL; ``is_ready`` says whether the sidecar may take traffic."""

    async def health(_: Request) -> Response:
        if await _vllm_is_healthy(vllm):
            return JSONResponse({"status": "ok"})
        return error_response(_unavailable(vllm, "is not healthy"))

    async def ready(_: Request) -> Response:
        if is_ready() and await _vllm_is_healthy(vllm):
            return JSONResponse({"status": "ready"})
        return error_response(_unavailable(vllm, "is loading, or this worker is draining"))

    async def proxy(request: Request) -> Response:
        return await _forward(vllm, request)

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/ready", ready, methods=["GET"]),
        Route("/{path:path}", proxy, methods=_METHODS),
    ]
    return Starlette(routes=routes)


async def _vllm_is_healthy(vllm: httpx.AsyncClient) -> bool:
    try:
        return (await vllm.get("/health")).status_code == httpx.codes.OK
    except httpx.HTTPError:
        return False


def _unavailable(vllm: httpx.AsyncClient, state: str) -> HttpError:
    message = f"the vLLM server at {vllm.base_url} {state}; retry after {RETRY_AFTER_S}s"
    return HttpError(503, message, headers={"Retry-After": RETRY_AFTER_S})


async def _forward(vllm: httpx.AsyncClient, request: Request) -> Response:
    try:
        content = _without_herd_fields(await request.body())
    except HttpError as error:
        return error_response(error)
    upstream_request = vllm.build_request(
        request.method,
        request.url.path,
        params=request.url.query,
        headers=_forwarded(request.headers.items()),
        content=content,
    )
    try:
        upstream = await vllm.send(upstream_request, stream=True)
    except httpx.HTTPError as error:
        return error_response(_unavailable(vllm, f"did not answer ({type(error).__name__})"))
    headers = _forwarded(upstream.headers.items())
    if upstream.is_error:
        content = await upstream.aread()
        await upstream.aclose()
        headers.pop("content-type", None)
        return Response(
            enveloped(content, upstream.status_code, _describe(upstream.status_code, request)),
            upstream.status_code,
            headers,
            "application/json",
        )
    return StreamingResponse(
        upstream.aiter_raw(), upstream.status_code, headers, background=BackgroundTask(upstream.aclose)
    )


def _forwarded(headers: Iterable[tuple[str, str]]) -> dict[str, str]:
    return {name: value for name, value in headers if name.lower() not in _NOT_FORWARDED}


def _without_herd_fields(body: bytes) -> bytes:
    """The body without herd's own fields (parsed only when one may be there); ``HttpError`` for a
    continuation of a stream, which vLLM cannot run exactly."""
    if not any(field.encode() in body for field in (*_HERD_ONLY_FIELDS, RESUME_FIELD)):
        return body
    try:
        payload = json_value(body, what="the request body")
    except BodyError as error:  # not JSON, or too deep to pass on safely
        raise HttpError(error.status, str(error)) from None
    if not isinstance(payload, dict):
        return body
    if RESUME_FIELD in payload:
        raise HttpError(400, _NO_RESUME, param=RESUME_FIELD)
    for field in _HERD_ONLY_FIELDS:
        payload.pop(field, None)
    return json.dumps(payload).encode()


def _describe(status: int, request: Request) -> Callable[[Any], str]:
    """The message for a vLLM error answer outside the OpenAI envelope: FastAPI's detail, or its text."""

    def describe(body: Any) -> str:
        detail = str(body.get("detail")) if isinstance(body, dict) else str(body)[:500]
        message = route_message(request.method, request.url.path, status, allow=None, detail=detail)
        return f"vLLM answered {status}: {message}"

    return describe
