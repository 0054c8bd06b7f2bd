"""Limits against slow or abusive clients, on a real orchestrator server on loopback: an oversized
request head gets 431, a body sent a byte at a time gets 408, an idle keep-alive connection closes.
Raw sockets, because an HTTP client would not misbehave on request."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

import httpx
import pytest
from support.gateway_fakes import FAST_REGISTRY, FakeCluster, FakeWorker, wait_for
from support.procs import free_port
from support.upstream_fakes import HttpxUpstream

from herd.orchestrator.app import AppSettings, build_app
from herd.orchestrator.server import ServerLimits, build_server

pytestmark = pytest.mark.timeout(60)

LIMITS = ServerLimits(max_header_bytes=4096, keep_alive_timeout=1)
SETTINGS = AppSettings(registry=FAST_REGISTRY, body_timeout=1.0)


@contextlib.asynccontextmanager
async def orchestrator() -> AsyncIterator[int]:
    """The orchestrator over one fake worker, served by ``build_server`` on a free loopback port."""
    cluster = FakeCluster([FakeWorker("w0")])
    async with httpx.AsyncClient(transport=cluster.transport()) as http:
        app = build_app(cluster.source(), settings=SETTINGS, http=http, upstream=HttpxUpstream(http))
        port = free_port()
        server = build_server(app, host="127.0.0.1", port=port, limits=LIMITS)
        task = asyncio.create_task(server.serve())
        try:
            await wait_for(lambda: server.started or task.done(), within=30)
            yield port
        finally:
            server.should_exit = True
            await asyncio.wait_for(task, 10)


async def exchange(
    port: int, *parts: bytes, pause: float = 0.0, close_within: float = 10.0
) -> tuple[bytes, bool]:
    """Send ``parts`` (``pause`` seconds apart, until the server answers); the answer and whether
    the server then closed the connection within ``close_within`` seconds."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        answer = b""
        for part in parts:
            writer.write(part)
            await writer.drain()
            with contextlib.suppress(TimeoutError):
                answer = await asyncio.wait_for(reader.read(65536), pause) if pause else answer
            if answer:
                break
        answer = answer or await asyncio.wait_for(reader.read(65536), 10)
        with contextlib.suppress(TimeoutError):
            return answer, await asyncio.wait_for(reader.read(65536), close_within) == b""
        return answer, False
    finally:
        writer.close()


def status_and_error(answer: bytes) -> tuple[int, dict[str, object]]:
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), json.loads(body)["error"]


async def test_a_head_past_the_limit_is_431_and_the_connection_closes() -> None:
    async with orchestrator() as port:
        small, _ = await exchange(port, b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        big = b"GET /health HTTP/1.1\r\nhost: x\r\nx-padding: " + b"a" * 5000 + b"\r\n\r\n"
        answer, closed = await exchange(port, big)
    assert small.startswith(b"HTTP/1.1 200")
    status, error = status_and_error(answer)
    assert (status, error["code"], error["type"]) == (431, 431, "invalid_request_error")
    assert closed


async def test_a_body_sent_a_byte_at_a_time_is_408_and_the_connection_closes() -> None:
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}).encode()
    head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
    head += b"content-length: %d\r\n\r\n" % len(body)
    async with orchestrator() as port:
        answer, closed = await exchange(port, head, *[body[i : i + 1] for i in range(len(body))], pause=0.5)
    status, error = status_and_error(answer)
    assert (status, error["code"]) == (408, 408) and "did not arrive" in str(error["message"])
    assert closed


async def test_an_idle_keep_alive_connection_is_closed() -> None:
    async with orchestrator() as port:
        # Within 4 s: uvicorn's own default (5 s) would not close it in time.
        answer, closed = await exchange(port, b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n", close_within=4.0)
    assert answer.startswith(b"HTTP/1.1 200") and closed
