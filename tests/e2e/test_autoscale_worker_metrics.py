"""The autoscaler reads a real ``herd worker``'s /metrics: the names, labels and buckets it renders
parse, and completions show up as TTFT and ITL p95s between two scrapes."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
from support.worker_server import worker_process

from herd.operator.metrics_source import Scrape, observe, parse_scrape, scrape_all

pytestmark = pytest.mark.e2e

TOKEN = "e2e-token"


async def scrape(url: str) -> dict[str, Scrape | None]:
    async with httpx.AsyncClient(timeout=5.0) as http:
        return await scrape_all(http, {"worker-0": f"{url}/metrics"}, parse_scrape)


def test_real_worker_metrics_give_p95s(tiny_llama: Path, tmp_path: Path) -> None:
    with worker_process(tiny_llama, log=tmp_path / "worker.log", token=TOKEN) as worker:
        before = asyncio.run(scrape(worker.url))
        for _ in range(3):
            body = {"model": "tiny", "prompt": "hello world", "max_tokens": 4, "ignore_eos": True}
            httpx.post(f"{worker.url}/v1/completions", json=body, timeout=60.0).raise_for_status()
        after = asyncio.run(scrape(worker.url))
    first = before["worker-0"]
    assert first is not None and after["worker-0"] is not None
    observed = observe({"worker-0": first}, after)
    assert observed.is_complete
    assert observed.ttft_p95_ms is not None and observed.ttft_p95_ms > 0
    assert observed.itl_p95_ms is not None and observed.itl_p95_ms > 0
    assert observed.num_waiting == 0
    assert 0.0 <= observed.kv_usage <= 1.0
