"""The proxy over real loopback sockets: chunks pass as they arrive, a client disconnect reaches the worker."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from support.procs import free_port

from herd.api.crd import RoundRobinRouting
from herd.api.protocol import INTERNAL_PATHS, KVEvent, KVSnapshot, LoadReport, StatusQuery
from herd.api.worker_status import StatusSource, status_lines
from herd.orchestrator.app import AppSettings, build_app
from herd.orchestrator.discovery import ModelConfig, StaticSource, WorkerEndpoint
from herd.orchestrator.registry import RegistrySettings

CHUNK_PAUSE = 0.3


async def _ready() -> tuple[bool, LoadReport]:
    return True, LoadReport()


async def _no_events(_: int, wait: float) -> list[KVEvent]:
    await asyncio.sleep(wait)
    return []


async def _empty() -> KVSnapshot:
    return KVSnapshot(epoch="e", seq=0, block_size=16, block_hashes=[])


_IDLE = StatusSource(lambda: "e", _ready, _no_events, _empty)
"""A worker with nothing cached, always ready."""


class SlowWorker:
    """A real HTTP worker whose stream pauses between chunks and records whether it was cut off."""

    def __init__(self) -> None:
        self.was_cancelled = asyncio.Event()
        self.app = Starlette(
            routes=[
                Route(INTERNAL_PATHS.status, self.status),
                Route("/v1/chat/completions", self.stream, methods=["POST"]),
            ]
        )

    async def status(self, request: Request) -> Response:
        query = StatusQuery.model_validate(dict(request.query_params))
        return StreamingResponse(status_lines(_IDLE, query), media_type="application/x-ndjson")

    async def stream(self, _: Request) -> Response:
        async def chunks() -> AsyncIterator[bytes]:
            try:
                for number in range(20):
                    yield f"data: {number}\n\n".encode()
                    await asyncio.sleep(CHUNK_PAUSE)
            except asyncio.CancelledError:
                self.was_cancelled.set()
                raise

        return StreamingResponse(chunks(), media_type="text/event-stream")


@contextlib.asynccontextmanager
async def serving(app: object) -> AsyncIterator[str]:
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None, lifespan="on"))  # type: ignore[arg-type]
    task = asyncio.create_task(server.serve())
    for _ in range(200):
        if server.started:
            break
        await asyncio.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)


@contextlib.asynccontextmanager
async def gateway_over(worker: SlowWorker) -> AsyncIterator[str]:
    async with serving(worker.app) as worker_url:
        source = StaticSource(
            [ModelConfig("m", RoundRobinRouting(strategy="round_robin"))],
            [WorkerEndpoint("w0", "m", worker_url, worker_url)],
        )
        app = build_app(source, settings=AppSettings(registry=RegistrySettings(poll_interval=0.05)))
        async with serving(app) as url, httpx.AsyncClient() as client:
            for _ in range(100):
                if (await client.get(f"{url}/ready")).status_code == 200:
                    break
                await asyncio.sleep(0.05)
            yield url


async def test_chunks_are_forwarded_as_they_arrive() -> None:
    worker = SlowWorker()
    async with gateway_over(worker) as url, httpx.AsyncClient(timeout=10) as client:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        arrivals = []
        started = time.monotonic()
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
            async for _ in response.aiter_raw():
                arrivals.append(time.monotonic() - started)
                if len(arrivals) == 3:
                    break
    assert arrivals[0] < CHUNK_PAUSE  # the first chunk did not wait for later ones
    assert arrivals[2] - arrivals[0] >= CHUNK_PAUSE


async def test_client_disconnect_cancels_the_worker_stream() -> None:
    worker = SlowWorker()
    async with gateway_over(worker) as url:
        async with httpx.AsyncClient(timeout=10) as client:
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
            async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
                async for _ in response.aiter_raw():
                    break
        await asyncio.wait_for(worker.was_cancelled.wait(), 5)
