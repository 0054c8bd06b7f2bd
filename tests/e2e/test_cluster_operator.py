"""The operator on the real control plane, logged in with a TokenRequest token of the ServiceAccount
the chart creates, so the chart's RBAC is proven by use: a verb the chart forgot is a 403 here.

kopf runs embedded (tests/support/operator_harness.py). The real controller-manager turns the
operator's Deployments into ReplicaSets and Pods and garbage-collects every child when its
ModelDeployment goes. The examples are applied with a nodeSelector no node matches, so their pods
stay Pending: what the operator writes is under test here; tests/e2e/test_cluster_serving.py runs
the same examples' workers for real.
"""

from __future__ import annotations

import json
import re
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
NAMESPACE = "models"
OPERATOR_ACCOUNT = ("herd-operator", "herd")  # the chart's operator ServiceAccount (release herd)
TIMEOUT = 60.0
GC_TIMEOUT = 150.0


@pytest.fixture(scope="module")
def forbidden() -> Iterator[RefusedRequests]:
    with logged_refusals() as refused:
        yield refused


@pytest.fixture(scope="module")
def operator(cluster: ControlPlane, forbidden: RefusedRequests) -> Iterator[Login]:
    install_herd_chart(cluster)
    cluster.kubectl("create", "namespace", NAMESPACE)
    login = cluster.login_as(*OPERATOR_ACCOUNT, default_namespace=NAMESPACE)
    with embedded_operator(login, namespace=None):  # every namespace, as the chart's default runs it
        yield login
    cluster.kubectl("delete", "namespace", NAMESPACE, "--wait=false")


def apply_pending(cluster: ControlPlane, example: str) -> None:
    """``kubectl apply`` of ``examples/<example>.yaml`` with every pool's pods kept Pending."""
    body = yaml.safe_load((REPO / "examples" / f"{example}.yaml").read_text())
    for pool in ("workers", "prefill", "decode"):
        if pool in body["spec"]:
            body["spec"][pool]["nodeSelector"] = NO_NODE
    cluster.kubectl("apply", "-n", NAMESPACE, "-f", "-", stdin=json.dumps(body))


def get(cluster: ControlPlane, *args: str) -> dict[str, Any]:
    body: dict[str, Any] = json.loads(cluster.kubectl("-n", NAMESPACE, "get", *args, "-o", "json").stdout)
    return body


def names(cluster: ControlPlane, kind: str, selector: str) -> set[str]:
    return {item["metadata"]["name"] for item in get(cluster, kind, "-l", selector)["items"]}


def condition(cluster: ControlPlane, md: str, kind: str) -> dict[str, Any]:
    conditions = get(cluster, "md", md).get("status", {}).get("conditions", [])
    return next((c for c in conditions if c["type"] == kind), {})


def events(cluster: ControlPlane, md: str) -> set[tuple[str, str]]:
    found = get(cluster, "events", "--field-selector", f"involvedObject.name={md}")["items"]
    return {(event["type"], event["reason"]) for event in found}


def columns(table: str) -> dict[str, str]:
    """The first row of ``kubectl get``'s table by column (an empty cell stays an empty string)."""
    header, row = table.splitlines()[:2]
    starts = [match.start() for match in re.finditer(r"\S+", header)]
    ends = [*starts[1:], None]
    return {
        header[start:end].strip(): row[start:end].strip() for start, end in zip(starts, ends, strict=True)
    }


def eventually(check: Any, what: str) -> None:
    wait_until(check, timeout=TIMEOUT, interval=0.2, what=what)


def test_the_operator_holds_the_chart_service_accounts_token_and_no_more(
    cluster: ControlPlane, operator: Login
) -> None:
    whoami = json.loads(
        cluster.kubectl("auth", "whoami", "-o", "json", kubeconfig=operator.kubeconfig).stdout
    )
    assert whoami["status"]["userInfo"]["username"] == operator.user
    refused = cluster.kubectl("get", "secrets", "-n", NAMESPACE, kubeconfig=operator.kubeconfig, check=False)
    assert refused.returncode != 0 and "Forbidden" in refused.stderr, "the chart grants no Secrets"


def test_apply_smollm2_gives_children_pods_status_and_columns(
    cluster: ControlPlane, operator: Login, forbidden: RefusedRequests
) -> None:
    apply_pending(cluster, "smollm2")
    selector = "herd.dev/deployment=smollm2"
    eventually(lambda: names(cluster, "deployments", selector) == {"smollm2-workers"}, "the Deployment")
    eventually(lambda: names(cluster, "services", selector) == {"smollm2-workers"}, "the Service")
    uid = get(cluster, "md", "smollm2")["metadata"]["uid"]
    for kind in ("deployment", "service"):
        refs = get(cluster, kind, "smollm2-workers")["metadata"]["ownerReferences"]
        assert [(r["kind"], r["uid"], r["controller"]) for r in refs] == [("ModelDeployment", uid, True)]
    # The controller-manager's work: a ReplicaSet, its two Pods (Pending: no node matches), an EndpointSlice.
    eventually(lambda: len(names(cluster, "replicasets", selector)) == 1, "the ReplicaSet")
    eventually(lambda: len(names(cluster, "pods", selector)) == 2, "two worker pods")
    eventually(
        lambda: len(names(cluster, "endpointslices", "kubernetes.io/service-name=smollm2-workers")) == 1,
        "the Service's EndpointSlice",
    )

    def is_observed() -> bool:
        body = get(cluster, "md", "smollm2")
        return bool(body.get("status", {}).get("observedGeneration") == body["metadata"]["generation"])

    eventually(is_observed, "the status of the current generation")
    eventually(lambda: ("Normal", "Created") in events(cluster, "smollm2"), "the operator's Created Event")
    eventually(lambda: condition(cluster, "smollm2", "Ready").get("reason") == "PoolsNotReady", "Ready=False")
    status = get(cluster, "md", "smollm2")["status"]
    assert condition(cluster, "smollm2", "Ready")["status"] == "False"
    assert status["pools"]["workers"]["ready"] == "0/2"
    assert status["replicas"] == 2 and status["selector"]

    row = columns(cluster.kubectl("-n", NAMESPACE, "get", "md", "smollm2").stdout)
    assert list(row) == [
        "NAME",
        "READY",
        "MODE",
        "WORKERS",
        "PREFILL",
        "DECODE",
        "STRATEGY",
        "ENDPOINT",
        "AGE",
    ]
    assert row["NAME"] == "smollm2" and row["READY"] == "False" and row["MODE"] == "aggregated"
    assert (row["WORKERS"], row["PREFILL"], row["DECODE"]) == ("0/2", "", "")
    assert row["STRATEGY"] == "kv_cache_aware"
    assert row["ENDPOINT"] == f"http://herd-orchestrator.{NAMESPACE}.svc:8000/v1"

    cluster.kubectl("-n", NAMESPACE, "scale", "md/smollm2", "--replicas=3")
    eventually(lambda: get(cluster, "deployment", "smollm2-workers")["spec"]["replicas"] == 3, "3 replicas")
    eventually(lambda: len(names(cluster, "pods", selector)) == 3, "three worker pods")
    eventually(lambda: get(cluster, "md", "smollm2")["status"]["pools"]["workers"]["ready"] == "0/3", "0/3")
    assert not forbidden.records


def test_deleting_the_modeldeployment_collects_its_children(
    cluster: ControlPlane, operator: Login, forbidden: RefusedRequests
) -> None:
    apply_pending(cluster, "smollm2-disagg")
    selector = "herd.dev/deployment=smollm2-disagg"
    both = {"smollm2-disagg-prefill", "smollm2-disagg-decode"}
    eventually(lambda: names(cluster, "deployments", selector) == both, "the prefill and decode Deployments")
    eventually(lambda: len(names(cluster, "pods", selector)) == 2, "a prefill and a decode pod")
    assert not get(cluster, "md", "smollm2-disagg")["metadata"].get("finalizers")
    cluster.kubectl("-n", NAMESPACE, "delete", "md", "smollm2-disagg")
    # The garbage collector learns a new kind (the CRD's) at its discovery resync, every 30 s: the first
    # collection after the CRD was installed can wait that long (measured 41 s on a fresh cluster).
    for kind in ("deployments", "services", "replicasets", "pods"):
        wait_until(lambda kind=kind: not names(cluster, kind, selector), timeout=GC_TIMEOUT, interval=0.5,
                   what=f"{kind} garbage-collected")  # fmt: skip
    assert not forbidden.records
