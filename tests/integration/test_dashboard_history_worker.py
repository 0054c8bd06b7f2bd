"""The dashboard's history over a real worker (the tiny Llama engine, its apps in process): the figures
the sampler reads from the worker's own /metrics (prefix-cache hit rate, inter-token latency, the KV
tiers' usage, offloads and restores) arrive under the names the worker really exposes, beside the
orchestrator's request rate and TTFT."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from support.dashboard_worker import (
    cycle_prompts,
    orchestrator_over_worker,
    restored_from_host,
    tiered_worker,
    wait_for_point,
)

pytestmark = pytest.mark.timeout(120)

CHAT = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "You are a careful assistant. " * 8}],
    "max_tokens": 6,
    "ignore_eos": True,
    "temperature": 0,
    "stream": True,
}


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
    async with orchestrator_over_worker(tiny_llama) as (_, client):
        for _ in range(2):  # the second finds the first's prompt in the prefix cache
            response = await client.post("/v1/chat/completions", json=CHAT)
            assert response.status_code == 200, response.text
        point = await wait_for_point(client, has_every_figure)
    tiny = point["models"]["tiny"]
    assert tiny["hit_rate"] < 1, "the second request hit the first one's cached blocks, the first none"
    assert tiny["itl_p50_ms"] <= tiny["itl_p99_ms"]
    assert set(tiny["shares"]) == {"w0"}
    assert set(tiny["tiers"]) == {"device"}, "a worker without tiers reports its device pool only"
    assert tiny["pulls_per_s"] == {}


async def test_history_reads_a_real_workers_kv_tiers(tiny_llama: Path) -> None:
    async with orchestrator_over_worker(tiny_llama, tiered_worker) as (_, client):
        await cycle_prompts(client)
        point = await wait_for_point(client, restored_from_host)
    tiers = point["models"]["tiny"]["tiers"]
    assert set(tiers) == {"device", "host"}
    assert 0 < tiers["host"]["usage"] <= 1 and tiers["device"]["usage"] is not None
    assert tiers["device"]["evicted_per_s"] > 0, "the pool evicted the blocks the host tier took"
