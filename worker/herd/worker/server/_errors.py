"""Errors in the OpenAI envelope, and the mapping from engine failures to HTTP status codes."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from herd.api.errors import HttpError, invalid_request, route_message
from herd.api.openai import ErrorResponse
from herd.api.prompt import PromptError
from herd.worker.async_engine import EngineDeadError, EngineDrainingError, RequestFailedError
from herd.worker.engine import QueueFullError, UnknownLoraError
from herd.worker.sampling_params import InvalidParamError

__all__ = ["as_api_error", "error_response", "install_error_handlers", "respond"]

logger = logging.getLogger(__name__)

RETRY_AFTER_S = "1"


def error_response(
    status: int, message: str, *, param: str | None = None, headers: Mapping[str, str] | None = None
) -> JSONResponse:
    body = ErrorResponse.of(status, message, param=param).model_dump()
    return JSONResponse(body, status_code=status, headers=headers)


def respond(error: HttpError) -> JSONResponse:
    return error_response(error.status, error.message, param=error.param, headers=error.headers)


def as_api_error(error: Exception) -> HttpError:
    """The HTTP meaning of an exception raised while serving a request."""
    match error:
        case HttpError():
            return error
        case QueueFullError():
            return HttpError(429, str(error), headers={"Retry-After": RETRY_AFTER_S})
        case PromptError():
            return HttpError(400, str(error), param="messages")
        case UnknownLoraError():
            return HttpError(404, str(error), param="model")
        case InvalidParamError():
            return HttpError(400, str(error), param=error.param)
        case RequestFailedError() | EngineDeadError(reached_engine=True):  # logged by the engine
            return HttpError(500, str(error))
        case ValueError():  # the engine's PromptTooLongError and its other refusals (pool too small, ...)
            return HttpError(400, str(error))
        case EngineDrainingError() | EngineDeadError():
            return HttpError(503, str(error), headers={"Retry-After": RETRY_AFTER_S})
        case _:
            logger.error("request failed", exc_info=error)
            return HttpError(500, f"internal error: {type(error).__name__}: {error}")


_EXPECTED: tuple[type[Exception], ...] = (
    HttpError,
    QueueFullError,
    PromptError,
    UnknownLoraError,
    EngineDrainingError,
    EngineDeadError,
    RequestFailedError,
    ValueError,
)


def install_error_handlers(app: FastAPI, on_rejected: Callable[[int], None] | None = None) -> None:
    """Every error leaves in the OpenAI envelope, routing errors (404, 405) included.

    ``on_rejected`` hears the status of every refused request (for a metric).
    """

    async def on_api_error(_: Request, error: Exception) -> Response:
        api_error = as_api_error(error)
        if on_rejected is not None:
            on_rejected(api_error.status)
        return respond(api_error)

    async def on_http_error(request: Request, error: Exception) -> Response:
        assert isinstance(error, HTTPException)
        allow = (error.headers or {}).get("Allow")
        message = route_message(
            request.method, request.url.path, error.status_code, allow=allow, detail=str(error.detail)
        )
        return error_response(error.status_code, message, headers=error.headers)

    async def on_invalid(_: Request, error: Exception) -> Response:
        assert isinstance(error, RequestValidationError)
        return respond(invalid_request(error.errors()))

    app.add_exception_handler(RequestValidationError, on_invalid)
    # Expected failures get their own handlers; the catch-all one (500) also logs and re-raises.
    for expected in _EXPECTED:
        app.add_exception_handler(expected, on_api_error)
    app.add_exception_handler(HTTPException, on_http_error)
    app.add_exception_handler(Exception, on_api_error)
