"""A model over several pods on the real control plane: the operator makes a LeaderWorkerSet.

The LeaderWorkerSet CRD (sigs.k8s.io/lws, fetched by tests/support/lws.py) is installed on the
session's control plane, and the operator runs embedded as the chart's ServiceAccount (so the chart's
RBAC must allow every request). No LWS controller runs, so the LeaderWorkerSet makes no pods: these
tests check the object herd writes, as the real apiserver (with the CRD's schema) stores it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from support.cluster import ControlPlane
from support.lws import LWS_CRD_NAME, lws_crd
from support.operator_harness import (
    Models,
    logged_refusals,
    model_deployment,
    operated_namespace,
    pending_pool,
)
from support.procs import wait_until

pytestmark = pytest.mark.e2e

NAMESPACE = "lws-e2e"
TOKEN = "lws-e2e-token"
TIMEOUT = 60.0


@pytest.fixture(scope="module")
def models(cluster: ControlPlane) -> Iterator[Models]:
    crd = lws_crd()  # the cluster's binaries are built with Go too: without it, this fails by name
    cluster.kubectl("apply", "--server-side", "-f", str(crd))  # too large for client-side apply's annotation
    wait_until(
        lambda: is_established(cluster), timeout=TIMEOUT, interval=0.2, what=f"{LWS_CRD_NAME} established"
    )
    with logged_refusals() as refused, operated_namespace(cluster, NAMESPACE, TOKEN) as models:
        yield models
    assert not refused.records, refused.records[:3]


def is_established(cluster: ControlPlane) -> bool:
    conditions = cluster.get_json("crd", LWS_CRD_NAME).get("status", {}).get("conditions") or []
    return any(c["type"] == "Established" and c["status"] == "True" for c in conditions)


def eventually(check: Callable[[], bool], what: str) -> None:
    wait_until(check, timeout=TIMEOUT, interval=0.2, what=what)


def found(models: Models, name: str) -> list[dict[str, Any]]:
    """The LeaderWorkerSets labelled as ``name``'s."""
    items: list[dict[str, Any]] = models.get("leaderworkersets", "-l", f"herd.dev/deployment={name}")["items"]
    return items


def leader_worker_set(models: Models, name: str) -> dict[str, Any]:
    """``name``'s one LeaderWorkerSet, once the operator made it."""
    eventually(lambda: len(found(models, name)) == 1, f"the LeaderWorkerSet of {name}")
    return found(models, name)[0]


def test_a_replica_over_two_pods_becomes_a_leader_worker_set_owned_by_the_model(models: Models) -> None:
    models.apply(model_deployment("group", workers={**pending_pool(2), "podsPerReplica": 2}))
    lws = leader_worker_set(models, "group")
    owner = models.get("md", "group")["metadata"]["uid"]
    refs = [(ref["kind"], ref["uid"], ref["controller"]) for ref in lws["metadata"]["ownerReferences"]]
    assert (lws["apiVersion"], lws["metadata"]["name"], refs) == (
        "leaderworkerset.x-k8s.io/v1",
        "group-workers",
        [("ModelDeployment", owner, True)],
    )
    spec = lws["spec"]
    template = spec["leaderWorkerTemplate"]
    assert (spec["replicas"], template["size"], template["restartPolicy"]) == (
        2,
        2,
        "RecreateGroupOnPodRestart",
    )
    assert spec["networkConfig"] == {"subdomainPolicy": "UniquePerReplica"}
    leader, follower = template["leaderTemplate"], template["workerTemplate"]
    assert leader["metadata"]["labels"]["herd.dev/role"] == "unified"
    assert "herd.dev/role" not in follower["metadata"]["labels"]
    (serving,), (ranks,) = leader["spec"]["containers"], follower["spec"]["containers"]
    assert [port["name"] for port in serving["ports"]] == ["http", "internal", "rendezvous"]
    assert "ports" not in ranks and "readinessProbe" not in ranks
    argv = ranks["command"]
    assert argv[argv.index("--group-size") + 1] == "2"
    assert json.loads(argv[argv.index("--engine-json") + 1])["tensorParallelSize"] == 2
    service = models.get("service", "group-workers")
    assert service["spec"]["selector"]["leaderworkerset.sigs.k8s.io/worker-index"] == "0"
    assert not models.get("deployments", "-l", "herd.dev/deployment=group")["items"]


def test_scaling_the_model_scales_the_groups(models: Models) -> None:
    models.apply(model_deployment("scaled-group", workers={**pending_pool(1), "podsPerReplica": 2}))
    uid = leader_worker_set(models, "scaled-group")["metadata"]["uid"]
    models.kubectl("scale", "md/scaled-group", "--replicas=3")
    eventually(lambda: found(models, "scaled-group")[0]["spec"]["replicas"] == 3, "3 groups")
    assert leader_worker_set(models, "scaled-group")["metadata"]["uid"] == uid
