"""The gateway over fake workers (httpx.MockTransport): errors, auth, limits, headers, retries, streams."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator

import httpx
import pytest
from support.gateway_fakes import (
    FAST_REGISTRY,
    MODEL,
    FakeCluster,
    FakeWorker,
    running_gateway,
    sse_events,
    wait_for,
)

from herd.api.crd import StickySessionRouting
from herd.api.metrics import ORCHESTRATOR_METRICS
from herd.api.protocol import WORKER_HEADER
from herd.orchestrator.admission.waiting import QueueSettings
from herd.orchestrator.app import AppSettings, build_app
from herd.orchestrator.auth import ApiKeys
from herd.orchestrator.discovery import Membership
from herd.orchestrator.gateway import GatewaySettings

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


def cluster_of(num_workers: int) -> FakeCluster:
    return FakeCluster([FakeWorker(f"w{n}") for n in range(num_workers)])


async def test_unknown_model_is_404_in_openai_envelope() -> None:
    async with running_gateway(cluster_of(1)) as (_, client):
        response = await client.post("/v1/chat/completions", json={**CHAT, "model": "nope"})
    assert response.status_code == 404
    error = response.json()["error"]
    assert error["type"] == "not_found_error" and "nope" in error["message"] and error["code"] == 404


@pytest.mark.parametrize(
    ("authorization", "status"),
    [(None, 401), ("Bearer wrong", 401), ("Basic k1", 401), ("Bearer k1", 200), ("Bearer k2", 200)],
    ids=["missing", "wrong-key", "wrong-scheme", "first-key", "second-key"],
)
async def test_api_keys(authorization: str | None, status: int) -> None:
    headers = {"authorization": authorization} if authorization else {}
    async with running_gateway(cluster_of(1), api_keys=ApiKeys(["k1", "k2"])) as (_, client):
        response = await client.post("/v1/chat/completions", json=CHAT, headers=headers)
        models = await client.get("/v1/models", headers=headers)
    assert (response.status_code, models.status_code) == (status, status)
    if status == 401:
        assert response.json()["error"]["type"] == "authentication_error"


async def test_body_over_the_limit_is_413() -> None:
    settings = AppSettings(registry=FAST_REGISTRY, max_body_bytes=1000)
    async with running_gateway(cluster_of(1), settings=settings) as (_, client):
        small = await client.post("/v1/chat/completions", json=CHAT)
        large = await client.post("/v1/chat/completions", json={**CHAT, "pad": "x" * 2000})
    assert (small.status_code, large.status_code) == (200, 413)
    assert large.json()["error"]["code"] == 413


async def test_every_worker_busy_is_429_with_retry_after() -> None:
    cluster = cluster_of(2)
    for worker in cluster.workers:
        worker.status = 429
    async with running_gateway(cluster) as (_, client):
        response = await client.post("/v1/chat/completions", json=CHAT)
    assert response.status_code == 429
    assert response.headers["retry-after"] == "1"
    assert [worker.num_requests for worker in cluster.workers] == [1, 1]


async def test_in_flight_limit_reached_is_429_without_calling_a_worker() -> None:
    """The request waits in the gateway's queue (test_admission_queue.py), then gets 429."""
    cluster = cluster_of(1)
    cluster.workers[0].chunk_delay = 0.5
    queue = QueueSettings(max_wait_seconds=0.1)
    settings = AppSettings(registry=FAST_REGISTRY, gateway=GatewaySettings(queue=queue))
    async with running_gateway(cluster, settings=settings) as (app, client):
        app.state.registry.models[MODEL].config = app.state.registry.models[MODEL].config.__class__(
            MODEL, app.state.registry.models[MODEL].config.routing, max_in_flight_per_worker=1
        )
        first = asyncio.create_task(client.post("/v1/chat/completions", json={**CHAT, "stream": True}))
        await wait_for(lambda: cluster.workers[0].num_requests == 1)
        second = await client.post("/v1/chat/completions", json=CHAT)
        await first
    assert second.status_code == 429 and "retry-after" in second.headers


async def test_response_names_the_worker_and_round_robin_spreads() -> None:
    cluster = cluster_of(2)
    async with running_gateway(cluster) as (_, client):
        responses = [await client.post("/v1/chat/completions", json=CHAT) for _ in range(4)]
        models = await client.get("/v1/models")
    chosen = [response.headers[WORKER_HEADER] for response in responses]
    assert sorted(chosen) == ["w0", "w0", "w1", "w1"]
    assert all(response.json()["worker"] == name for response, name in zip(responses, chosen, strict=True))
    assert models.json()["data"][0]["id"] == MODEL and models.json()["data"][0]["max_model_len"] == 4096


async def test_retry_on_another_worker_when_the_first_is_down() -> None:
    cluster = cluster_of(2)
    async with running_gateway(cluster) as (app, client):
        cluster.workers[0].is_up = False
        responses = [
            await client.post("/v1/chat/completions", json={**CHAT, "stream": True}) for _ in range(3)
        ]
        metrics = (await client.get("/metrics")).text
    assert [response.status_code for response in responses] == [200, 200, 200]
    assert {response.headers[WORKER_HEADER] for response in responses} == {"w1"}
    assert not app.state.registry.workers["w0"].is_healthy
    assert "herd_router_retries_total" in metrics


async def test_failure_after_the_answer_began_is_not_retried() -> None:
    """The head came back before the body failed: the worker had the request (issue 12 changed this
    from a retry to a 502 for the client)."""
    cluster = cluster_of(2)
    cluster.workers[0].fail_after_chunks = 0
    async with running_gateway(cluster) as (_, client):
        response = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert response.status_code == 502 and response.json()["error"]["code"] == 502
    assert [worker.num_requests for worker in cluster.workers] == [1, 0]


async def test_a_connection_dropped_before_any_answer_is_retried_elsewhere(
    caplog: pytest.LogCaptureFixture,
) -> None:
    cluster = cluster_of(2)
    cluster.workers[0].is_dropping = True
    async with running_gateway(cluster) as (_, client):
        with caplog.at_level(logging.WARNING, logger="herd.orchestrator.registry"):
            response = await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert response.status_code == 200 and response.headers[WORKER_HEADER] == "w1"
    assert "content-length" not in response.headers
    assert list(sse_events(response.content))[-1] == "[DONE]"
    # Ejected at once (its poller, which still finds /ready fine, re-admits it right after).
    assert [record.worker for record in caplog.records if record.message == "worker ejected"] == ["w0"]  # type: ignore[attr-defined]


async def test_mid_stream_failure_ends_with_an_error_event() -> None:
    cluster = cluster_of(1)
    cluster.workers[0].fail_after_chunks = 2
    async with running_gateway(cluster) as (_, client):
        response = await asyncio.wait_for(
            client.post("/v1/chat/completions", json={**CHAT, "stream": True}), 5
        )
    events = list(sse_events(response.content))
    assert response.status_code == 200
    assert [json.loads(event)["n"] for event in events[:2]] == [0, 1]
    assert json.loads(events[-1])["error"]["code"] == 502
    assert cluster.workers[0].num_streams_closed == 1


async def test_client_disconnect_closes_the_upstream_stream() -> None:
    cluster = cluster_of(1)
    cluster.workers[0].num_chunks, cluster.workers[0].chunk_delay = 1000, 0.01
    async with running_gateway(cluster) as (app, _):
        disconnected = asyncio.Event()
        sent: list[dict[str, object]] = []
        body = json.dumps({**CHAT, "stream": True}).encode()
        messages = iter([{"type": "http.request", "body": body, "more_body": False}])

        async def receive() -> dict[str, object]:
            message = next(messages, None)
            if message is None:
                await disconnected.wait()
                return {"type": "http.disconnect"}
            return message

        async def send(message: dict[str, object]) -> None:
            sent.append(message)
            if message["type"] == "http.response.body" and len(sent) >= 3:
                disconnected.set()

        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "POST",
            "path": "/v1/chat/completions",
            "raw_path": b"/v1/chat/completions",
            "query_string": b"",
            "headers": [(b"content-type", b"application/json")],
            "scheme": "http",
            "server": ("o", 80),
            "client": ("c", 1),
            "root_path": "",
        }
        await asyncio.wait_for(app(scope, receive, send), 5)
        worker_state = app.state.registry.workers["w0"]
    assert cluster.workers[0].num_streams_closed == 1
    assert len(sent) < 100
    assert worker_state.num_in_flight == 0


async def test_sticky_sessions_stay_on_one_worker() -> None:
    cluster = cluster_of(3)
    routing = StickySessionRouting(strategy="sticky_session")
    async with running_gateway(cluster, routing=routing) as (_, client):
        chosen = {
            session: {
                (
                    await client.post("/v1/chat/completions", json=CHAT, headers={"X-Session-ID": session})
                ).headers[WORKER_HEADER]
                for _ in range(4)
            }
            for session in ("a", "b", "c")
        }
    assert all(len(workers) == 1 for workers in chosen.values())
    assert len(set.union(*chosen.values())) == 3


async def test_health_ready_and_dashboard() -> None:
    cluster = cluster_of(2)
    async with running_gateway(cluster) as (_, client):
        await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
        page = await client.get("/dashboard")
        data = (await client.get("/dashboard/data")).json()
        ready = await client.get("/ready")
        health = await client.get("/health")
    assert (ready.status_code, health.status_code) == (200, 200)
    assert "<script>" in page.text and "http" not in page.text.split("<script>")[1].split("fetch(")[0]
    assert {row["id"] for row in data["workers"]} == {"w0", "w1"}
    assert data["request_rate_per_s"] > 0 and data["ttft_p50_ms"] is not None


READINESS = {
    "fixed-workers-admitted": (False, True, 200),
    "fixed-model-without-workers": (False, False, 503),
    "discovered-workers-admitted": (True, True, 200),
    "discovered-model-without-workers": (True, False, 200),
}


@pytest.mark.parametrize(("ready_when_synced", "is_up", "status"), READINESS.values(), ids=READINESS.keys())
async def test_ready_waits_for_every_model_or_only_for_the_discovery(
    ready_when_synced: bool, is_up: bool, status: int
) -> None:
    cluster = FakeCluster([FakeWorker("w0", is_up=is_up)])
    settings = AppSettings(registry=FAST_REGISTRY, ready_when_synced=ready_when_synced)
    async with running_gateway(cluster, settings=settings) as (_, client):
        ready = await client.get("/ready")
    assert ready.status_code == status
    assert ready.json()["models_without_workers"] == ([] if is_up else [MODEL])


class _SilentSource:
    """A discovery that never syncs."""

    async def watch(self) -> AsyncIterator[Membership]:
        await asyncio.Event().wait()
        yield Membership(models=(), endpoints=())


async def test_not_ready_before_the_discovery_syncs() -> None:
    app = build_app(_SilentSource(), settings=AppSettings(ready_when_synced=True))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app)
        async with httpx.AsyncClient(transport=transport, base_url="http://orchestrator") as client:
            ready = await client.get("/ready")
    assert ready.status_code == 503 and ready.json()["reason"] == "discovery has not synced"


async def test_metrics_expose_every_orchestrator_metric() -> None:
    async with running_gateway(cluster_of(1)) as (_, client):
        await client.post("/v1/chat/completions", json={**CHAT, "stream": True})
        text = (await client.get("/metrics")).text
    missing = [
        name
        for name in ORCHESTRATOR_METRICS
        if f"# TYPE {name}" not in text and f"# HELP {name} " not in text
    ]
    assert not missing
    assert 'herd_router_requests_total{model="tiny",status="200",worker="w0"} 1.0' in text
