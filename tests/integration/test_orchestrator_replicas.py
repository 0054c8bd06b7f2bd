"""Two orchestrator replicas sharing a real redis-server: same session -> same worker, same KV index."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import httpx
from fastapi import FastAPI
from support.gateway_fakes import MODEL, FakeCluster, FakeWorker, running_gateway, wait_for

from herd.api.crd import KVCacheAwareRouting, StickySessionRouting
from herd.api.protocol import WORKER_HEADER, KVEvent
from herd.orchestrator.app import AppSettings
from herd.orchestrator.registry import RegistrySettings
from herd.orchestrator.state import RedisState

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
        await wait_for(lambda: all(index.match([11, 12]) == {"w0": 2} for index in indexes))
        worker.events += [
            KVEvent(seq=1, kind="stored", block_hashes=[13]),
            KVEvent(seq=2, kind="removed", block_hashes=[11]),
        ]
        await wait_for(
            lambda: all(index.match([12]) == {"w0": 1} and index.match([11]) == {} for index in indexes)
        )
        assert [index.position("w0") for index in indexes] == [("e1", 2), ("e1", 2)]
