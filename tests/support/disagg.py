"""In-process disaggregated workers for tests: real tiny-model engines behind ASGI apps, one transport.

``HostDispatch`` sends each request to the app registered for its host, so the orchestrator, the
decode worker's KV pulls and the test all reach the same in-process workers without sockets; a
host or a (host, path) pair can be made to refuse connections to play a worker that died.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from herd.api.protocol import INTERNAL_PATHS, TOKEN_HEADER, Role
from herd.orchestrator.discovery import WorkerEndpoint
from herd.worker.async_engine import AsyncEngine
from herd.worker.config import EngineConfig
from herd.worker.engine import LLMEngine
from herd.worker.model_runner import torch_engine
from herd.worker.server import PublicOptions, build_internal_app, build_public_app
from herd.worker.server._disagg_setup import attach_disaggregation
from support.asgi_stream import StreamingASGITransport
from support.worker_server import engine_config

__all__ = ["TOKEN", "WORDS", "HostDispatch", "InProcessWorker", "greedy_chat", "sentence", "start_worker"]

TOKEN = "disagg-token"
MODEL = "tiny"
WORDS = ["the", "cat", "sat", "on", "a", "mat", "while", "seven", "dogs", "ran", "far", "away", "under"]


def greedy_chat(text: str, **fields: Any) -> dict[str, Any]:
    """A chat request for ``text`` with 8 greedy tokens, EOS ignored (so outputs compare exactly)."""
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
        **fields,
    }


def sentence(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


@dataclass(eq=False)
class HostDispatch(httpx.AsyncBaseTransport):
    apps: dict[str, StreamingASGITransport] = field(default_factory=dict)
    refused: set[tuple[str, str | None]] = field(default_factory=set)
    """``(host, None)`` refuses every path of the host, ``(host, path)`` that one path."""
    num_refused: int = 0

    def add(self, host: str, app: Any) -> None:
        self.apps[host] = StreamingASGITransport(app)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        host = request.url.host
        if (host, None) in self.refused or (host, request.url.path) in self.refused:
            self.num_refused += 1
            raise httpx.ConnectError(f"connection refused ({host} is down in this test)", request=request)
        return await self.apps[host].handle_async_request(request)


@dataclass(eq=False)
class InProcessWorker:
    id: str
    role: Role
    engine: AsyncEngine
    http: httpx.AsyncClient

    @property
    def endpoint(self) -> WorkerEndpoint:
        return WorkerEndpoint(
            self.id, MODEL, f"http://{self.id}.public:8000", f"http://{self.id}.internal:9000", self.role
        )

    async def public(self, path: str, body: Any = None, *, as_orchestrator: bool = True) -> httpx.Response:
        """POST ``body`` (GET without one) to the public port, with the internal token as the
        orchestrator sends it (``as_orchestrator``) or without, as any other client."""
        url, headers = self.endpoint.url + path, {TOKEN_HEADER: TOKEN} if as_orchestrator else {}
        if body is None:
            return await self.http.get(url, headers=headers)
        return await self.http.post(url, json=body, headers=headers)

    async def internal(self, path: str, body: Any = None) -> httpx.Response:
        """POST ``body`` (GET without one) to the internal port, with the token."""
        url, headers = self.endpoint.internal_url + path, {TOKEN_HEADER: TOKEN}
        if body is None:
            return await self.http.get(url, headers=headers)
        return await self.http.post(url, json=body, headers=headers)

    async def load(self) -> dict[str, Any]:
        result: dict[str, Any] = (await self.internal(INTERNAL_PATHS.load)).json()
        return result

    async def total_blocks(self) -> int:
        return int((await self.load())["num_total_blocks"])

    async def settled_free_blocks(self, expected: int | None = None) -> int:
        """Free blocks once they reach ``expected`` (default: all), or after a bounded wait.

        The load report trails the engine thread's commands by one loop turn.
        """
        load = await self.load()
        wanted = load["num_total_blocks"] if expected is None else expected
        for _ in range(50):
            if load["num_free_blocks"] == wanted:
                break
            await asyncio.sleep(0.05)
            load = await self.load()
        return int(load["num_free_blocks"])

    async def metric(self, name: str, **labels: str) -> float:
        """The sum of ``name``'s samples whose labels include ``labels`` (0 when there is none)."""
        text = (await self.public("/metrics")).text
        return sum(
            sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == name and labels.items() <= sample.labels.items()
        )


async def start_worker(
    model: Path,
    worker_id: str,
    role: Role,
    dispatch: HostDispatch,
    http: httpx.AsyncClient,
    build: Callable[[EngineConfig], LLMEngine] = torch_engine,
    lora_modules: dict[str, Path] | None = None,
) -> InProcessWorker:
    """A loaded engine (``build``: on the torch runner by default; with ``lora_modules`` loaded)
    with both apps registered in ``dispatch`` under the worker's two hosts."""
    config = engine_config(model, maxModelLen=512, kvCache={"blockSize": 16, "memoryGiB": 0.02})
    config = config.model_copy(update={"lora_modules": lora_modules or {}})
    engine = AsyncEngine(lambda: build(config))
    engine.start()
    await engine.wait_loaded()
    public = build_public_app(engine, PublicOptions(MODEL, internal_token=TOKEN))
    disagg = attach_disaggregation(public, engine, TOKEN, http=http)
    dispatch.add(f"{worker_id}.public", public)
    dispatch.add(f"{worker_id}.internal", build_internal_app(engine, TOKEN, routers=[disagg.router]))
    return InProcessWorker(worker_id, role, engine, http)
