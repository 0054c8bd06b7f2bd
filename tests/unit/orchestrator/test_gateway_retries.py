"""Blast radius: what the gateway retries on another worker, and the circuit breaker that ejects a
worker whose requests keep failing (fake workers behind httpx.MockTransport)."""

from __future__ import annotations

import pytest
from support.gateway_fakes import FakeCluster, FakeWorker, running_gateway, wait_for

from herd.api.protocol import WORKER_HEADER
from herd.orchestrator.app import AppSettings
from herd.orchestrator.breaker import BreakerSettings
from herd.orchestrator.registry import RegistrySettings
from herd.orchestrator.upstream import Upstream

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
BREAKER = BreakerSettings(failures_to_open=2, cooldown_seconds=1.0, max_cooldown_seconds=1.0)
SETTINGS = AppSettings(registry=RegistrySettings(poll_interval=0.02, breaker=BREAKER))


def first_worker_answers(status: int, retry_after: str | None) -> FakeCluster:
    """w0 (round robin's first choice) answers ``status``; w1 serves."""
    return FakeCluster([FakeWorker("w0", status=status, retry_after=retry_after), FakeWorker("w1")])


@pytest.mark.parametrize(
    ("status", "retry_after", "client_status", "num_requests"),
    [
        (500, None, 500, [1, 0]),
        (400, None, 400, [1, 0]),
        (404, None, 404, [1, 0]),
        (502, None, 502, [1, 0]),
        (504, None, 504, [1, 0]),
        (503, None, 503, [1, 0]),
        (429, None, 429, [1, 0]),
        (503, "1", 200, [1, 1]),
        (429, "1", 200, [1, 1]),
    ],
    ids=[
        "500-returned",
        "400-returned",
        "404-returned",
        "502-returned",
        "504-returned",
        "503-without-retry-after-returned",
        "429-without-retry-after-returned",
        "503-with-retry-after-retried",
        "429-with-retry-after-retried",
    ],
)
async def test_only_answers_from_a_worker_that_did_not_take_the_request_are_retried(
    status: int, retry_after: str | None, client_status: int, num_requests: list[int]
) -> None:
    cluster = first_worker_answers(status, retry_after)
    async with running_gateway(cluster, settings=SETTINGS) as (_, client):
        response = await client.post("/v1/chat/completions", json=CHAT)
    assert response.status_code == client_status
    assert [worker.num_requests for worker in cluster.workers] == num_requests
    if client_status >= 400:
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}


async def test_every_worker_draining_is_503_with_retry_after() -> None:
    cluster = FakeCluster([FakeWorker("w0", status=503), FakeWorker("w1", status=503)])
    async with running_gateway(cluster, settings=SETTINGS) as (_, client):
        response = await client.post("/v1/chat/completions", json=CHAT)
    assert (response.status_code, response.headers["retry-after"]) == (503, "1")
    assert [worker.num_requests for worker in cluster.workers] == [1, 1]


async def test_a_worker_error_without_an_envelope_is_wrapped_in_one() -> None:
    cluster = FakeCluster([FakeWorker("w0")])
    async with running_gateway(cluster, settings=SETTINGS) as (app, client):
        app.state.gateway.upstream = _PlainTextErrors()
        response = await client.post("/v1/chat/completions", json=CHAT)
    error = response.json()["error"]
    assert (response.status_code, error["code"], error["type"]) == (502, 502, "server_error")
    assert "w0 answered 502 without an OpenAI error body" in error["message"]


class _PlainTextErrors:
    """An upstream client whose worker answers 502 with an HTML page (a proxy in front of it, say)."""

    async def post(self, url: str, body: bytes, **_: object) -> Upstream:
        return Upstream(502, {"content-type": "text/html"}, b"<html>bad gateway</html>", _Done())

    async def aclose(self) -> None:
        """Nothing to close."""


class _Done:
    async def next_chunk(self) -> bytes:
        return b""

    async def close(self) -> None:
        """Nothing to close."""


async def test_a_failing_worker_is_ejected_by_its_breaker_and_readmitted_by_a_probe() -> None:
    cluster = first_worker_answers(500, None)
    async with running_gateway(cluster, settings=SETTINGS) as (app, client):
        registry = app.state.registry
        served_by = [
            (await client.post("/v1/chat/completions", json=CHAT)).headers.get(WORKER_HEADER)
            for _ in range(6)
        ]
        assert not registry.views("tiny")[0].is_healthy and registry.workers["w0"].is_healthy
        cluster.workers[0].status = 200
        await wait_for(lambda: registry.views("tiny")[0].is_healthy, within=5)  # half-open: one probe
        probe = await client.post("/v1/chat/completions", json=CHAT)
        after = [
            (await client.post("/v1/chat/completions", json=CHAT)).headers[WORKER_HEADER] for _ in range(2)
        ]
    # w0, w1, w0 (its second failure in a row opens the breaker), then w1 only.
    assert served_by == ["w0", "w1", "w0", "w1", "w1", "w1"]
    assert cluster.workers[0].num_requests == 2 + 1 + 1  # two failures, the probe, one after
    assert probe.headers[WORKER_HEADER] == "w0" and sorted(after) == ["w0", "w1"]


async def test_a_request_that_breaks_its_worker_counts_against_that_worker_only() -> None:
    cluster = first_worker_answers(500, None)
    async with running_gateway(cluster, settings=SETTINGS) as (app, client):
        await client.post("/v1/chat/completions", json=CHAT)
        failures = {
            worker_id: state.breaker.num_failures for worker_id, state in app.state.registry.workers.items()
        }
    assert failures == {"w0": 1, "w1": 0}
    assert cluster.workers[1].num_requests == 0


async def test_dashboard_and_metrics_show_the_open_circuit() -> None:
    cluster = first_worker_answers(500, None)
    async with running_gateway(cluster, settings=SETTINGS) as (_, client):
        for _ in range(3):  # w0, w1, w0: two failures in a row on w0
            await client.post("/v1/chat/completions", json=CHAT)
        rows = {row["id"]: row for row in (await client.get("/dashboard/data")).json()["workers"]}
        metrics = (await client.get("/metrics")).text
    assert (rows["w0"]["circuit"], rows["w0"]["state"], rows["w0"]["consecutive_failures"]) == (
        "open",
        "ejected",
        2,
    )
    assert (rows["w1"]["circuit"], rows["w1"]["state"]) == ("closed", "up")
    assert 'herd_router_circuit_state{model="tiny",state="open",worker="w0"} 1.0' in metrics
    assert 'herd_router_circuit_state{model="tiny",state="closed",worker="w0"} 0.0' in metrics
    assert 'herd_router_circuit_state{model="tiny",state="closed",worker="w1"} 1.0' in metrics


async def test_a_worker_back_with_a_new_epoch_counts_a_restart_and_closes_its_circuit() -> None:
    cluster = first_worker_answers(500, None)
    async with running_gateway(cluster, settings=SETTINGS) as (app, client):
        for _ in range(3):
            await client.post("/v1/chat/completions", json=CHAT)
        worker = app.state.registry.workers["w0"]
        await wait_for(lambda: worker.epoch == "e1")
        cluster.workers[0].status, cluster.workers[0].epoch = 200, "e2"  # restarted by its supervisor
        await wait_for(lambda: worker.num_restarts == 1)
        rows = {row["id"]: row for row in (await client.get("/dashboard/data")).json()["workers"]}
        metrics = (await client.get("/metrics")).text
        served_by = {
            (await client.post("/v1/chat/completions", json=CHAT)).headers[WORKER_HEADER] for _ in range(2)
        }
    assert (rows["w0"]["restarts"], rows["w0"]["circuit"], rows["w1"]["restarts"]) == (1, "closed", 0)
    assert 'herd_worker_restarts_total{model="tiny",worker="w0"} 1.0' in metrics
    assert served_by == {"w0", "w1"}
