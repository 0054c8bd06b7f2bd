"""herd on the real control plane as a user runs it, every component a pod on the node agent.

``helm install`` runs the operator and the orchestrator as pods, each logged in with its own
ServiceAccount's projected token; ``kubectl apply -f examples/smollm2.yaml`` (into a namespace of its
own, the internal token copied there as docs/kubernetes.md says) gives two SmolLM2 workers; the
orchestrator discovers them and answers OpenAI requests through its Service; ``kubectl scale`` adds a
third that the orchestrator routes to; ``helm test`` passes (its pod resolves the orchestrator's
Service by name); the disaggregated example serves through a prefill and a decode pod; deleting a
ModelDeployment stops its workers' processes. Nothing here is a stand-in: the pods run the chart's
and the operator's own command lines.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.cluster import ControlPlane, container_pid, install_herd_chart, is_alive
from support.procs import wait_until

from herd.api.protocol import WORKER_HEADER

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
RELEASE_NAMESPACE = "herd"
NAMESPACE = "serving"
TOKEN_SECRET = "herd-internal-token"
ORCHESTRATOR_PORT = 8000
LOAD_TIMEOUT = 240.0  # SmolLM2 workers loading side by side on a shared 2-core machine
Object = dict[str, Any]


def model_status(cluster: ControlPlane, name: str) -> Object:
    status: Object = cluster.get_json("md", name, NAMESPACE).get("status", {})
    return status


def pool_ready(cluster: ControlPlane, name: str, pool: str) -> str:
    return str(model_status(cluster, name).get("pools", {}).get(pool, {}).get("ready", ""))


def wait_pool_ready(cluster: ControlPlane, name: str, pool: str, count: int) -> None:
    wait_until(
        lambda: pool_ready(cluster, name, pool) == f"{count}/{count}",
        timeout=LOAD_TIMEOUT,
        interval=0.5,
        what=f"{name} pool {pool} ready {count}/{count}",
    )


def copy_token_secret(cluster: ControlPlane, namespace: str) -> None:
    """The step docs/kubernetes.md gives for a ModelDeployment outside the release's namespace."""
    secret = cluster.get_json("secret", TOKEN_SECRET, RELEASE_NAMESPACE)
    copy = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": TOKEN_SECRET, "namespace": namespace},
        "type": secret["type"],
        "data": secret["data"],
    }
    cluster.kubectl("apply", "-f", "-", stdin=json.dumps(copy))


@pytest.fixture(scope="module")
def endpoint(cluster: ControlPlane, demo_model: Path) -> Iterator[str]:
    """The orchestrator's Service, as the node agent serves it on loopback, with the chart's pods running."""
    assert demo_model.is_relative_to(REPO), (
        "examples/smollm2.yaml names the model inside the image (the repo)"
    )
    install_herd_chart(cluster, pods=True)
    for component in ("operator", "orchestrator"):
        cluster.wait_ready_pods(RELEASE_NAMESPACE, f"app.kubernetes.io/component={component}", 1, timeout=120)
    cluster.kubectl("create", "namespace", NAMESPACE)
    copy_token_secret(cluster, NAMESPACE)
    yield "http://" + cluster.service_address("herd-orchestrator", RELEASE_NAMESPACE, ORCHESTRATOR_PORT)
    cluster.kubectl("delete", "namespace", NAMESPACE, "--wait=false")  # its workers drain on their own
    install_herd_chart(cluster)  # the chart's pods stop; the other modules run their own operator


@pytest.fixture(scope="module")
def smollm2(cluster: ControlPlane, endpoint: str) -> str:
    cluster.kubectl("apply", "-n", NAMESPACE, "-f", str(REPO / "examples" / "smollm2.yaml"))
    wait_pool_ready(cluster, "smollm2", "workers", 2)
    wait_until(lambda: len(routable_workers(endpoint, "smollm2")) == 2, timeout=60, interval=0.5,
               what="the orchestrator routing to both workers")  # fmt: skip
    return "smollm2"


def routable_workers(endpoint: str, model: str) -> dict[str, Object]:
    """The orchestrator's dashboard rows of ``model``'s healthy workers, by worker id."""
    rows = httpx.get(f"{endpoint}/dashboard/data", timeout=10).json()["workers"]
    return {row["id"]: row for row in rows if row.get("model") == model and row["healthy"]}


def chat(endpoint: str, model: str, **fields: Any) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8}
    return httpx.post(f"{endpoint}/v1/chat/completions", json={**body, **fields}, timeout=120)


def pod_names(cluster: ControlPlane, selector: str, *, terminating: bool = False) -> set[str]:
    """The pods ``selector`` names, those terminating among them only when asked."""
    listed = json.loads(cluster.kubectl("-n", NAMESPACE, "get", "pods", "-l", selector, "-o", "json").stdout)
    return {pod["metadata"]["name"] for pod in listed["items"]
            if terminating or not pod["metadata"].get("deletionTimestamp")}  # fmt: skip


def test_an_openai_request_is_served_by_a_worker_pod(
    cluster: ControlPlane, endpoint: str, smollm2: str
) -> None:
    models = httpx.get(f"{endpoint}/v1/models", timeout=10).json()
    assert smollm2 in {model["id"] for model in models["data"]}
    answered = chat(endpoint, smollm2)
    assert answered.status_code == 200, answered.text
    assert answered.json()["choices"][0]["message"]["content"]
    worker = answered.headers[WORKER_HEADER]
    assert worker.removeprefix(f"{NAMESPACE}/") in pod_names(cluster, "herd.dev/deployment=smollm2")
    with httpx.stream("POST", f"{endpoint}/v1/chat/completions", timeout=120, json={
        "model": smollm2, "stream": True, "max_tokens": 8,
        "messages": [{"role": "user", "content": "Count to five."}],
    }) as streamed:  # fmt: skip
        lines = [line for line in streamed.iter_lines() if line.startswith("data: ")]
    assert streamed.status_code == 200 and lines[-1] == "data: [DONE]" and len(lines) > 2


def test_kubectl_scale_adds_a_worker_the_orchestrator_routes_to(
    cluster: ControlPlane, endpoint: str, smollm2: str
) -> None:
    before = set(routable_workers(endpoint, smollm2))
    cluster.kubectl("-n", NAMESPACE, "scale", f"md/{smollm2}", "--replicas=3")
    wait_pool_ready(cluster, smollm2, "workers", 3)
    wait_until(lambda: len(routable_workers(endpoint, smollm2)) == 3, timeout=60, interval=0.5,
               what="the orchestrator routing to three workers")  # fmt: skip
    (added,) = set(routable_workers(endpoint, smollm2)) - before
    row = cluster.kubectl("-n", NAMESPACE, "get", "md", smollm2).stdout.splitlines()[1].split()
    assert row[:2] == [smollm2, "True"] and "3/3" in row
    cluster.kubectl("-n", NAMESPACE, "scale", f"md/{smollm2}", "--replicas=2")
    wait_until(lambda: len(routable_workers(endpoint, smollm2)) == 2, timeout=120, interval=0.5,
               what="the orchestrator back to two workers")  # fmt: skip

    def routes_to_the_remaining_pods() -> bool:
        pods = {f"{NAMESPACE}/{name}" for name in pod_names(cluster, f"herd.dev/deployment={smollm2}")}
        return len(pods) == 2 and set(routable_workers(endpoint, smollm2)) == pods

    wait_until(routes_to_the_remaining_pods, timeout=60, interval=0.5,
               what="the orchestrator routing to exactly the remaining pods")  # fmt: skip
    assert added.startswith(f"{NAMESPACE}/{smollm2}-workers-")


def test_helm_test_reaches_the_orchestrator_through_its_service_name(
    cluster: ControlPlane, endpoint: str, smollm2: str
) -> None:
    # The hook pod's script fails unless the answer carries choices; it is deleted once it succeeded
    # (hook-succeeded), and the node agent serves no logs, so the phase is what helm can report.
    done = cluster.helm("test", "herd", "-n", RELEASE_NAMESPACE, "--timeout=5m")
    assert re.search(r"TEST SUITE:\s+herd-test-chat", done.stdout), done.stdout
    assert re.search(r"Phase:\s+Succeeded", done.stdout), done.stdout


def test_deleting_the_modeldeployment_stops_its_workers(
    cluster: ControlPlane, endpoint: str, smollm2: str
) -> None:
    listed = json.loads(cluster.kubectl("-n", NAMESPACE, "get", "pods", "-l", f"herd.dev/deployment={smollm2}",
                                        "-o", "json").stdout)  # fmt: skip
    pids = [container_pid(pod) for pod in listed["items"]]
    assert pids and all(is_alive(pid) for pid in pids)
    cluster.kubectl("-n", NAMESPACE, "delete", "md", smollm2, "--wait=false")
    # The garbage collector learns the CRD's kind at its discovery resync (up to 30 s after install).
    selector = f"herd.dev/deployment={smollm2}"
    wait_until(lambda: not pod_names(cluster, selector, terminating=True), timeout=180, interval=0.5,
               what="the workers' pods collected and gone")  # fmt: skip
    assert not any(is_alive(pid) for pid in pids)
    wait_until(lambda: not routable_workers(endpoint, smollm2), timeout=60, interval=0.5,
               what="the orchestrator routing to none of them")  # fmt: skip


def test_the_disaggregated_example_serves_through_a_prefill_and_a_decode_pod(
    cluster: ControlPlane, endpoint: str
) -> None:
    cluster.kubectl("apply", "-n", NAMESPACE, "-f", str(REPO / "examples" / "smollm2-disagg.yaml"))
    name, served = "smollm2-disagg", "smollm2"  # the example serves the aggregated one's name
    wait_pool_ready(cluster, name, "prefill", 1)
    wait_pool_ready(cluster, name, "decode", 1)
    wait_until(lambda: len(routable_workers(endpoint, served)) == 2, timeout=60, interval=0.5,
               what="the orchestrator routing to the prefill and the decode pod")  # fmt: skip
    roles = {row["role"] for row in routable_workers(endpoint, served).values()}
    assert roles == {"prefill", "decode"}
    # Past the example's prefillThresholdTokens (256): the prefill pod computes, the decode pod answers.
    answered = chat(endpoint, served, messages=[{"role": "user", "content": "a story " * 200}])
    assert answered.status_code == 200, answered.text
    assert answered.json()["choices"][0]["message"]["content"]
    assert answered.headers[WORKER_HEADER].removeprefix(f"{NAMESPACE}/").startswith(f"{name}-decode-")
