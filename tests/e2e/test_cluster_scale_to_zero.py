"""Scale to zero and back on the real control plane (issue 17).

The chart's orchestrator runs as a pod (its Service is where the operator reads the demand); the
operator runs embedded with the chart's ServiceAccount token and a fast autoscaler. A ModelDeployment
of the tiny model with ``minReplicas: 0`` and ``scaleToZeroAfterSeconds: 4`` starts with one real
worker (the node agent runs it), goes to zero once idle, and a chat request to the orchestrator's
Service is held there (``herd_router_requests_held``) until the operator, reading that demand, has
scaled the Deployment 0 -> 1 and the new worker is ready: the request is answered by it. Idle again,
the pool goes back to zero.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.cluster import ControlPlane, install_herd_chart
from support.operator_harness import Models, embedded_operator, tiny_model_deployment
from support.procs import wait_until

from herd.api.protocol import WORKER_HEADER
from herd.operator.settings import AutoscalerSettings, OperatorConfig, PlanSettings

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

RELEASE_NAMESPACE = "herd"
NAMESPACE = "zero"
TOKEN_SECRET = PlanSettings().token_secret
POD_TIMEOUT = 240.0  # a real worker starts (torch imported) on 2 shared cores
COLD_START_S = 230
AUTOSCALING = {"enabled": True, "minReplicas": 0, "maxReplicas": 1, "scaleToZeroAfterSeconds": 4,
               "coldStartTimeoutSeconds": COLD_START_S}  # fmt: skip


@pytest.fixture(scope="module")
def endpoint(cluster: ControlPlane) -> Iterator[str]:
    """The orchestrator's Service (the chart's orchestrator pod, not its operator) and the operator
    embedded: autoscaler rounds every second, demand read every half second."""
    install_herd_chart(cluster, "operator.replicas=0", pods=True)
    cluster.wait_ready_pods(RELEASE_NAMESPACE, "app.kubernetes.io/component=orchestrator", 1, timeout=120)
    cluster.kubectl("create", "namespace", NAMESPACE)
    secret = cluster.get_json("secret", TOKEN_SECRET, RELEASE_NAMESPACE)
    copy = {"apiVersion": "v1", "kind": "Secret", "type": secret["type"], "data": secret["data"],
            "metadata": {"name": TOKEN_SECRET, "namespace": NAMESPACE}}  # fmt: skip
    cluster.kubectl("apply", "-f", "-", stdin=json.dumps(copy))
    scaler = AutoscalerSettings(interval_s=1.0, demand_interval_s=0.5, stabilization_s=3600.0)
    config = OperatorConfig(
        retry_delay=1.0, plan=PlanSettings(orchestrator_namespace=RELEASE_NAMESPACE), autoscaler=scaler
    )
    login = cluster.login_as("herd-operator", RELEASE_NAMESPACE, default_namespace=NAMESPACE)
    try:
        with embedded_operator(login, namespace=NAMESPACE, config=config):
            yield "http://" + cluster.service_address("herd-orchestrator", RELEASE_NAMESPACE, 8000)
    finally:
        cluster.kubectl("delete", "namespace", NAMESPACE, "--wait=false")
        install_herd_chart(cluster)  # the chart's pods stop; the other modules run their own operator


def workers(models: Models) -> list[dict[str, Any]]:
    pods = models.get("pods", "-l", "herd.dev/deployment=idle")["items"]
    return [pod for pod in pods if not pod["metadata"].get("deletionTimestamp")]


def at_zero(models: Models) -> bool:
    return models.get("deployment", "idle-workers")["spec"]["replicas"] == 0 and not workers(models)


def scaled(models: Models, change: str) -> list[str]:
    """The messages of the autoscaler's Events about ``change`` (``0 -> 1``, ``1 -> 0``)."""
    return [event["message"] for event in models.events("idle") if change in event.get("message", "")]


def test_an_idle_pool_goes_to_zero_and_a_request_brings_it_back(
    cluster: ControlPlane, endpoint: str, tiny_llama: Path
) -> None:
    models = Models(cluster, NAMESPACE)
    manifest = tiny_model_deployment("idle", tiny_llama, replicas=1, autoscaling=AUTOSCALING,
                                     routing={"strategy": "round_robin"})  # fmt: skip
    models.apply(manifest)
    cluster.wait_ready_pods(NAMESPACE, "herd.dev/deployment=idle", 1, timeout=POD_TIMEOUT)

    wait_until(lambda: at_zero(models), timeout=120, interval=0.5, what="the idle pool at zero")
    assert models.get("md", "idle")["spec"]["replicas"] == 0
    assert any("workers replicas 1 -> 0: idle for" in message for message in scaled(models, "1 -> 0"))

    body = {"model": "idle", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
    answered = httpx.post(f"{endpoint}/v1/chat/completions", json=body, timeout=COLD_START_S + 30)
    assert answered.status_code == 200, answered.text
    assert answered.headers[WORKER_HEADER].startswith(f"{NAMESPACE}/idle-workers-")
    assert scaled(models, "0 -> 1") == ["workers replicas 0 -> 1: 1 requests wait at zero replicas"]

    wait_until(lambda: at_zero(models), timeout=120, interval=0.5, what="the pool back at zero when idle")
