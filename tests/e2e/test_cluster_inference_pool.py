"""spec.gateway.inferencePool on the real control plane: the operator, logged in with the chart's
ServiceAccount token (a verb the chart forgot is a 403 here), creates an InferencePool selecting the
worker pods, with herd's endpoint picker (its account, Role, binding, Deployment and Service) as its
endpointPickerRef; the chart's InferencePool CRD (crds.inferencePool) rejects what the extension's
v1 schema rejects. The pods stay Pending (no node matches): what the operator writes is under test.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.cluster import ControlPlane, Login, install_herd_chart
from support.operator_harness import NO_NODE, RefusedRequests, embedded_operator, logged_refusals
from support.procs import wait_until

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
NAMESPACE = "gateway-api"
OPERATOR_ACCOUNT = ("herd-operator", "herd")


@pytest.fixture(scope="module")
def forbidden() -> Iterator[RefusedRequests]:
    with logged_refusals() as refused:
        yield refused


@pytest.fixture(scope="module")
def operator(cluster: ControlPlane, forbidden: RefusedRequests) -> Iterator[Login]:
    install_herd_chart(cluster, "crds.inferencePool=true")
    cluster.kubectl("create", "namespace", NAMESPACE)
    login = cluster.login_as(*OPERATOR_ACCOUNT, default_namespace=NAMESPACE)
    with embedded_operator(login, namespace=None):
        yield login
    cluster.kubectl("delete", "namespace", NAMESPACE, "--wait=false")


def get(cluster: ControlPlane, *args: str) -> dict[str, Any]:
    result = cluster.kubectl("-n", NAMESPACE, "get", *args, "-o", "json", check=False)
    return json.loads(result.stdout) if result.returncode == 0 else {}


def eventually(check: Any, what: str) -> None:
    wait_until(check, timeout=60, interval=0.2, what=what)


def test_the_operator_creates_the_inference_pool_and_its_endpoint_picker(
    cluster: ControlPlane, operator: Login, forbidden: RefusedRequests
) -> None:
    body = yaml.safe_load((REPO / "examples" / "smollm2.yaml").read_text())
    body["spec"]["workers"]["nodeSelector"] = NO_NODE
    body["spec"]["gateway"] = {"inferencePool": True}
    cluster.kubectl("apply", "-n", NAMESPACE, "-f", "-", stdin=json.dumps(body))
    eventually(lambda: get(cluster, "inferencepool", "smollm2"), "the InferencePool")
    pool = get(cluster, "inferencepool", "smollm2")
    uid = get(cluster, "md", "smollm2")["metadata"]["uid"]
    assert [(r["kind"], r["uid"]) for r in pool["metadata"]["ownerReferences"]] == [("ModelDeployment", uid)]
    assert pool["spec"]["selector"]["matchLabels"] == {
        "app.kubernetes.io/managed-by": "herd",
        "herd.dev/deployment": "smollm2",
        "herd.dev/role": "unified",
    }
    assert pool["spec"]["targetPorts"] == [{"number": 8000}]
    assert pool["spec"]["appProtocol"] == "http"  # the CRD's default
    assert pool["spec"]["endpointPickerRef"] == {
        "group": "",
        "kind": "Service",
        "name": "smollm2-epp",
        "port": {"number": 9002},
        "failureMode": "FailClose",
    }
    for kind in ("serviceaccount", "role", "rolebinding", "deployment", "service"):
        eventually(lambda kind=kind: get(cluster, kind, "smollm2-epp"), f"the picker's {kind}")
    service = get(cluster, "service", "smollm2-epp")["spec"]
    assert [(p["port"], p["appProtocol"]) for p in service["ports"]] == [(9002, "http2")]
    selector = "app.kubernetes.io/component=epp,herd.dev/deployment=smollm2"
    eventually(lambda: len(get(cluster, "pods", "-l", selector)["items"]) == 1, "the picker's pod")
    # The picker may read pods and ModelDeployments of its namespace, and nothing else.
    account = f"system:serviceaccount:{NAMESPACE}:smollm2-epp"
    for verb, resource, allowed in [
        ("watch", "pods", "yes"),
        ("list", "modeldeployments.herd.dev", "yes"),
        ("get", "secrets", "no"),
    ]:
        answer = cluster.kubectl(
            "auth", "can-i", verb, resource, "-n", NAMESPACE, "--as", account, check=False
        )
        assert answer.stdout.strip() == allowed, (verb, resource, answer.stdout)
    # The status counts the worker pool only: the picker's pod is no worker.
    eventually(
        lambda: (
            get(cluster, "md", "smollm2").get("status", {}).get("pools", {}).get("workers", {}).get("ready")
            == "0/2"
        ),
        "0/2",
    )
    assert set(get(cluster, "md", "smollm2")["status"]["pools"]) == {"workers"}
    assert not forbidden.records


@pytest.mark.parametrize(
    ("spec", "refusal"),
    [
        ({"selector": {"matchLabels": {"a": "b"}}}, "targetPorts: Required value"),
        (
            {"selector": {"matchLabels": {"a": "b"}}, "targetPorts": [{"number": 8000}, {"number": 8000}]},
            "port number must be unique",
        ),
        (
            {
                "selector": {"matchLabels": {"a": "b"}},
                "targetPorts": [{"number": 8000}],
                "endpointPickerRef": {"name": "epp"},
            },
            "port is required when kind is 'Service'",
        ),
        (
            {"selector": {"matchLabels": {}}, "targetPorts": [{"number": 8000}]},
            "should have at least 1 properties",
        ),
        (
            {
                "selector": {"matchLabels": {"a": "b"}},
                "targetPorts": [{"number": 8000}],
                "appProtocol": "grpc",
            },
            "Unsupported value",
        ),
    ],
    ids=["no-target-ports", "repeated-port", "picker-without-port", "empty-selector", "bad-app-protocol"],
)
def test_the_charts_inference_pool_crd_validates_as_the_extensions_v1_schema(
    cluster: ControlPlane, operator: Login, spec: dict[str, Any], refusal: str
) -> None:
    body = {
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": {"name": "bad"},
        "spec": spec,
    }
    result = cluster.kubectl(
        "apply", "-n", NAMESPACE, "--dry-run=server", "-f", "-", stdin=json.dumps(body), check=False
    )
    assert result.returncode != 0 and refusal in result.stderr, result.stderr
