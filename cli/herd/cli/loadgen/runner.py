"""Drives a run: keeps ``concurrency`` requests in flight, or sends Poisson arrivals at
``request_rate`` (at most ``concurrency`` in flight when both are set), until ``num_requests`` have
been sent or ``duration_s`` has passed; requests already sent are always awaited."""

from __future__ import annotations

import asyncio
import random
import time
from contextlib import AbstractAsyncContextManager, nullcontext
from typing import Any

import httpx
from pydantic import BaseModel, Field, ValidationError

from herd.cli.loadgen.client import RequestResult, send
from herd.cli.loadgen.config import BenchConfig
from herd.cli.loadgen.problems import first_problem
from herd.cli.loadgen.progress import Progress
from herd.cli.loadgen.stats import build_report
from herd.cli.loadgen.workloads import Workload

__all__ = ["run_benchmark"]


async def run_benchmark(
    config: BenchConfig,
    *,
    transport: httpx.AsyncBaseTransport | None = None,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Run the load described by ``config`` and return the report (see ``stats.build_report``)."""
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    progress = progress or Progress(total=config.num_requests, duration_s=config.duration_s, enabled=False)
    async with httpx.AsyncClient(
        base_url=config.base_url,
        transport=transport,
        headers=headers,
        timeout=config.timeout_s,
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
    ) as client:
        model = config.model or await first_model(client)
        run = _Run(client, config, model, config.build_workload(), progress)
        results, elapsed = await run.execute()
    progress.close()
    return {"config": config.model_dump(mode="json"), "model": model, **build_report(results, elapsed)}


class _ModelCard(BaseModel):
    id: str


class _ModelList(BaseModel):
    """What a run needs of ``GET /v1/models``; other fields are the server's business."""

    data: list[_ModelCard] = Field(min_length=1)


async def first_model(client: httpx.AsyncClient) -> str:
    """The first model the server lists, for runs without ``--model``."""
    try:
        response = await client.get("/v1/models")
        response.raise_for_status()
        return _ModelList.model_validate_json(response.content).data[0].id
    except httpx.HTTPError as error:
        problem = str(error)
    except ValidationError as error:
        problem = first_problem(error)
    raise RuntimeError(f"could not list models at {client.base_url}/v1/models ({problem}); pass --model")


class _Run:
    def __init__(
        self,
        client: httpx.AsyncClient,
        config: BenchConfig,
        model: str,
        workload: Workload,
        progress: Progress,
    ) -> None:
        self.client = client
        self.config = config
        self.model = model
        self.workload = workload
        self.progress = progress
        self.results: list[RequestResult] = []
        self.rng = random.Random(config.seed)
        self.num_sent = 0
        self.deadline = float("inf")

    async def execute(self) -> tuple[list[RequestResult], float]:
        start = time.monotonic()
        if self.config.duration_s is not None:
            self.deadline = start + self.config.duration_s
        if self.config.request_rate is None:
            await asyncio.gather(*(self._closed_loop() for _ in range(self.config.concurrency or 1)))
        else:
            await self._open_loop(self.config.request_rate)
        return self.results, time.monotonic() - start

    def _take(self) -> bool:
        """Claim the next request, if the run has budget left for one."""
        if self.num_sent == (self.config.num_requests or -1) or time.monotonic() >= self.deadline:
            return False
        self.num_sent += 1
        return True

    async def _closed_loop(self) -> None:
        while self._take():
            await self._one()

    async def _open_loop(self, rate: float) -> None:
        concurrency = self.config.concurrency
        limit: AbstractAsyncContextManager[Any] = (
            asyncio.Semaphore(concurrency) if concurrency else nullcontext()
        )
        tasks: list[asyncio.Task[None]] = []
        while self._take():
            tasks.append(asyncio.create_task(self._limited(limit)))
            if self.num_sent != self.config.num_requests:  # no wait after the last request
                # A long gap is cut at the deadline, so --duration ends a run at a low rate on time.
                gap_s = self.workload.arrival_gap_s(self.rng, rate)
                await asyncio.sleep(min(gap_s, max(self.deadline - time.monotonic(), 0.0)))
        await asyncio.gather(*tasks)

    async def _limited(self, limit: AbstractAsyncContextManager[Any]) -> None:
        async with limit:
            await self._one()

    async def _one(self) -> None:
        spec = self.workload.next_request()
        self.progress.sent()
        result = await send(self.client, spec, self.config, self.model)
        self.workload.complete(spec, result.text if result.is_ok else None)
        self.results.append(result)
        self.progress.update(is_ok=result.is_ok)
