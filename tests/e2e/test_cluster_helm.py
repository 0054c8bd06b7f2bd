"""Real Helm against the real control plane: ``helm install``, ``helm upgrade`` (a changed value takes
effect, the generated token is kept through ``lookup``) and ``helm uninstall`` of charts/herd (the CRD
and the ModelDeployments stay). tests/e2e/test_chart_install.py checks that a release stores exactly
what the chart renders offline."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest
import yaml
from support.cluster import CHART, ControlPlane
from support.procs import wait_until

pytestmark = pytest.mark.e2e

RELEASE, NAMESPACE = "herd", "herd"
CRD = "customresourcedefinitions/modeldeployments.herd.dev"
KEPT = {"apiVersion": "herd.dev/v1alpha1", "kind": "ModelDeployment", "metadata": {"name": "kept"},
        "spec": {"model": {"source": "pvc://weights/kept"}}}  # fmt: skip


def get(cluster: ControlPlane, *args: str) -> dict[str, Any]:
    body: dict[str, Any] = json.loads(cluster.kubectl("get", *args, "-o", "json").stdout)
    return body


def exists(cluster: ControlPlane, *args: str) -> bool:
    return cluster.kubectl("get", *args, check=False).returncode == 0


def helm(cluster: ControlPlane, *args: str) -> None:
    cluster.helm(*args, "-n", NAMESPACE)


def internal_token(cluster: ControlPlane) -> str:
    secret = get(cluster, "-n", NAMESPACE, "secret", "herd-internal-token")
    return base64.b64decode(secret["data"]["token"]).decode()


def test_install_upgrade_uninstall_keeps_the_crd(cluster: ControlPlane) -> None:
    if cluster.helm("status", RELEASE, "-n", NAMESPACE, check=False).returncode == 0:
        helm(cluster, "uninstall", RELEASE, "--wait")  # another module's install; the CRD stays
    helm(cluster, "install", RELEASE, str(CHART), "--create-namespace")
    assert get(cluster, "-n", NAMESPACE, "deployment", "herd-orchestrator")["spec"]["replicas"] == 1
    for kind, name in [("deployment", "herd-operator"), ("serviceaccount", "herd-operator"),
                       ("serviceaccount", "herd-orchestrator"), ("service", "herd-orchestrator")]:  # fmt: skip
        assert exists(cluster, "-n", NAMESPACE, kind, name), f"{kind}/{name}"
    assert exists(cluster, "clusterrole", "herd-operator") and exists(
        cluster, "clusterrolebinding", "herd-operator"
    )
    cluster.kubectl("wait", "--for=condition=Established", CRD, "--timeout=60s")
    # The controller-manager runs the chart's Deployments: ReplicaSets, then Pods (Pending: no node).
    wait_until(
        lambda: len(get(cluster, "-n", NAMESPACE, "pods", "-l", "app.kubernetes.io/component=orchestrator")["items"]) == 1,
        timeout=60, what="the orchestrator's pod",
    )  # fmt: skip
    token = internal_token(cluster)
    cluster.kubectl("apply", "-n", "default", "-f", "-", stdin=yaml.safe_dump(KEPT))

    helm(cluster, "upgrade", RELEASE, str(CHART), "--set", "orchestrator.replicas=2")
    assert get(cluster, "-n", NAMESPACE, "deployment", "herd-orchestrator")["spec"]["replicas"] == 2
    wait_until(
        lambda: len(get(cluster, "-n", NAMESPACE, "pods", "-l", "app.kubernetes.io/component=orchestrator")["items"]) == 2,
        timeout=60, what="the orchestrator's second pod",
    )  # fmt: skip
    assert internal_token(cluster) == token, "the generated token is kept across upgrades (lookup)"
    assert (
        json.loads(cluster.helm("history", RELEASE, "-n", NAMESPACE, "-o", "json").stdout)[-1]["revision"]
        == 2
    )

    crd_uid = get(cluster, CRD)["metadata"]["uid"]
    helm(cluster, "uninstall", RELEASE, "--wait")
    for kind, name in [("deployment", "herd-operator"), ("deployment", "herd-orchestrator"),
                       ("secret", "herd-internal-token"), ("serviceaccount", "herd-operator")]:  # fmt: skip
        assert not exists(cluster, "-n", NAMESPACE, kind, name), f"{kind}/{name} outlived the release"
    assert not exists(cluster, "clusterrole", "herd-operator")
    assert get(cluster, CRD)["metadata"]["uid"] == crd_uid, "helm.sh/resource-policy: keep"
    assert get(cluster, "-n", "default", "md", "kept")["spec"]["model"]["source"] == "pvc://weights/kept"

    # A later install takes the kept CRD back (its Helm ownership names this release) instead of failing.
    helm(cluster, "install", RELEASE, str(CHART))
    assert get(cluster, CRD)["metadata"]["uid"] == crd_uid
    cluster.kubectl("delete", "-n", "default", "md", "kept")
