"""``X-Request-Id``: taken from the request (or made up) and echoed on every response."""

from __future__ import annotations

import uuid

from starlette.datastructures import MutableHeaders
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from herd.api.protocol import REQUEST_ID_HEADER, is_valid_request_id

__all__ = ["RequestIdMiddleware", "request_id"]


class RequestIdMiddleware:
    """Plain ASGI (not ``BaseHTTPMiddleware``), so streaming and cancellation pass through untouched."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = Request(scope).headers.get(REQUEST_ID_HEADER, "")
        value = given if is_valid_request_id(given) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = value

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)[REQUEST_ID_HEADER] = value
            await send(message)

        await self.app(scope, receive, send_with_id)


def request_id(request: Request) -> str:
    value: str = request.state.request_id
    return value
