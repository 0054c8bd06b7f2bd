"""The soak (issue 12, item 9): thousands of requests at concurrency 64 through real gateways to two
real tiny-model workers.

Two orchestrators front the same two workers. The wide one's in-flight cap (``maxBatchSize +
maxQueueLen`` per worker) is above the load: every one of 1,000 warm-up and 5,000 measured requests,
half of them streamed, must succeed, and the gateway's RSS may grow by less than 10 % over the
measured part. The narrow one's cap is 8 per worker and 8 more may wait in its queue: at the same
concurrency it must answer 200 or 429 with ``Retry-After`` in the OpenAI envelope, and nothing else. At the end every worker's free KV
blocks are back to their starting count. The figures are printed (run with ``-s``) for
docs/reliability.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from support.gateway_fakes import sse_events
from support.live_cluster import (
    LiveGateway,
    WorkerPorts,
    chat_body,
    error_envelope,
    live_orchestrator,
    live_worker,
    rss_kib,
    write_manifest,
)
from support.procs import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]

CONCURRENCY = 64
NUM_WARM_UP = 1000
NUM_MEASURED = 5000
NUM_OVER_CAPACITY = 1000
WORKER_FLAGS = {"max_model_len": "256", "max_batch_size": "32", "max_queue_len": "64"}
WIDE = {"maxModelLen": 256, "maxBatchSize": 32, "maxQueueLen": 64}
"""The gateway admits 96 per worker: more than the 64 in flight."""
NARROW = {"maxModelLen": 256, "maxBatchSize": 4, "maxQueueLen": 4}
NARROW_QUEUE = ("--queue-max-size", "8", "--queue-max-wait", "5")  # the gateway's own wait line
"""The gateway admits 8 per worker: 16 of the 64 in flight."""


@dataclass
class Tally:
    statuses: Counter[int] = field(default_factory=Counter)
    problems: Counter[str] = field(default_factory=Counter)
    latencies: list[float] = field(default_factory=list)

    def add(self, status: int, problem: str | None, seconds: float) -> None:
        self.statuses[status] += 1
        self.latencies.append(seconds)
        if problem is not None:
            self.problems[problem] += 1

    def percentile_ms(self, fraction: float) -> float:
        ordered = sorted(self.latencies)
        return round(1000 * ordered[min(len(ordered) - 1, int(fraction * len(ordered)))], 1)


def judge_stream(text: str) -> str | None:
    """A streamed answer must end with ``[DONE]`` and carry no error event."""
    payloads = list(sse_events(text.encode()))
    if not payloads or payloads[-1] != "[DONE]":
        return f"stream did not end with [DONE]: {text[-300:]!r}"
    if any("error" in json.loads(payload) for payload in payloads[:-1]):
        return f"stream carried an error event: {text[-300:]!r}"
    return None


def judge_refusal(response: httpx.Response) -> str | None:
    """A 429 must say when to come back and be in the OpenAI envelope."""
    if "retry-after" not in response.headers:
        return "429 without Retry-After"
    try:
        error_envelope(response)
    except AssertionError as error:
        return f"429 outside the OpenAI envelope: {error}"
    return None


async def one_request(client: httpx.AsyncClient, number: int, tally: Tally) -> None:
    """Short prompts (50 distinct ones), 4 output tokens, every other one streamed; a connection that
    fails counts as status 0."""
    is_stream = number % 2 == 0
    body = chat_body(f"question {number % 50}: what is the capital of France?", max_tokens=4,
                     ignore_eos=True, stream=is_stream)  # fmt: skip
    started = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            text = (await response.aread()).decode()
    except httpx.TransportError as error:  # counted, not raised: one must not hide the rest
        tally.add(0, f"{type(error).__name__} ({'stream' if is_stream else 'whole'}): {error}", 0.0)
        return
    problem = None
    if response.status_code == 200 and is_stream:
        problem = judge_stream(text)
    elif response.status_code == 429:
        problem = judge_refusal(response)
    elif response.status_code != 200:
        problem = f"status {response.status_code}: {text[:300]}"
    tally.add(response.status_code, problem, time.perf_counter() - started)


async def load(url: str, num_requests: int) -> Tally:
    """``num_requests`` requests, ``CONCURRENCY`` at a time, each sender taking the next number."""
    tally, numbers = Tally(), iter(range(num_requests))
    limits = httpx.Limits(max_connections=CONCURRENCY, max_keepalive_connections=CONCURRENCY)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:

        async def sender() -> None:
            for number in numbers:
                await one_request(client, number, tally)

        await asyncio.gather(*(sender() for _ in range(CONCURRENCY)))
    return tally


@dataclass(frozen=True)
class Soak:
    workers: list[WorkerPorts]
    wide: LiveGateway
    narrow: LiveGateway


@pytest.fixture(scope="module")
def soak(tmp_path_factory: pytest.TempPathFactory, tiny_llama: Path) -> Iterator[Soak]:
    tmp_path = tmp_path_factory.mktemp("soak")
    workers = [WorkerPorts.fresh(), WorkerPorts.fresh()]
    with contextlib.ExitStack() as stack:
        for number, worker in enumerate(workers):
            stack.enter_context(
                live_worker(tiny_llama, worker, log=tmp_path / f"worker{number}.log", **WORKER_FLAGS)
            )
        gateways = []
        for name, engine in (("wide", WIDE), ("narrow", NARROW)):
            folder = tmp_path / name
            folder.mkdir()
            manifest = write_manifest(folder, tiny_llama, engine=engine, routing="least_request")
            log = folder / "orchestrator.log"
            args = NARROW_QUEUE if name == "narrow" else ()
            gateways.append(stack.enter_context(live_orchestrator(manifest, workers, log=log, args=args)))
        for gateway in gateways:
            gateway.wait_all_healthy(len(workers))
        yield Soak(workers, *gateways)


def report(name: str, tally: Tally, seconds: float) -> None:
    rate = round(sum(tally.statuses.values()) / seconds, 1)
    print(f"soak {name}: statuses {dict(tally.statuses)} in {seconds:.1f}s ({rate}/s), "
          f"latency p50 {tally.percentile_ms(0.5)} ms p99 {tally.percentile_ms(0.99)} ms")  # fmt: skip


def test_below_capacity_every_request_succeeds_and_the_gateway_does_not_grow(soak: Soak) -> None:
    free_at_start = [worker.num_free_blocks() for worker in soak.workers]
    warm_up = asyncio.run(load(soak.wide.url, NUM_WARM_UP))
    assert warm_up.statuses == {200: NUM_WARM_UP}, (warm_up.statuses, warm_up.problems.most_common(5))
    rss_before = rss_kib(soak.wide.process.pid)
    started = time.perf_counter()
    measured = asyncio.run(load(soak.wide.url, NUM_MEASURED))
    report("below capacity", measured, time.perf_counter() - started)
    rss_after = rss_kib(soak.wide.process.pid)
    print(f"soak gateway RSS: {rss_before} KiB after warm-up, {rss_after} KiB at the end "
          f"({100 * (rss_after - rss_before) / rss_before:+.1f} %)")  # fmt: skip
    assert measured.statuses == {200: NUM_MEASURED}, (measured.statuses, measured.problems.most_common(5))
    assert not measured.problems, measured.problems.most_common(5)
    assert rss_after < 1.10 * rss_before
    assert_blocks_back(soak.workers, free_at_start)


def test_above_capacity_the_gateway_answers_429_with_retry_after_and_nothing_else(soak: Soak) -> None:
    free_at_start = [worker.num_free_blocks() for worker in soak.workers]
    started = time.perf_counter()
    tally = asyncio.run(load(soak.narrow.url, NUM_OVER_CAPACITY))
    report("above capacity", tally, time.perf_counter() - started)
    assert set(tally.statuses) <= {200, 429}, (tally.statuses, tally.problems.most_common(5))
    assert tally.statuses[429] > 0 and tally.statuses[200] > 0, tally.statuses
    assert not tally.problems, tally.problems.most_common(5)
    assert_blocks_back(soak.workers, free_at_start)


def assert_blocks_back(workers: list[WorkerPorts], free_at_start: list[int]) -> None:
    def all_back() -> bool:
        return [worker.num_free_blocks() for worker in workers] == free_at_start

    wait_until(all_back, timeout=30, what=f"every worker's free KV blocks back to {free_at_start}")
