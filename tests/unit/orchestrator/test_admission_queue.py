"""Requests wait in the gateway while every worker is full: priority, fair share, bounds, leaving."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable

import httpx
import pytest
from support.gateway_fakes import FAST_REGISTRY, MODEL, FakeCluster, FakeWorker, running_gateway, wait_for

from herd.orchestrator.admission.tenants import Tenant
from herd.orchestrator.admission.waiting import QueueSettings
from herd.orchestrator.app import AppSettings
from herd.orchestrator.auth import ApiKeys
from herd.orchestrator.gateway import GatewaySettings

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
ONE_AT_A_TIME = {"max_in_flight_per_worker": 1}
KEYS = ApiKeys.of_tenants(
    [("k-heavy", Tenant(name="heavy")), ("k-light", Tenant(name="light")), ("k-vip", Tenant(name="vip"))]
)


def settings(max_size: int = 64, max_wait: float = 30.0) -> AppSettings:
    queue = QueueSettings(max_size=max_size, max_wait_seconds=max_wait)
    return AppSettings(registry=FAST_REGISTRY, gateway=GatewaySettings(queue=queue))


def slow_worker(delay: float = 0.2) -> FakeCluster:
    worker = FakeWorker("w0", chunk_delay=delay)
    return FakeCluster([worker])


def chat(
    client: httpx.AsyncClient, name: str, *, key: str = "k-heavy", priority: int = 0
) -> Awaitable[httpx.Response]:
    body = {**CHAT, "stream": True, "user": name, "priority": priority}
    return client.post("/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"})


def served_order(worker: FakeWorker) -> list[str]:
    return [str(body["user"]) for body in worker.bodies]


async def start(
    client: httpx.AsyncClient, cluster: FakeCluster, name: str, **kwargs: object
) -> asyncio.Task[httpx.Response]:
    """Send a request and wait until the gateway has it (the worker, or the queue, holds it)."""
    task = asyncio.create_task(chat(client, name, **kwargs))  # type: ignore[arg-type]
    await asyncio.sleep(0.02)
    return task


async def test_a_request_waits_for_a_full_worker_and_is_served_after() -> None:
    cluster = slow_worker()
    async with running_gateway(cluster, settings=settings(), model_config=ONE_AT_A_TIME, api_keys=KEYS) as (
        app,
        client,
    ):
        first = await start(client, cluster, "first")
        second = await start(client, cluster, "second")
        assert app.state.gateway.admission.num_waiting(MODEL) == 1
        responses = await asyncio.gather(first, second)
    assert [response.status_code for response in responses] == [200, 200]
    assert served_order(cluster.workers[0]) == ["first", "second"]


async def test_waiting_past_the_limit_is_429_with_retry_after() -> None:
    cluster = slow_worker(delay=0.5)
    async with running_gateway(
        cluster, settings=settings(max_wait=0.1), model_config=ONE_AT_A_TIME, api_keys=KEYS
    ) as (_, client):
        first = await start(client, cluster, "first")
        second = await chat(client, "second")
        await first
    assert second.status_code == 429 and second.headers["retry-after"] == "1"
    assert "longest time" in second.json()["error"]["message"]
    assert served_order(cluster.workers[0]) == ["first"]


async def test_the_more_urgent_request_goes_first() -> None:
    cluster = slow_worker()
    async with running_gateway(cluster, settings=settings(), model_config=ONE_AT_A_TIME, api_keys=KEYS) as (
        _,
        client,
    ):
        tasks = [await start(client, cluster, "busy")]
        tasks.append(await start(client, cluster, "low", priority=3))
        tasks.append(await start(client, cluster, "high", priority=0))
        responses = await asyncio.gather(*tasks)
    assert all(response.status_code == 200 for response in responses)
    assert served_order(cluster.workers[0]) == ["busy", "high", "low"]


@pytest.mark.parametrize(
    ("newcomer", "refused", "served"),
    [(0, "waiting", ["busy", "newcomer"]), (3, "newcomer", ["busy", "waiting"])],
    ids=["more-urgent-sheds", "as-urgent-is-refused"],
)
async def test_a_full_queue_sheds_the_least_urgent(newcomer: int, refused: str, served: list[str]) -> None:
    cluster = slow_worker()
    async with running_gateway(
        cluster, settings=settings(max_size=1), model_config=ONE_AT_A_TIME, api_keys=KEYS
    ) as (_, client):
        names = ["busy", "waiting", "newcomer"]
        tasks = [await start(client, cluster, "busy"), await start(client, cluster, "waiting", priority=3)]
        tasks.append(await start(client, cluster, "newcomer", priority=newcomer))
        responses = dict(zip(names, await asyncio.gather(*tasks), strict=True))
    assert responses[refused].status_code == 429 and "retry-after" in responses[refused].headers
    assert all(responses[name].status_code == 200 for name in served)
    assert served_order(cluster.workers[0]) == served


async def test_a_light_tenant_is_not_starved_by_a_heavy_one() -> None:
    cluster = slow_worker(delay=0.05)
    async with running_gateway(cluster, settings=settings(), model_config=ONE_AT_A_TIME, api_keys=KEYS) as (
        _,
        client,
    ):
        tasks = [await start(client, cluster, "h0")]
        tasks += [await start(client, cluster, f"h{i}") for i in range(1, 7)]
        tasks += [await start(client, cluster, f"l{i}", key="k-light") for i in range(2)]
        responses = await asyncio.gather(*tasks)
    assert all(response.status_code == 200 for response in responses)
    order = served_order(cluster.workers[0])
    assert order.index("l0") <= 3 and order.index("l1") <= 5, order


async def test_a_client_that_leaves_while_waiting_leaves_the_queue() -> None:
    cluster = slow_worker(delay=0.3)
    async with running_gateway(cluster, settings=settings(), model_config=ONE_AT_A_TIME, api_keys=KEYS) as (
        app,
        client,
    ):
        first = await start(client, cluster, "first")
        leaving = await start(client, cluster, "leaving")
        third = await start(client, cluster, "third")
        leaving.cancel()
        await wait_for(lambda: app.state.gateway.admission.num_waiting(MODEL) == 1)
        responses = await asyncio.gather(first, third)
    assert [response.status_code for response in responses] == [200, 200]
    assert served_order(cluster.workers[0]) == ["first", "third"]


async def test_batch_lines_leave_a_reserved_slot_that_an_urgent_request_takes_at_once() -> None:
    """A worker of 4 slots: background requests (priority 1000) hold at most 3 (the default reserve,
    a quarter); the 4th waits, and an urgent newcomer routes at once past it to the reserved slot."""
    cluster = slow_worker(delay=0.3)
    async with running_gateway(
        cluster, settings=settings(), model_config={"max_in_flight_per_worker": 4}, api_keys=KEYS
    ) as (app, client):
        tasks = [await start(client, cluster, f"b{i}", priority=1000) for i in range(4)]
        assert app.state.gateway.admission.num_waiting(MODEL) == 1
        tasks.append(await start(client, cluster, "urgent"))
        assert served_order(cluster.workers[0]) == ["b0", "b1", "b2", "urgent"]
        assert app.state.gateway.admission.num_waiting(MODEL) == 1
        responses = await asyncio.gather(*tasks)
    assert all(response.status_code == 200 for response in responses)
    assert served_order(cluster.workers[0])[-1] == "b3"
