"""An ASGI transport for httpx that streams the response body as the app sends it.

httpx's own ``ASGITransport`` returns only once the app has sent its whole body, so a response that
never ends (a worker's status stream) would never return. This one returns at the response's start,
then hands on each body chunk; closing the response disconnects the app and stops it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx

__all__ = ["StreamingASGITransport"]


class _Body(httpx.AsyncByteStream):
    def __init__(self, chunks: asyncio.Queue[bytes | BaseException | None], task: asyncio.Task[None]) -> None:
        self.chunks, self.task = chunks, task

    async def __aiter__(self) -> AsyncIterator[bytes]:
        while (chunk := await self.chunks.get()) is not None:
            if isinstance(chunk, BaseException):
                raise httpx.RemoteProtocolError(f"the app failed mid-response: {chunk!r}") from chunk
            yield chunk

    async def aclose(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self.task


class StreamingASGITransport(httpx.AsyncBaseTransport):
    def __init__(self, app: Any) -> None:
        self.app = app

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        body = b"".join([part async for part in request.stream])  # type: ignore[union-attr]
        started: asyncio.Future[tuple[int, list[tuple[bytes, bytes]]]] = (
            asyncio.get_running_loop().create_future()
        )
        chunks: asyncio.Queue[bytes | BaseException | None] = asyncio.Queue()
        disconnected = asyncio.Event()
        is_body_sent = False

        async def receive() -> dict[str, Any]:
            nonlocal is_body_sent
            if not is_body_sent:
                is_body_sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await disconnected.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                started.set_result((message["status"], message.get("headers", [])))
            elif message["type"] == "http.response.body":
                if chunk := message.get("body", b""):
                    chunks.put_nowait(chunk)
                if not message.get("more_body", False):
                    chunks.put_nowait(None)

        async def run() -> None:
            try:
                await self.app(_scope(request), receive, send)
            except Exception as error:
                if not started.done():
                    started.set_exception(error)
                chunks.put_nowait(error)
            finally:
                disconnected.set()
                chunks.put_nowait(None)

        task = asyncio.create_task(run())
        status, headers = await started
        return httpx.Response(status, headers=headers, stream=_Body(chunks, task), request=request)


def _scope(request: httpx.Request) -> dict[str, Any]:
    url = request.url
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": request.method,
        "headers": [(key.lower(), value) for key, value in request.headers.raw],
        "scheme": url.scheme,
        "path": url.path,
        "raw_path": url.raw_path.split(b"?")[0],
        "query_string": url.query,
        "server": (url.host, url.port or 80),
        "client": ("127.0.0.1", 123),
        "root_path": "",
    }
