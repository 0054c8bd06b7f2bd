"""An orchestrator in front of one real in-process worker (the tiny Llama engine), for the dashboard's
history: the data tests read /dashboard/data through it, the browser test serves it to Chromium.

``tiered_worker`` starts a worker with a host KV tier and a device pool of two prompts, and
``cycle_prompts`` sends it the traffic that makes that tier store and restore blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI

from herd.api.crd import RoundRobinRouting
from herd.api.protocol import Role
from herd.orchestrator.app import AppSettings, build_app
from herd.orchestrator.discovery import ModelConfig, StaticSource
from herd.orchestrator.history_sampler import HistorySettings
from herd.orchestrator.registry import RegistrySettings
from herd.worker.config import EngineConfig
from herd.worker.engine import LLMEngine
from herd.worker.model_runner import torch_engine
from support.disagg import TOKEN, HostDispatch, InProcessWorker, sentence, start_worker
from support.engine import make_config, tier_gib
from support.gateway_fakes import wait_for
from support.upstream_fakes import HttpxUpstream

__all__ = [
    "POOL_BLOCKS",
    "SETTINGS",
    "StartWorker",
    "cycle_prompts",
    "history_points",
    "orchestrator_over_worker",
    "restored_from_host",
    "tiered_worker",
    "wait_for_point",
]

SETTINGS = AppSettings(
    internal_token=TOKEN,
    registry=RegistrySettings(poll_interval=0.05),
    history=HistorySettings(interval_seconds=0.1, window_seconds=1.0, span_seconds=60.0),
)
POOL_BLOCKS = 16
"""Each prompt of ``cycle_prompts`` takes 7-8 blocks: the pool holds two, so cycling four evicts every time."""

StartWorker = Callable[[Path, str, Role, HostDispatch, httpx.AsyncClient], Any]
"""Starts one worker as ``support.disagg.start_worker`` does; awaited for an ``InProcessWorker``."""


async def tiered_worker(
    model: Path, worker_id: str, role: Role, dispatch: HostDispatch, http: httpx.AsyncClient
) -> InProcessWorker:
    """A worker whose KV pool holds ``POOL_BLOCKS`` blocks, over a host tier of 64 blocks."""

    def tiered(config: EngineConfig) -> LLMEngine:
        kv_cache = {"blockSize": 16, "hostMemoryGiB": tier_gib(model, 64)}
        spec = make_config(model, num_blocks=POOL_BLOCKS, kvCache=kv_cache, maxModelLen=512)
        return torch_engine(spec.model_copy(update={"served_name": config.served_name}))

    return await start_worker(model, worker_id, role, dispatch, http, build=tiered)


async def cycle_prompts(client: httpx.AsyncClient, rounds: int = 2) -> None:
    """Four 30-word prompts, ``rounds`` times: the first round offloads what the pool evicts, the next
    restores it from the host tier."""
    for _ in range(rounds):
        for seed in range(4):
            words = sentence(random.Random(seed), 30)
            body = {"model": "tiny", "messages": [{"role": "user", "content": words}], "max_tokens": 2}
            response = await client.post("/v1/chat/completions", json=body)
            assert response.status_code == 200, response.text


def restored_from_host(point: dict[str, Any]) -> bool:
    host = point["models"].get("tiny", {}).get("tiers", {}).get("host")
    return host is not None and host["restored_per_s"] > 0 and host["stored_per_s"] > 0


@contextlib.asynccontextmanager
async def orchestrator_over_worker(
    model: Path, start: StartWorker = start_worker
) -> AsyncIterator[tuple[FastAPI, httpx.AsyncClient]]:
    """A started orchestrator app routing model ``tiny`` to one worker ``w0`` (``start``-ed), and a
    client of the app. Yields once the worker is healthy and the history holds a sample of it taken
    before any request."""
    dispatch = HostDispatch()
    async with httpx.AsyncClient(transport=dispatch, timeout=60) as http:
        worker = await start(model, "w0", "unified", dispatch, http)
        try:
            config = ModelConfig("tiny", RoundRobinRouting(strategy="round_robin"), block_size=16)
            source = StaticSource([config], [worker.endpoint])
            app = build_app(source, settings=SETTINGS, http=http, upstream=HttpxUpstream(http, token=TOKEN))
            async with app.router.lifespan_context(app):
                registry = app.state.registry
                await wait_for(
                    lambda: registry.workers.get("w0") is not None and registry.workers["w0"].is_healthy
                )
                transport = httpx.ASGITransport(app)
                async with httpx.AsyncClient(transport=transport, base_url="http://o", timeout=60) as client:
                    await _scraped_before_requests(client)
                    yield app, client
        finally:
            await worker.engine.stop()


async def history_points(client: httpx.AsyncClient) -> list[dict[str, Any]]:
    points: list[dict[str, Any]] = (await client.get("/dashboard/data")).json()["history"]["points"]
    return points


async def _scraped_before_requests(client: httpx.AsyncClient) -> None:
    """Wait for two more points, so that a snapshot taken while the worker was healthy holds its
    counters: a worker's series first seen after the requests would count from there, without them
    (they count since the worker started)."""
    first = len(await history_points(client))
    for _ in range(100):
        if len(await history_points(client)) >= first + 2:
            return
        await asyncio.sleep(0.1)
    raise AssertionError("the dashboard history took no sample for 10 s")


async def wait_for_point(
    client: httpx.AsyncClient, check: Callable[[dict[str, Any]], bool]
) -> dict[str, Any]:
    """The newest point passing ``check``, polling /dashboard/data for at most 20 s."""
    for _ in range(200):
        points = await history_points(client)
        passing = [point for point in points if check(point)]
        if passing:
            return passing[-1]
        await asyncio.sleep(0.1)
    busy = [point for point in points if point["models"].get("tiny", {}).get("request_rate")]
    raise AssertionError(f"no history point passed the check within 20 s: {busy}")
