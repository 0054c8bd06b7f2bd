"""Requests for a model at zero workers are held until one is ready (scale from zero), in herd's
gateway and in the endpoint picker, over fake workers: the count held is the demand signal on
``/metrics``, the line is bounded in size and time (503 with Retry-After), and a model that does not
scale to zero is refused at once as before."""

from __future__ import annotations

import asyncio
import time

import pytest
from support.epp_fakes import chat_body, running_epp
from support.gateway_fakes import FAST_REGISTRY, MODEL, FakeCluster, FakeWorker, running_gateway, wait_for

from herd.api.crd import ModelDeployment
from herd.api.demand import ModelDemand, parse_demand
from herd.orchestrator.app import AppSettings
from herd.orchestrator.cold_start import ColdStartSettings
from herd.orchestrator.discovery import ModelConfig
from herd.orchestrator.gateway import GatewaySettings

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
SCALES_TO_ZERO = {"cold_start_timeout_s": 30.0}


def down_cluster() -> FakeCluster:
    """One worker, not started yet (a pool at zero replicas that is starting one)."""
    return FakeCluster([FakeWorker("w0", is_up=False)])


@pytest.mark.parametrize(
    ("autoscaling", "timeout_s"),
    [
        ({"enabled": True, "minReplicas": 0}, 120.0),
        ({"enabled": True, "minReplicas": 0, "coldStartTimeoutSeconds": 45}, 45.0),
        ({"enabled": True, "minReplicas": 1}, 0.0),
        ({"enabled": False, "minReplicas": 0}, 0.0),
    ],
    ids=["zero-default", "zero-45s", "min-1", "autoscaling-off"],
)
def test_only_a_model_that_scales_to_zero_holds_its_requests(
    autoscaling: dict[str, object], timeout_s: float
) -> None:
    md = ModelDeployment.model_validate(
        {
            "apiVersion": "herd.dev/v1alpha1",
            "kind": "ModelDeployment",
            "metadata": {"name": "m"},
            "spec": {"model": {"source": "pvc://w/m"}, "autoscaling": autoscaling},
        }
    )
    assert ModelConfig.from_deployment(md).cold_start_timeout_s == timeout_s


async def test_a_held_request_is_counted_and_served_once_a_worker_is_ready() -> None:
    cluster = down_cluster()
    async with running_gateway(cluster, model_config=SCALES_TO_ZERO) as (_, client):
        request = asyncio.create_task(client.post("/v1/chat/completions", json=CHAT))

        async def held() -> float:
            return parse_demand((await client.get("/metrics")).text).get(MODEL, ModelDemand()).num_held

        deadline = time.monotonic() + 10
        while await held() != 1:
            assert time.monotonic() < deadline, "the request was not held"
            await asyncio.sleep(0.02)
        assert not request.done()
        cluster.workers[0].is_up = True  # the pool's first worker answers /ready
        response = await asyncio.wait_for(request, 10)
        assert response.status_code == 200 and response.headers["x-herd-worker"] == "w0"
        assert await held() == 0


async def test_a_wait_that_runs_out_is_a_503_saying_the_model_is_starting() -> None:
    async with running_gateway(down_cluster(), model_config={"cold_start_timeout_s": 0.3}) as (_, client):
        began = time.monotonic()
        response = await client.post("/v1/chat/completions", json=CHAT)
    assert time.monotonic() - began >= 0.3
    assert response.status_code == 503 and response.headers["retry-after"] == "10"
    message = response.json()["error"]["message"]
    assert "is starting (it scaled to zero)" in message and "no worker became ready in time" in message


async def test_a_full_line_answers_503_at_once() -> None:
    gateway = GatewaySettings(cold_start=ColdStartSettings(max_held=1, retry_after_seconds=7))
    settings = AppSettings(registry=FAST_REGISTRY, gateway=gateway)
    async with running_gateway(down_cluster(), settings=settings, model_config=SCALES_TO_ZERO) as (
        app,
        client,
    ):
        first = asyncio.create_task(client.post("/v1/chat/completions", json=CHAT))
        await wait_for(lambda: app.state.gateway.cold_starts.num_held(MODEL) == 1)
        second = await client.post("/v1/chat/completions", json=CHAT)
        assert second.status_code == 503 and second.headers["retry-after"] == "7"
        assert "1 requests already wait for it" in second.json()["error"]["message"]
        first.cancel()


async def test_a_model_that_does_not_scale_to_zero_is_refused_at_once() -> None:
    async with running_gateway(down_cluster()) as (_, client):
        began = time.monotonic()
        response = await client.post("/v1/chat/completions", json=CHAT)
    assert response.status_code == 503 and time.monotonic() - began < 5
    assert "has no healthy worker right now" in response.json()["error"]["message"]


async def test_the_endpoint_picker_holds_the_same_way() -> None:
    cluster = down_cluster()
    async with running_epp(cluster, model_config=SCALES_TO_ZERO) as epp:
        stream = epp.stream()
        answers = asyncio.create_task(stream.request(chat_body()))
        cold_starts = epp.epp.picker.cold_starts
        await wait_for(lambda: cold_starts.num_held(MODEL) == 1)
        cluster.workers[0].is_up = True
        chosen = (await asyncio.wait_for(answers, 10))[-1]
        assert chosen.HasField("request_body") and not chosen.HasField("immediate_response")
        await stream.close()
