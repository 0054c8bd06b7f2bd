"""The dashboard's history over a real worker (the tiny Llama engine, its apps in process): the figures
the sampler reads from the worker's own /metrics (prefix-cache hit rate, inter-token latency, the KV
tiers' usage, offloads and restores) arrive under the names the worker really exposes, beside the
orchestrator's request rate and TTFT."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.disagg import TOKEN, HostDispatch, InProcessWorker, sentence, start_worker
from support.engine import make_config, tier_gib
from support.gateway_fakes import wait_for
from support.upstream_fakes import HttpxUpstream

from herd.api.crd import RoundRobinRouting
from herd.orchestrator.app import AppSettings, build_app
from herd.orchestrator.discovery import ModelConfig, StaticSource
from herd.orchestrator.history_sampler import HistorySettings
from herd.orchestrator.registry import RegistrySettings
from herd.worker.config import EngineConfig
from herd.worker.engine import LLMEngine
from herd.worker.model_runner import torch_engine

pytestmark = pytest.mark.timeout(120)

CHAT = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "You are a careful assistant. " * 8}],
    "max_tokens": 6,
    "ignore_eos": True,
    "temperature": 0,
    "stream": True,
}
SETTINGS = AppSettings(
    internal_token=TOKEN,
    registry=RegistrySettings(poll_interval=0.05),
    history=HistorySettings(interval_seconds=0.1, window_seconds=1.0, span_seconds=60.0),
)


def has_every_figure(point: dict[str, Any]) -> bool:
    """Every figure, the second request's cache hits included (a window may hold the first one only)."""
    model = point["models"].get("tiny", {})
    figures = ("ttft_p50_ms", "itl_p50_ms", "itl_p99_ms", "hit_rate")
    return (
        bool(model)
        and model["request_rate"] > 0
        and all(model[name] is not None for name in figures)
        and model["hit_rate"] > 0
    )


async def test_history_reads_a_real_workers_hit_rate_and_itl(tiny_llama: Path) -> None:
    async def traffic(client: httpx.AsyncClient) -> None:
        for _ in range(2):  # the second finds the first's prompt in the prefix cache
            response = await client.post("/v1/chat/completions", json=CHAT)
            assert response.status_code == 200, response.text

    point = await _history_after(tiny_llama, start_worker, traffic, has_every_figure)
    tiny = point["models"]["tiny"]
    assert tiny["hit_rate"] < 1, "the second request hit the first one's cached blocks, the first none"
    assert tiny["itl_p50_ms"] <= tiny["itl_p99_ms"]
    assert set(tiny["shares"]) == {"w0"}
    assert set(tiny["tiers"]) == {"device"}, "a worker without tiers reports its device pool only"
    assert tiny["pulls_per_s"] == {}


POOL_BLOCKS = 16
"""Each prompt below takes 7-8 blocks: the pool holds two, so cycling four evicts every time."""


def restored_from_host(point: dict[str, Any]) -> bool:
    host = point["models"].get("tiny", {}).get("tiers", {}).get("host")
    return host is not None and host["restored_per_s"] > 0 and host["stored_per_s"] > 0


async def test_history_reads_a_real_workers_kv_tiers(tiny_llama: Path) -> None:
    def tiered(config: EngineConfig) -> LLMEngine:
        kv_cache = {"blockSize": 16, "hostMemoryGiB": tier_gib(tiny_llama, 64)}
        spec = make_config(tiny_llama, num_blocks=POOL_BLOCKS, kvCache=kv_cache, maxModelLen=512)
        return torch_engine(spec.model_copy(update={"served_name": config.served_name}))

    async def start(*args: Any) -> InProcessWorker:
        return await start_worker(*args, build=tiered)

    async def traffic(client: httpx.AsyncClient) -> None:
        for _ in range(2):  # the first round offloads what the pool evicts, the second restores it
            for seed in range(4):
                words = sentence(random.Random(seed), 30)
                body = {**CHAT, "messages": [{"role": "user", "content": words}], "max_tokens": 2}
                response = await client.post("/v1/chat/completions", json=body)
                assert response.status_code == 200, response.text

    point = await _history_after(tiny_llama, start, traffic, restored_from_host)
    tiers = point["models"]["tiny"]["tiers"]
    assert set(tiers) == {"device", "host"}
    assert 0 < tiers["host"]["usage"] <= 1 and tiers["device"]["usage"] is not None
    assert tiers["device"]["evicted_per_s"] > 0, "the pool evicted the blocks the host tier took"


async def _history_after(
    tiny_llama: Path,
    start: Callable[..., Any],
    traffic: Callable[[httpx.AsyncClient], Any],
    check: Callable[[dict[str, Any]], bool],
) -> dict[str, Any]:
    """The newest history point passing ``check`` after ``traffic`` through an orchestrator in front of
    one real worker, ``start``-ed as ``support.disagg.start_worker`` starts one."""
    dispatch = HostDispatch()
    async with httpx.AsyncClient(transport=dispatch, timeout=60) as http:
        worker = await start(tiny_llama, "w0", "unified", dispatch, http)
        try:
            model = ModelConfig("tiny", RoundRobinRouting(strategy="round_robin"), block_size=16)
            source = StaticSource([model], [worker.endpoint])
            app = build_app(source, settings=SETTINGS, http=http, upstream=HttpxUpstream(http, token=TOKEN))
            async with app.router.lifespan_context(app):
                registry = app.state.registry
                await wait_for(
                    lambda: registry.workers.get("w0") is not None and registry.workers["w0"].is_healthy
                )
                transport = httpx.ASGITransport(app)
                async with httpx.AsyncClient(transport=transport, base_url="http://o", timeout=60) as client:
                    await _scraped_before_requests(client)
                    await traffic(client)
                    return await _point(client, check)
        finally:
            await worker.engine.stop()


async def _points(client: httpx.AsyncClient) -> list[dict[str, Any]]:
    points: list[dict[str, Any]] = (await client.get("/dashboard/data")).json()["history"]["points"]
    return points


async def _scraped_before_requests(client: httpx.AsyncClient) -> None:
    """Wait for two more points, so that a snapshot taken while the worker was healthy holds its
    counters: a worker's series first seen after the requests would count from there, without them
    (they count since the worker started)."""
    first = len(await _points(client))
    for _ in range(100):
        if len(await _points(client)) >= first + 2:
            return
        await asyncio.sleep(0.1)
    raise AssertionError("the dashboard history took no sample for 10 s")


async def _point(client: httpx.AsyncClient, check: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    """The newest point passing ``check``, polling /dashboard/data for at most 20 s."""
    for _ in range(200):
        points = await _points(client)
        passing = [point for point in points if check(point)]
        if passing:
            return passing[-1]
        await asyncio.sleep(0.1)
    busy = [point for point in points if point["models"].get("tiny", {}).get("request_rate")]
    raise AssertionError(f"no history point passed the check within 20 s: {busy}")
