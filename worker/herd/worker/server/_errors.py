"""Errors in the OpenAI envelope, and the mapping from engine failures to HTTP status codes."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from herd.api.openai import ErrorResponse
from herd.api.prompt import PromptError
from herd.worker.async_engine import EngineDeadError, EngineDrainingError, RequestFailedError
from herd.worker.engine import QueueFullError
from herd.worker.sampling_params import InvalidParamError

__all__ = ["ApiError", "as_api_error", "error_response", "install_error_handlers", "invalid_request"]

logger = logging.getLogger(__name__)

RETRY_AFTER_S = "1"


class ApiError(Exception):
    """A request failure with its HTTP status, the offending field and extra headers."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers or {}

    def envelope(self) -> ErrorResponse:
        return ErrorResponse.of(self.status, self.message, param=self.param)

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, param=self.param, headers=self.headers)


def error_response(
    status: int, message: str, *, param: str | None = None, headers: Mapping[str, str] | None = None
) -> JSONResponse:
    body = ErrorResponse.of(status, message, param=param).model_dump()
    return JSONResponse(body, status_code=status, headers=headers)


def as_api_error(error: Exception) -> ApiError:
    """The HTTP meaning of an exception raised while serving a request."""
    match error:
        case ApiError():
            return error
        case QueueFullError():
            return ApiError(429, str(error), headers={"Retry-After": RETRY_AFTER_S})
        case PromptError():
            return ApiError(400, str(error), param="messages")
        case InvalidParamError():
            return ApiError(400, str(error), param=error.param)
        case RequestFailedError() | EngineDeadError(reached_engine=True):  # logged by the engine
            return ApiError(500, str(error))
        case ValueError():  # the engine's PromptTooLongError and its other refusals (pool too small, ...)
            return ApiError(400, str(error))
        case EngineDrainingError() | EngineDeadError():
            return ApiError(503, str(error), headers={"Retry-After": RETRY_AFTER_S})
        case _:
            logger.error("request failed", exc_info=error)
            return ApiError(500, f"internal error: {type(error).__name__}: {error}")


_EXPECTED: tuple[type[Exception], ...] = (
    ApiError,
    QueueFullError,
    PromptError,
    EngineDrainingError,
    EngineDeadError,
    RequestFailedError,
    ValueError,
)

_UNION_TAGS = frozenset({"str", "int", "float", "bool", "none", "dict", "list"})
"""Pydantic names the member of a union in an error's location; a client's field path has no such part."""


def invalid_request(errors: Sequence[Mapping[str, Any]], *, within: str | None = None) -> ApiError:
    """The first of pydantic's ``errors`` as one sentence (a 400); its field path is ``param``.

    ``within`` names the request field whose value was validated (``kv_transfer_params``). A value
    that fits none of a union's forms is described by the forms, not by the first form's complaint.
    """
    first = errors[0]
    location = list(first["loc"])
    num_parts = next((i for i, part in enumerate(location) if not _is_field(part)), len(location))
    names = [str(part) for part in location[:num_parts]]
    param = ".".join([within, *names] if within else names) or None
    if param is None:
        return ApiError(400, f"invalid request: {_detail(first)}")
    if first["type"] == "missing":
        return ApiError(400, f"the request lacks {param}, which is required", param=param)
    is_union = num_parts < len(location)
    expected = _union_forms(errors, location[:num_parts]) if is_union else _detail(first)
    return ApiError(400, f"invalid {param}: {expected}{_given(first)}", param=param)


def _union_forms(errors: Sequence[Mapping[str, Any]], field: list[Any]) -> str:
    """The forms a union field takes, from the tags pydantic put after ``field`` in its errors."""
    depth = len(field)
    forms = dict.fromkeys(
        str(error["loc"][depth])
        for error in errors
        if list(error["loc"][:depth]) == field and len(error["loc"]) > depth
    )
    return f"expected one of {', '.join(forms)}"


def _detail(error: Mapping[str, Any]) -> str:
    detail = str(error["msg"]).removeprefix("Value error, ")
    return detail[:1].lower() + detail[1:]


def _given(error: Mapping[str, Any]) -> str:
    value = error.get("input")
    return "" if isinstance(value, dict | list) else f" (got {value!r:.60})"


def _routing_message(request: Request, error: HTTPException) -> str:
    """Starlette's routing errors ("Not Found", "Method Not Allowed") as sentences that say what to do."""
    path = request.url.path
    if error.status_code == 404:
        return f"there is no route {path} on this port; GET /openapi.json lists the routes"
    if error.status_code == 405:
        allowed = (error.headers or {}).get("Allow", "another method")
        return f"{request.method} is not allowed on {path}; use {allowed}"
    return str(error.detail)


def _is_field(part: int | str) -> bool:
    return isinstance(part, int) or not (part in _UNION_TAGS or "[" in part or "(" in part)


def install_error_handlers(app: FastAPI, on_rejected: Callable[[int], None] | None = None) -> None:
    """Every error leaves in the OpenAI envelope, routing errors (404, 405) included.

    ``on_rejected`` hears the status of every refused request (for a metric).
    """

    async def on_api_error(_: Request, error: Exception) -> Response:
        api_error = as_api_error(error)
        if on_rejected is not None:
            on_rejected(api_error.status)
        return api_error.response()

    async def on_http_error(request: Request, error: Exception) -> Response:
        assert isinstance(error, HTTPException)
        message = _routing_message(request, error)
        return error_response(error.status_code, message, headers=error.headers)

    async def on_invalid(_: Request, error: Exception) -> Response:
        assert isinstance(error, RequestValidationError)
        return invalid_request(error.errors()).response()

    app.add_exception_handler(RequestValidationError, on_invalid)
    # Expected failures get their own handlers; the catch-all one (500) also logs and re-raises.
    for expected in _EXPECTED:
        app.add_exception_handler(expected, on_api_error)
    app.add_exception_handler(HTTPException, on_http_error)
    app.add_exception_handler(Exception, on_api_error)
