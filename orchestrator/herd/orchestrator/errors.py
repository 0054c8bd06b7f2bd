"""Every error the gateway answers, in the OpenAI envelope ``{"error": {"message", "type", "param", "code"}}``.

``herd.api.errors.HttpError`` is what request handling raises; ``install_error_handlers`` turns it, Starlette's
routing errors (404 unknown route, 405 wrong method), FastAPI's parameter validation (422) and any
unexpected exception (500, logged once with its traceback, one sentence to the client) into that
envelope.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from herd.api.errors import HttpError, invalid_request, route_message
from herd.api.openai import ErrorResponse

__all__ = ["INTERNAL_ERROR", "error_response", "install_error_handlers", "respond"]

log = logging.getLogger(__name__)

INTERNAL_ERROR = "the gateway failed on this request (an internal error, logged there); retry it"


def error_response(
    status: int, message: str, *, param: str | None = None, headers: Mapping[str, str] | None = None
) -> JSONResponse:
    body = ErrorResponse.of(status, message, param=param).model_dump()
    return JSONResponse(body, status_code=status, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(HttpError, _on_http_error_raised)
    app.add_exception_handler(HTTPException, _on_http_error)
    app.add_exception_handler(RequestValidationError, _on_invalid)
    app.add_middleware(_CatchAll)


def respond(error: HttpError) -> JSONResponse:
    return error_response(error.status, error.message, param=error.param, headers=error.headers)


async def _on_http_error_raised(_: Request, error: Exception) -> Response:
    assert isinstance(error, HttpError)
    return respond(error)


async def _on_http_error(request: Request, error: Exception) -> Response:
    assert isinstance(error, HTTPException)
    allow = (error.headers or {}).get("Allow")
    message = route_message(
        request.method, request.scope["path"], error.status_code, allow=allow, detail=str(error.detail)
    )
    return error_response(error.status_code, message, headers=error.headers)


async def _on_invalid(_: Request, error: Exception) -> Response:
    assert isinstance(error, RequestValidationError)
    # FastAPI's locations start with where the value was ("query", "path"): the client knows the name.
    errors = [{**detail, "loc": tuple(detail["loc"][1:])} for detail in error.errors()]
    return respond(invalid_request(errors, status=422))


class _CatchAll:
    """An unexpected exception: logged here, once, with its traceback; the client gets a 500 envelope
    (unless its answer had already started: then the connection just ends). Not re-raised, so the
    server does not log it a second time."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        has_started = False

        async def watched_send(message: Message) -> None:
            nonlocal has_started
            has_started = has_started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watched_send)
        except Exception:
            log.exception("request failed", extra={"method": scope["method"], "path": scope["path"]})
            if not has_started:
                await error_response(500, INTERNAL_ERROR)(scope, receive, send)
