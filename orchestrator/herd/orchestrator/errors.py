"""Every error the gateway answers, in the OpenAI envelope ``{"error": {"message", "type", "param", "code"}}``.

``GatewayError`` is what request handling raises; ``install_error_handlers`` turns it, Starlette's
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

from herd.api.openai import ErrorResponse

__all__ = ["INTERNAL_ERROR", "GatewayError", "error_response", "install_error_handlers"]

log = logging.getLogger(__name__)

INTERNAL_ERROR = "the gateway failed on this request (an internal error, logged there); retry it"


class GatewayError(Exception):
    """An error answered to the client in the OpenAI envelope; ``param`` names the offending field."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = dict(headers or {})

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, param=self.param, headers=self.headers)


def error_response(
    status: int, message: str, *, param: str | None = None, headers: Mapping[str, str] | None = None
) -> JSONResponse:
    body = ErrorResponse.of(status, message, param=param).model_dump()
    return JSONResponse(body, status_code=status, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(GatewayError, _on_gateway_error)
    app.add_exception_handler(HTTPException, _on_http_error)
    app.add_exception_handler(RequestValidationError, _on_invalid)
    app.add_middleware(_CatchAll)


async def _on_gateway_error(_: Request, error: Exception) -> Response:
    assert isinstance(error, GatewayError)
    return error.response()


async def _on_http_error(request: Request, error: Exception) -> Response:
    assert isinstance(error, HTTPException)
    method, path = request.method, request.scope["path"]
    match error.status_code:
        case 404:
            message = f"no route {method} {path}; GET /openapi.json lists the routes this gateway serves"
        case 405:
            allowed = (error.headers or {}).get("Allow", "another method")
            message = f"{path} does not accept {method}; use {allowed}"
        case _:
            message = str(error.detail)
    return error_response(error.status_code, message, headers=error.headers)


async def _on_invalid(_: Request, error: Exception) -> Response:
    assert isinstance(error, RequestValidationError)
    first = error.errors()[0]
    param = ".".join(str(part) for part in first["loc"][1:]) or None  # without "query", "path", ...
    return error_response(422, f"invalid request: {param}: {first['msg']}", param=param)


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
