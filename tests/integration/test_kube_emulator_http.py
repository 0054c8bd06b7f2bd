"""The kube emulator over raw HTTP: watch details, cascades, refusals, fault injection and helpers."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import kmock
import pytest
from support.kube import Emulator, kube_emulator
from support.kube.samples import WIDGET_CRD, pod

pytest_plugins = ["support.kube.fixtures"]


def _watch(kube: Emulator, path: str, **params: str) -> list[dict[str, Any]]:
    """Every event of a watch that the server ends after one second."""
    query = {"timeoutSeconds": "1", **params}
    with httpx.stream("GET", f"{kube.url}{path}", params=query, timeout=10) as response:
        assert response.status_code == 200
        return [json.loads(line) for line in response.iter_lines() if line]


def _configmap(name: str, **labels: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, "labels": labels}}


def _deployment(name: str, replicas: int) -> dict[str, Any]:
    labels = {"app": name}
    spec = {"containers": [{"name": "main", "image": "busybox"}]}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": labels}, "spec": spec},
        },
    }


@pytest.mark.parametrize("spelling", ["true", "1", "True"], ids=["kubectl", "one", "python-client"])
def test_watch_spellings_start_with_what_exists(kube: Emulator, spelling: str) -> None:
    kube.create(_configmap("a"))
    events = _watch(kube, "/api/v1/namespaces/default/configmaps", watch=spelling)
    assert [(event["type"], event["object"]["metadata"]["name"]) for event in events] == [("ADDED", "a")]
    assert events[0]["object"]["kind"] == "ConfigMap"


def test_initial_events_end_with_a_bookmark(kube: Emulator) -> None:
    kube.create(_configmap("a"))
    events = _watch(
        kube,
        "/api/v1/configmaps",
        watch="true",
        sendInitialEvents="true",
        resourceVersionMatch="NotOlderThan",
        allowWatchBookmarks="true",
    )
    assert [event["type"] for event in events] == ["ADDED", "BOOKMARK"]
    assert events[1]["object"]["metadata"]["annotations"] == {"k8s.io/initial-events-end": "true"}


def test_watch_of_one_object_sees_only_it(kube: Emulator) -> None:
    start = kube.create(_configmap("a"))["metadata"]["resourceVersion"]
    kube.create(_configmap("b"))
    kube.patch("configmaps", "a", {"data": {"k": "v"}})
    events = _watch(kube, "/api/v1/namespaces/default/configmaps/a", watch="true", resourceVersion=start)
    assert [(event["type"], event["object"]["metadata"]["name"]) for event in events] == [("MODIFIED", "a")]


def test_watch_sees_writes_made_while_it_waits(kube: Emulator) -> None:
    start = kube.resource_version
    query = {"watch": "true", "resourceVersion": start, "timeoutSeconds": "60"}
    url = f"{kube.url}/api/v1/namespaces/default/configmaps"
    with httpx.stream("GET", url, params=query, timeout=60) as response:
        assert response.status_code == 200
        kube.create(_configmap("late"))  # the watch is open: its headers came
        event = json.loads(next(line for line in response.iter_lines() if line))
    assert (event["type"], event["object"]["metadata"]["name"]) == ("ADDED", "late")


def test_deleting_a_namespace_deletes_its_objects(kube: Emulator) -> None:
    kube.create_namespace("team")
    kube.create({**_configmap("a"), "metadata": {"name": "a", "namespace": "team"}})
    kube.create(_configmap("a"))
    kube.delete("namespaces", "team")
    assert [cm["metadata"]["namespace"] for cm in kube.list("configmaps")] == ["default"]
    response = httpx.post(f"{kube.url}/api/v1/namespaces/team/configmaps", json=_configmap("b"))
    assert response.status_code == 404


def test_deleting_a_crd_removes_its_objects_and_endpoints(kube: Emulator) -> None:
    kube.apply(WIDGET_CRD)
    kube.create({"apiVersion": "example.dev/v1", "kind": "Widget", "metadata": {"name": "w"}})
    kube.delete("crd", "widgets.example.dev")
    assert httpx.get(f"{kube.url}/apis/example.dev/v1/namespaces/default/widgets").status_code == 404
    groups = httpx.get(f"{kube.url}/apis").json()["groups"]
    assert "example.dev" not in [group["name"] for group in groups]


def test_crd_is_established_and_discoverable_with_subresources(kube: Emulator) -> None:
    crd = kube.apply(WIDGET_CRD)
    conditions = {c["type"]: c["status"] for c in crd["status"]["conditions"]}
    assert conditions == {"NamesAccepted": "True", "Established": "True"}
    resources = httpx.get(f"{kube.url}/apis/example.dev/v1").json()["resources"]
    assert [entry["name"] for entry in resources] == ["widgets", "widgets/status", "widgets/scale"]
    assert resources[0]["shortNames"] == ["wd"] and resources[0]["namespaced"] is True


def test_crd_versions_share_storage_and_ga_is_preferred(kube: Emulator) -> None:
    crd = json.loads(json.dumps(WIDGET_CRD))
    alpha = {**crd["spec"]["versions"][0], "name": "v1alpha1", "storage": False}
    crd["spec"]["versions"] = [alpha, crd["spec"]["versions"][0]]
    kube.apply(crd)
    body = {
        "apiVersion": "example.dev/v1alpha1",
        "kind": "Widget",
        "metadata": {"name": "w"},
        "spec": {"a": 1},
    }
    assert (
        httpx.post(f"{kube.url}/apis/example.dev/v1alpha1/namespaces/default/widgets", json=body).status_code
        == 201
    )
    fetched = httpx.get(f"{kube.url}/apis/example.dev/v1/namespaces/default/widgets/w").json()
    assert (fetched["apiVersion"], fetched["spec"]) == ("example.dev/v1", {"a": 1})
    group = httpx.get(f"{kube.url}/apis/example.dev").json()
    assert group["preferredVersion"]["version"] == "v1"
    assert [version["version"] for version in group["versions"]] == ["v1", "v1alpha1"]


def test_invalid_names_and_labels_are_refused(kube: Emulator) -> None:
    long_value = "x" * 64
    bad_label = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "ok", "labels": {"k": long_value}},
    }
    for body in ({"metadata": {"name": "Not_Valid"}}, bad_label):
        response = httpx.post(f"{kube.url}/api/v1/namespaces/default/configmaps", json=body)
        assert response.status_code == 422 and "Invalid value" in response.json()["message"]
    kube.create(_configmap("ok"))
    patch = {"metadata": {"labels": {"k": long_value}}}
    response = httpx.patch(
        f"{kube.url}/api/v1/namespaces/default/configmaps/ok",
        json=patch,
        headers={"Content-Type": "application/merge-patch+json"},
    )
    assert response.status_code == 422


def test_delete_collection_by_label(kube: Emulator) -> None:
    for name, tier in (("a", "web"), ("b", "web"), ("c", "db")):
        kube.create(_configmap(name, tier=tier))
    response = httpx.delete(
        f"{kube.url}/api/v1/namespaces/default/configmaps", params={"labelSelector": "tier=web"}
    )
    assert response.status_code == 200
    assert [cm["metadata"]["name"] for cm in kube.list("configmaps")] == ["c"]


@pytest.mark.parametrize(
    ("request_kwargs", "status"),
    [
        ({"params": {"dryRun": "All"}, "json": _configmap("x")}, 400),
        ({"content": b"k8s\x00", "headers": {"Content-Type": "application/vnd.kubernetes.protobuf"}}, 415),
        ({"json": {"metadata": {}}}, 422),
        ({"json": {"metadata": {"name": "x", "namespace": "other"}}}, 400),
    ],
    ids=["dry-run", "protobuf", "no-name", "namespace-mismatch"],
)
def test_refusals_say_why(kube: Emulator, request_kwargs: dict[str, Any], status: int) -> None:
    response = httpx.post(f"{kube.url}/api/v1/namespaces/default/configmaps", **request_kwargs)
    assert response.status_code == status
    assert response.json()["kind"] == "Status" and response.json()["message"]


def test_strategic_merge_patch_is_refused_for_custom_resources(kube: Emulator) -> None:
    kube.apply(WIDGET_CRD)
    kube.create({"apiVersion": "example.dev/v1", "kind": "Widget", "metadata": {"name": "w"}})
    response = httpx.patch(
        f"{kube.url}/apis/example.dev/v1/namespaces/default/widgets/w",
        json={"spec": {"a": 1}},
        headers={"Content-Type": "application/strategic-merge-patch+json"},
    )
    assert response.status_code == 415 and "merge-patch+json" in response.json()["message"]


def test_apply_yaml_installs_a_chart_like_bundle(kube: Emulator) -> None:
    bundle = """
apiVersion: v1
kind: Namespace
metadata: {name: herd-system}
---
apiVersion: v1
kind: ServiceAccount
metadata: {name: operator, namespace: herd-system}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: herd-operator}
rules: [{apiGroups: [herd.dev], resources: [modeldeployments], verbs: [get, list, watch]}]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: herd-operator}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: herd-operator}
subjects: [{kind: ServiceAccount, name: operator, namespace: herd-system}]
---
apiVersion: coordination.k8s.io/v1
kind: Lease
metadata: {name: herd-operator, namespace: herd-system}
spec: {holderIdentity: me}
"""
    applied = kube.apply_yaml(bundle)
    assert [obj["kind"] for obj in applied] == [
        "Namespace",
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "Lease",
    ]
    assert "namespace" not in kube.get("clusterroles", "herd-operator")["metadata"]
    assert kube.get("leases", "herd-operator", "herd-system")["spec"] == {"holderIdentity": "me"}


def test_generate_name(kube: Emulator) -> None:
    made = kube.create({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"generateName": "cfg-"}})
    assert made["metadata"]["name"].startswith("cfg-") and len(made["metadata"]["name"]) == 9


def test_kmock_reactions_inject_faults_and_record_requests(kube: Emulator) -> None:
    kube.kmock["get /api/v1/namespaces/default/configmaps/flaky"] << 503
    kube.create(_configmap("flaky"))
    assert httpx.get(f"{kube.url}/api/v1/namespaces/default/configmaps/flaky").status_code == 503
    assert httpx.get(f"{kube.url}/api/v1/namespaces/default/configmaps").status_code == 200
    assert len(kube.kmock[kmock.resource("", "v1", "configmaps")]) == 2


def test_deployment_status_follows_ready_pods(kube: Emulator) -> None:
    kube.create(_deployment("d", replicas=2))
    for name in ("d-1", "d-2"):
        kube.create(pod(name, app="d"))
    kube.create(pod("other", app="x"))
    kube.set_pod_ready("default", "d-1", pod_ip="127.0.0.2")
    status = kube.sync_deployment_status("default", "d")["status"]
    assert (status["replicas"], status["readyReplicas"], status["conditions"][0]["status"]) == (2, 1, "False")
    assert kube.get("pods", "d-1")["status"]["podIP"] == "127.0.0.2"
    kube.set_pod_ready("default", "d-2")
    assert kube.sync_deployment_status("default", "d")["status"]["readyReplicas"] == 2


def test_run_deployment_makes_owned_ready_pods_and_follows_scale(kube: Emulator) -> None:
    kube.create(_deployment("d", replicas=3))
    started = kube.run_deployment("default", "d", pod_ips=["127.0.0.2", "127.0.0.3"])
    assert [(p["metadata"]["name"], p["status"]["podIP"]) for p in started] == [
        ("d-0", "127.0.0.2"),
        ("d-1", "127.0.0.3"),
        ("d-2", "127.0.0.1"),
    ]
    assert started[0]["metadata"]["labels"] == {"app": "d"}
    assert kube.get("deployments.apps", "d")["status"]["readyReplicas"] == 3
    kube.patch("deployments.apps", "d", {"spec": {"replicas": 1}})
    assert [p["metadata"]["name"] for p in kube.run_deployment("default", "d", ready=False)] == ["d-0"]
    assert kube.get("deployments.apps", "d")["status"]["readyReplicas"] == 0
    kube.delete("deployments.apps", "d")
    assert kube.list("pods") == []


def test_terminate_pod_leaves_it_terminating_until_released(kube: Emulator) -> None:
    kube.create(pod("p", app="w"))
    kube.set_pod_ready("default", "p")
    terminating = kube.terminate_pod("default", "p")
    assert terminating["metadata"]["deletionTimestamp"] and kube.list("pods", label_selector="app=w")
    assert kube.release("pods", "p") is None
    assert kube.find("pods", "p") is None


def test_stopping_ends_open_watches_promptly(tmp_path_factory: pytest.TempPathFactory) -> None:
    with kube_emulator(tmp_path_factory.mktemp("kube")) as kube:
        stream = httpx.stream("GET", f"{kube.url}/api/v1/pods", params={"watch": "true"}, timeout=10)
        response = stream.__enter__()
        started = time.monotonic()
    assert time.monotonic() - started < 15  # a watch left open would hold the stop for the emulator's 30 s
    assert list(response.iter_lines()) == []
    stream.__exit__(None, None, None)
