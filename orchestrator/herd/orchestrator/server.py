"""Serving the orchestrator app with uvicorn on one host and port, on uvloop, within ``ServerLimits``.

A client may hold a connection only so long: an idle keep-alive connection closes after
``keep_alive_timeout`` seconds, a request head (request line and headers) larger than
``max_header_bytes`` gets 431 and the connection closes, and a body that does not arrive within the
app's ``body_timeout`` gets 408 (``herd.orchestrator.app``).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass

import uvicorn
import uvloop
from fastapi import FastAPI
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from herd.api.heap import freeze_startup_heap
from herd.api.openai import ErrorResponse

__all__ = ["ServerLimits", "build_server", "run_server", "serve"]

_STARTUP_POLL_SECONDS = 0.05
_STARTUP_LIMIT_SECONDS = 60.0


@dataclass(frozen=True, slots=True)
class ServerLimits:
    max_header_bytes: int = 16 * 1024
    """The request line plus every header (names and values); a larger head gets 431."""
    keep_alive_timeout: int = 75
    """Seconds an idle keep-alive connection stays open: longer than clients keep one (httpx and the
    openai SDK 5 s), as nginx's 75 s is. A server that closes first races a client reusing the
    connection at that moment: the request meets a closed socket and the client gets a reset with no
    answer (uvicorn's 5 s default did that to 2 of 5,000 requests in the soak)."""


def build_server(app: FastAPI, *, host: str, port: int, limits: ServerLimits | None = None) -> uvicorn.Server:
    limits = limits or ServerLimits()
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_config=None,
        access_log=False,
        lifespan="on",
        http=_BoundedHeadProtocol,
        h11_max_incomplete_event_size=limits.max_header_bytes,  # _BoundedHeadProtocol reads it
        timeout_keep_alive=limits.keep_alive_timeout,
    )
    return uvicorn.Server(config)


def run_server(
    app: FastAPI,
    *,
    host: str,
    port: int,
    limits: ServerLimits | None = None,
    on_started: Callable[[], None] | None = None,
) -> None:
    """``serve`` on a uvloop event loop (``asyncio.run`` would give the slower pure-Python loop)."""
    uvloop.run(serve(app, host=host, port=port, limits=limits, on_started=on_started))


async def serve(
    app: FastAPI,
    *,
    host: str,
    port: int,
    limits: ServerLimits | None = None,
    on_started: Callable[[], None] | None = None,
) -> None:
    """Run until SIGINT or SIGTERM; once the socket accepts connections, the startup heap is frozen
    (``herd.api.heap``) and ``on_started`` runs."""
    server = build_server(app, host=host, port=port, limits=limits)
    task = asyncio.create_task(server.serve())
    if await _started(server, task):
        freeze_startup_heap(port=port)
        if on_started is not None:
            on_started()
    await task


async def _started(server: uvicorn.Server, task: asyncio.Task[None]) -> bool:
    """Whether the server came up (uvicorn has no startup callback, so poll its flag, bounded)."""
    for _ in range(int(_STARTUP_LIMIT_SECONDS / _STARTUP_POLL_SECONDS)):
        if server.started or task.done():
            break
        await asyncio.sleep(_STARTUP_POLL_SECONDS)
    return bool(server.started)


class _BoundedHeadProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a bound on each request's head.

    uvicorn bounds the head only on its h11 protocol, which costs more CPU per request, so this one
    counts the request line and the headers as the parser delivers them; past the limit it answers
    431 in the OpenAI envelope, closes the connection and ignores the rest.
    """

    _num_head_bytes = 0
    _is_refused = False

    def data_received(self, data: bytes) -> None:
        if not self._is_refused:
            super().data_received(data)

    def on_message_begin(self) -> None:
        self._num_head_bytes = 0
        super().on_message_begin()

    def on_url(self, url: bytes) -> None:
        if self._fits(len(url)):
            super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._fits(len(name) + len(value) + 4):  # ": " and CRLF
            super().on_header(name, value)

    def on_headers_complete(self) -> None:
        if not self._is_refused:  # the app never sees a refused request
            super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        if not self._is_refused:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if not self._is_refused:
            super().on_message_complete()

    def _fits(self, num_bytes: int) -> bool:
        self._num_head_bytes += num_bytes
        limit = self.config.h11_max_incomplete_event_size
        if not self._is_refused and limit is not None and self._num_head_bytes > limit:
            self._is_refused = True
            message = f"the request line and headers exceed {limit} bytes; send fewer or shorter headers"
            self.transport.write(_head_too_large(message))
            self.transport.close()
        return not self._is_refused


def _head_too_large(message: str) -> bytes:
    body = json.dumps(ErrorResponse.of(431, message).model_dump()).encode()
    head = (
        f"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body
