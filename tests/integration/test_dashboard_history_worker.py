"""The dashboard's history over a real worker (the tiny Llama engine, its apps in process): the figures
the sampler reads from the worker's own /metrics (prefix-cache hit rate, inter-token latency) arrive
under the names the worker really exposes, beside the orchestrator's request rate and TTFT."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.disagg import TOKEN, HostDispatch, start_worker
from support.gateway_fakes import wait_for
from support.upstream_fakes import HttpxUpstream

from herd.api.crd import RoundRobinRouting
from herd.orchestrator.app import AppSettings, build_app
from herd.orchestrator.discovery import ModelConfig, StaticSource
from herd.orchestrator.history_sampler import HistorySettings
from herd.orchestrator.registry import RegistrySettings

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
    model = point["models"].get("tiny", {})
    figures = ("ttft_p50_ms", "itl_p50_ms", "itl_p99_ms", "hit_rate")
    return bool(model) and model["request_rate"] > 0 and all(model[name] is not None for name in figures)


async def test_history_reads_a_real_workers_hit_rate_and_itl(tiny_llama: Path) -> None:
    dispatch = HostDispatch()
    async with httpx.AsyncClient(transport=dispatch, timeout=60) as http:
        worker = await start_worker(tiny_llama, "w0", "unified", dispatch, http)
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
                    for _ in range(2):  # the second finds the first's prompt in the prefix cache
                        response = await client.post("/v1/chat/completions", json=CHAT)
                        assert response.status_code == 200, response.text
                    point = await _complete_point(client)
        finally:
            await worker.engine.stop()
    tiny = point["models"]["tiny"]
    assert 0 < tiny["hit_rate"] < 1, "the second request hit the first one's cached blocks, the first none"
    assert tiny["itl_p50_ms"] <= tiny["itl_p99_ms"]
    assert set(tiny["shares"]) == {"w0"}


async def _points(client: httpx.AsyncClient) -> list[dict[str, Any]]:
    points: list[dict[str, Any]] = (await client.get("/dashboard/data")).json()["history"]["points"]
    return points


async def _scraped_before_requests(client: httpx.AsyncClient) -> None:
    """Wait for two more points, so that a snapshot taken while the worker was healthy holds its
    counters: a worker's series first seen after the requests would leave them out of every window
    (they count since the worker started), and the figures would never appear."""
    first = len(await _points(client))
    for _ in range(100):
        if len(await _points(client)) >= first + 2:
            return
        await asyncio.sleep(0.1)
    raise AssertionError("the dashboard history took no sample for 10 s")


async def _complete_point(client: httpx.AsyncClient) -> dict[str, Any]:
    """The newest point with every figure, polling /dashboard/data for at most 20 s."""
    for _ in range(200):
        points = await _points(client)
        complete = [point for point in points if has_every_figure(point)]
        if complete:
            return complete[-1]
        await asyncio.sleep(0.1)
    busy = [point for point in points if point["models"].get("tiny", {}).get("request_rate")]
    raise AssertionError(f"no history point with every figure within 20 s: {busy}")
