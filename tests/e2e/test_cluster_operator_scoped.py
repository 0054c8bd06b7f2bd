"""The operator of a chart installed with ``watch.allNamespaces=false`` on the real control plane: it
serves one namespace with the chart's namespaced Role (and the ClusterRole reading CRDs and namespaces), logged
in with a TokenRequest token of that release's operator ServiceAccount; no request it makes is refused."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from support.cluster import ControlPlane, install_herd_chart
from support.operator_harness import RefusedRequests, embedded_operator, logged_refusals
from support.procs import wait_until

pytestmark = pytest.mark.e2e

RELEASE = NAMESPACE = "herd-scoped"
WATCHED = "scoped-models"


@pytest.fixture(scope="module")
def refused(cluster: ControlPlane) -> Iterator[RefusedRequests]:
    install_herd_chart(cluster)  # the CRD, owned by the main release
    cluster.kubectl("create", "namespace", WATCHED)
    install_herd_chart(cluster, "crds.install=false", "watch.allNamespaces=false", f"watch.namespaces[0]={WATCHED}",
                       release=RELEASE, namespace=NAMESPACE)  # fmt: skip
    login = cluster.login_as(f"{RELEASE}-operator", NAMESPACE, default_namespace=WATCHED)
    try:
        with logged_refusals() as refused, embedded_operator(login, namespace=WATCHED):
            yield refused
    finally:
        cluster.helm("uninstall", RELEASE, "-n", NAMESPACE)
        cluster.kubectl("delete", "namespace", WATCHED, NAMESPACE, "--wait=false")


def get(cluster: ControlPlane, *args: str) -> dict[str, Any]:
    body: dict[str, Any] = json.loads(cluster.kubectl("-n", WATCHED, "get", *args, "-o", "json").stdout)
    return body


def test_a_namespaced_release_reconciles_without_a_refused_request(
    cluster: ControlPlane, refused: RefusedRequests
) -> None:
    manifest = {"apiVersion": "herd.dev/v1alpha1", "kind": "ModelDeployment", "metadata": {"name": "scoped"},
                "spec": {"model": {"source": "pvc://weights/scoped"}, "workers": {"replicas": 1}}}  # fmt: skip
    cluster.kubectl("apply", "-n", WATCHED, "-f", "-", stdin=json.dumps(manifest))

    def is_reconciled() -> bool:
        body = get(cluster, "md", "scoped")
        observed = body.get("status", {}).get("observedGeneration") == body["metadata"]["generation"]
        return observed and bool(get(cluster, "deployments", "-l", "herd.dev/deployment=scoped")["items"])

    # Without list and watch on namespaces, kopf retried a 403 for 54 s before this first pass; 2.5 s with.
    wait_until(is_reconciled, timeout=60, interval=0.2, what="the scoped operator's first pass")
    assert not refused.records, refused.records[:3]
