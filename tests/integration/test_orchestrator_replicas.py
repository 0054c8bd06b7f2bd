"""Two orchestrator replicas sharing a real redis-server: same session -> same worker, same KV index."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import httpx
from fastapi import FastAPI
from support.gateway_fakes import MODEL, FakeCluster, FakeWorker, running_gateway, wait_for

from herd.api.crd import KVCacheAwareRouting, StickySessionRouting
from herd.api.protocol import WORKER_HEADER, KVEvent
from herd.orchestrator.app import AppSettings
from herd.orchestrator.kv_index import KVIndex
from herd.orchestrator.registry import RegistrySettings
from herd.orchestrator.state import RedisState

WITHIN_S = 30.0
"""Budget for what goes through a real redis-server: generous for a loaded machine, free when quick."""
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


@contextlib.asynccontextmanager
async def replica(
    cluster: FakeCluster, redis_url: str, routing: object, poll_interval: float
) -> AsyncIterator[tuple[FastAPI, httpx.AsyncClient]]:
    settings = AppSettings(registry=RegistrySettings(poll_interval=poll_interval))
    async with running_gateway(
        cluster, routing=routing, settings=settings, state=RedisState(redis_url)
    ) as pair:  # type: ignore[arg-type]
        yield pair


async def test_replicas_send_a_session_to_the_same_worker(redis_url: str) -> None:
    cluster = FakeCluster([FakeWorker(f"w{n}") for n in range(3)])
    routing = StickySessionRouting(strategy="sticky_session")
    async with (
        replica(cluster, redis_url, routing, 0.05) as (_, first),
        replica(cluster, redis_url, routing, 0.05) as (_, second),
    ):
        await second.post("/v1/chat/completions", json=CHAT)  # the replicas' round-robin positions differ
        chosen = []
        for session in ("alpha", "beta", "gamma"):
            for client in (first, second, first, second):
                response = await client.post(
                    "/v1/chat/completions", json=CHAT, headers={"X-Session-ID": session}
                )
                chosen.append((session, response.headers[WORKER_HEADER]))
    by_session = {session: {worker for s, worker in chosen if s == session} for session, _ in chosen}
    assert all(len(workers) == 1 for workers in by_session.values())


async def test_replicas_hold_the_same_kv_index(redis_url: str) -> None:
    worker = FakeWorker("w0", snapshot_blocks=[11, 12])
    cluster = FakeCluster([worker, FakeWorker("w1")])
    routing = KVCacheAwareRouting(strategy="kv_cache_aware")
    # The second replica polls once, then not for minutes: new events can only reach it through Redis.
    async with (
        replica(cluster, redis_url, routing, 0.05) as (polling, _),
        replica(cluster, redis_url, routing, 600.0) as (listening, _),
    ):
        indexes = [app.state.registry.models[MODEL].kv_index for app in (polling, listening)]
        await wait_for(lambda: all(index.match([11, 12]) == {"w0": 2} for index in indexes), within=WITHIN_S)
        await until_listening(worker, indexes[1])
        worker.events += [
            KVEvent(seq=1, kind="stored", block_hashes=[13]),
            KVEvent(seq=2, kind="removed", block_hashes=[11]),
        ]
        await wait_for(
            lambda: all(index.match([12]) == {"w0": 1} and index.match([11]) == {} for index in indexes),
            within=WITHIN_S,
        )
        assert [index.position("w0") for index in indexes] == [(worker.epoch, 2), (worker.epoch, 2)]


async def until_listening(worker: FakeWorker, index: KVIndex) -> None:
    """Restart ``worker`` (a new epoch, same blocks) until the replica that does not poll sees it.

    The polling replica publishes each restart's snapshot to Redis; the other replica's consumer
    reads the stream from its end once connected, so only what is published after that reaches it.
    A restart it sees proves it is tailing; a fixed wait would guess how long connecting takes.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WITHIN_S
    number = 1
    while loop.time() < deadline:
        number += 1
        worker.epoch = f"e{number}"
        with contextlib.suppress(TimeoutError):
            await wait_for(lambda: index.position("w0") == (worker.epoch, 0), within=0.5)
            return
    raise TimeoutError(f"the listening replica saw no worker restart through Redis within {WITHIN_S:g}s")
