"""Orchestrator replicas sharing a real redis-server: same session -> same worker, same KV index,
through Redis being stopped and started again and through a replica's restart."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
from fastapi import FastAPI
from support.gateway_fakes import MODEL, FakeCluster, FakeWorker, running_gateway, wait_for
from support.procs import free_port, redis_argv, running

from herd.api.crd import KVCacheAwareRouting, StickySessionRouting
from herd.api.kv_hash import block_hashes
from herd.api.openai import ChatCompletionRequest
from herd.api.protocol import WORKER_HEADER, KVEvent
from herd.orchestrator.app import AppSettings
from herd.orchestrator.kv_index import KVIndex
from herd.orchestrator.registry import Registry, RegistrySettings
from herd.orchestrator.state import RedisState
from herd.orchestrator.tokens import prompt_token_ids

WITHIN_S = 30.0
"""Budget for what goes through a real redis-server: generous for a loaded machine, free when quick."""
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


@contextlib.asynccontextmanager
async def replica(
    cluster: FakeCluster,
    redis_url: str,
    routing: object,
    poll_interval: float,
    model_config: dict[str, object] | None = None,
) -> AsyncIterator[tuple[FastAPI, httpx.AsyncClient]]:
    # A long poll_interval makes a replica that reads its status streams' first lines, then nothing.
    registry = RegistrySettings(
        poll_interval=poll_interval,
        heartbeat=max(poll_interval, 1.0),
        silence_timeout=max(3 * poll_interval, 3.0),
    )
    settings = AppSettings(registry=registry)
    # A live Redis on a loaded two-core runner can take longer than the production 0.5 s to answer;
    # one such timeout switches a replica to its local state and splits sessions the test expects
    # shared. A stopped Redis refuses connections at once, so the outage test is not slowed.
    state = RedisState(redis_url, retry_seconds=0.2, timeout_seconds=5.0)
    async with running_gateway(
        cluster,
        routing=routing,  # type: ignore[arg-type]
        settings=settings,
        state=state,
        model_config=model_config,
    ) as pair:
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
    # The second replica reads its streams' first lines, then nothing for minutes: new events can only
    # reach it through Redis.
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


async def test_replicas_share_the_blocks_a_decision_expects(redis_url: str, tiny_llama: Path) -> None:
    """A prompt routed by one replica is expected on its worker by the other within a stream read,
    long before any worker reports the blocks (the fake workers never do, and the second replica
    reads only its status streams' first lines): the second replica's kv_cache_aware sends the same prompt to the same worker."""
    cluster = FakeCluster(
        [FakeWorker("w0", snapshot_blocks=[11]), *(FakeWorker(f"w{n}") for n in range(1, 4))]
    )
    routing = KVCacheAwareRouting(strategy="kv_cache_aware")
    config = {"model_path": tiny_llama, "max_model_len": 512}
    async with (
        replica(cluster, redis_url, routing, 0.05, config) as (_, first),
        replica(cluster, redis_url, routing, 600.0, config) as (listening, second),
    ):
        served = listening.state.registry.models[MODEL]
        await until_listening(cluster.workers[0], served.kv_index)
        for topic in ("rivers", "stars", "engines"):
            body = {"model": MODEL, "messages": [{"role": "user", "content": f"{topic} " * 60}]}
            ids = prompt_token_ids(
                served.renderer, ChatCompletionRequest.model_validate(body), max_model_len=512
            )
            blocks = block_hashes(ids, served.config.block_size, model_id=MODEL)
            chosen = (await first.post("/v1/chat/completions", json=body)).headers[WORKER_HEADER]
            await wait_for(lambda: served.kv_index.match(blocks) == {chosen: len(blocks)}, within=WITHIN_S)  # noqa: B023
            again = await second.post("/v1/chat/completions", json=body)
            assert again.headers[WORKER_HEADER] == chosen, topic


async def test_replicas_count_each_others_requests_in_flight(redis_url: str) -> None:
    """A request one replica has in flight on a worker counts in the other's views (its cap and its
    load terms) within a stream read, and stops counting once released."""
    cluster = FakeCluster([FakeWorker("w0"), FakeWorker("w1")])
    routing = KVCacheAwareRouting(strategy="kv_cache_aware")
    async with (
        replica(cluster, redis_url, routing, 0.05) as (first, _),
        replica(cluster, redis_url, routing, 0.05) as (second, _),
    ):
        registries = [app.state.registry for app in (first, second)]

        def in_flight(registry: Registry) -> dict[str, int]:
            return {view.id: view.num_in_flight for view in registry.views(MODEL)}

        # The second replica's consumer tails the stream from when it connected: hold until it counts.
        holds = [registries[0].hold("w0") for _ in range(3)]
        await wait_for(lambda: in_flight(registries[1]) == {"w0": 3, "w1": 0}, within=WITHIN_S)
        assert in_flight(registries[0]) == {"w0": 3, "w1": 0}  # its own, not twice
        registries[1].hold("w1")
        await wait_for(lambda: in_flight(registries[0]) == {"w0": 3, "w1": 1}, within=WITHIN_S)
        for hold in holds:
            hold.release("success")
        await wait_for(lambda: in_flight(registries[1]) == {"w0": 0, "w1": 1}, within=WITHIN_S)


async def until_listening(worker: FakeWorker, index: KVIndex) -> None:
    """Restart ``worker`` (a new epoch, same blocks) until the replica that does not follow it sees it.

    The following replica publishes each restart's snapshot to Redis; the other replica's consumer
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


STICKY = StickySessionRouting(strategy="sticky_session")


async def workers_of(client: httpx.AsyncClient, sessions: list[str]) -> dict[str, str]:
    """The worker each session's request went to; every request must be answered."""
    chosen = {}
    for session in sessions:
        response = await client.post("/v1/chat/completions", json=CHAT, headers={"X-Session-ID": session})
        assert response.status_code == 200, response.text
        chosen[session] = response.headers[WORKER_HEADER]
    return chosen


def is_degraded(app: FastAPI) -> bool:
    return bool(app.state.registry.state.is_degraded)


async def test_routing_goes_on_while_redis_is_stopped_and_pins_are_shared_after(tmp_path: Path) -> None:
    port = free_port()
    redis_url = f"redis://127.0.0.1:{port}/0"
    cluster = FakeCluster([FakeWorker(f"w{n}") for n in range(3)])
    sessions = [f"s{n}" for n in range(6)]
    with contextlib.ExitStack() as redis:
        redis.enter_context(running(redis_argv(port, tmp_path), log=tmp_path / "redis1.log"))
        async with (
            replica(cluster, redis_url, STICKY, 0.05) as (first_app, first),
            replica(cluster, redis_url, STICKY, 0.05) as (second_app, second),
        ):
            pinned = await workers_of(first, sessions)
            load = asyncio.create_task(steady_load([first, second], [first_app, second_app], sessions))
            await asyncio.sleep(0.2)
            await asyncio.to_thread(redis.close)  # stopped by its pid while requests flow
            await wait_for(lambda: is_degraded(first_app) and is_degraded(second_app), within=WITHIN_S)
            await asyncio.sleep(0.3)  # requests keep flowing on local state
            answered_during_outage = await load
            assert answered_during_outage and set(answered_during_outage) == {200}
            # Each replica kept the pins it had mirrored: the first one's sessions did not move.
            assert await workers_of(first, sessions) == pinned
            with running(redis_argv(port, tmp_path), log=tmp_path / "redis2.log"):
                await wait_for(
                    lambda: not (is_degraded(first_app) or is_degraded(second_app)), within=WITHIN_S
                )
                # The restarted Redis began empty: the replicas wrote their pins back, first writer won.
                shared = await workers_of(second, sessions)
                assert await workers_of(first, sessions) == shared
                fresh = await workers_of(first, ["after-recovery"])
                assert await workers_of(second, ["after-recovery"]) == fresh


async def steady_load(
    clients: list[httpx.AsyncClient], apps: list[FastAPI], sessions: list[str]
) -> list[int]:
    """Sessioned requests through both replicas until Redis is seen gone and then some; the statuses."""
    statuses = []
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WITHIN_S
    outage_seen_at: float | None = None
    while loop.time() < deadline and (outage_seen_at is None or loop.time() < outage_seen_at + 0.5):
        for client in clients:
            for session in sessions:
                headers = {"X-Session-ID": session}
                response = await client.post("/v1/chat/completions", json=CHAT, headers=headers)
                statuses.append(response.status_code)
        if outage_seen_at is None and all(is_degraded(app) for app in apps):
            outage_seen_at = loop.time()
    return statuses


async def test_a_restarted_replica_sends_a_pinned_session_to_the_same_worker(redis_url: str) -> None:
    cluster = FakeCluster([FakeWorker(f"w{n}") for n in range(3)])
    sessions = [f"restart-{n}" for n in range(6)]
    async with replica(cluster, redis_url, STICKY, 0.05) as (_, first):
        await first.post("/v1/chat/completions", json=CHAT)  # a fresh replica's round robin starts elsewhere
        pinned = await workers_of(first, sessions)
        assert len(set(pinned.values())) > 1  # spread over the workers: a match below is not luck
        async with replica(cluster, redis_url, STICKY, 0.05) as (_, second):
            assert await workers_of(second, sessions) == pinned
        async with replica(cluster, redis_url, STICKY, 0.05) as (_, restarted):
            assert await workers_of(restarted, sessions) == pinned
