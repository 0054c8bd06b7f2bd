"""From ``kubectl apply`` to a chat completion on the real control plane: the operator plans the
worker Deployment, the controller-manager makes its pod, the node agent runs the planned command
(``herd worker`` on the pod's own loopback address, the internal token from the namespace's Secret)
and its readiness probe makes the pod Ready; ``herd orchestrator --kubernetes``, a local process
logged in as the chart's orchestrator ServiceAccount, discovers the pod through the API and routes a
request to it at the pod's IP.

Moved from the kmock emulator (issue 19, item 6), where the test ran the planned command itself with
ports moved and created and marked the Pod Ready as a kubelet would.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from support.cluster import ControlPlane
from support.operator_harness import (
    Models,
    kube_orchestrator,
    operated_namespace,
    tiny_model_deployment,
)
from support.procs import wait_until

from herd.api.protocol import WORKER_HEADER

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

NAMESPACE = "routing"
TOKEN = "routing-test-token"
NODE_ADDRESSES = ipaddress.ip_network("127.244.0.0/16")


@pytest.fixture(scope="module")
def models(cluster: ControlPlane) -> Iterator[Models]:
    with operated_namespace(cluster, NAMESPACE, TOKEN) as models:
        yield models


def is_ready(models: Models, md: str) -> bool:
    return models.condition(md, "Ready").get("status") == "True"


def test_the_orchestrator_routes_to_the_pod_the_operator_planned(
    models: Models, tiny_llama: Path, tmp_path: Path
) -> None:
    models.apply(tiny_model_deployment("tiny", tiny_llama, routing={"strategy": "kv_cache_aware"}))
    (pod,) = models.plane.wait_ready_pods(NAMESPACE, "herd.dev/deployment=tiny", 1, timeout=180)
    assert ipaddress.ip_address(pod["status"]["podIP"]) in NODE_ADDRESSES
    command = pod["spec"]["containers"][0]["command"]
    assert command[:2] == ["herd", "worker"] and command[command.index("--host") + 1] == "0.0.0.0"
    wait_until(lambda: is_ready(models, "tiny"), timeout=60, interval=0.2, what="ModelDeployment Ready=True")
    with kube_orchestrator(models, TOKEN, tmp_path / "gateway.log", "--log-level", "WARNING") as url:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}

        def routed() -> bool:
            response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)
            return response.status_code == 200 and response.headers[WORKER_HEADER] == f"{NAMESPACE}/{pod['metadata']['name']}"  # fmt: skip

        wait_until(routed, timeout=180, interval=0.3, what="a chat completion routed to the pod")
        rows = httpx.get(f"{url}/dashboard/data", timeout=10).json()["workers"]
        assert [row["url"] for row in rows] == [f"http://{pod['status']['podIP']}:8000"], rows
