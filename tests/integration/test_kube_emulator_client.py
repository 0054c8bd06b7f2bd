"""The kube emulator through the ``kubernetes`` python client: what client code sees of its semantics."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import httpx
import kubernetes.client
import kubernetes.watch
import pytest
from kubernetes.client.rest import ApiException
from support.kube import Emulator
from support.kube.samples import WIDGET_CRD, pod

pytest_plugins = ["support.kube.fixtures"]


@pytest.fixture
def api(kube: Emulator) -> Iterator[kubernetes.client.ApiClient]:
    client = kube.api_client()
    yield client
    client.close()


def test_create_sets_server_metadata_and_answers_201(api: kubernetes.client.ApiClient) -> None:
    core = kubernetes.client.CoreV1Api(api)
    first, status, _ = core.create_namespaced_pod_with_http_info("default", pod("a"))
    second = core.create_namespaced_config_map("default", {"metadata": {"name": "b"}, "data": {"k": "v"}})
    assert status == 201
    assert first.metadata.uid and first.metadata.uid != second.metadata.uid
    assert int(second.metadata.resource_version) > int(first.metadata.resource_version)
    assert first.metadata.generation == 1 and first.metadata.creation_timestamp is not None
    assert first.status.phase == "Pending"


def test_errors_are_statuses_with_kubernetes_codes(api: kubernetes.client.ApiClient) -> None:
    core = kubernetes.client.CoreV1Api(api)
    core.create_namespaced_pod("default", pod("a"))
    with pytest.raises(ApiException) as exists:
        core.create_namespaced_pod("default", pod("a"))
    with pytest.raises(ApiException) as missing:
        core.read_namespaced_pod("nope", "default")
    with pytest.raises(ApiException) as no_namespace:
        core.create_namespaced_pod("nowhere", pod("a"))
    assert (exists.value.status, missing.value.status, no_namespace.value.status) == (409, 404, 404)
    assert '"reason": "AlreadyExists"' in exists.value.body


def test_stale_resource_version_is_a_conflict(api: kubernetes.client.ApiClient) -> None:
    core = kubernetes.client.CoreV1Api(api)
    stale = core.create_namespaced_config_map("default", {"metadata": {"name": "cm"}, "data": {"k": "1"}})
    fresh = core.read_namespaced_config_map("cm", "default")
    fresh.data = {"k": "2"}
    core.replace_namespaced_config_map("cm", "default", fresh)
    stale.data = {"k": "3"}
    with pytest.raises(ApiException) as put:
        core.replace_namespaced_config_map("cm", "default", stale)
    with pytest.raises(ApiException) as patch:
        core.patch_namespaced_config_map(
            "cm", "default", {"metadata": {"resourceVersion": "1"}, "data": {"k": "4"}}
        )
    assert (put.value.status, patch.value.status) == (409, 409)
    assert core.read_namespaced_config_map("cm", "default").data == {"k": "2"}


def test_generation_counts_spec_changes_only(api: kubernetes.client.ApiClient) -> None:
    apps = kubernetes.client.AppsV1Api(api)
    body = {
        "metadata": {"name": "d"},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"app": "d"}},
            "template": {
                "metadata": {"labels": {"app": "d"}},
                "spec": {"containers": [{"name": "c", "image": "x"}]},
            },
        },
    }
    apps.create_namespaced_deployment("default", body)
    apps.patch_namespaced_deployment("d", "default", {"metadata": {"labels": {"x": "y"}}})
    apps.patch_namespaced_deployment_status("d", "default", {"status": {"replicas": 1}})
    assert apps.read_namespaced_deployment("d", "default").metadata.generation == 1
    apps.patch_namespaced_deployment("d", "default", {"spec": {"replicas": 2}})
    assert apps.read_namespaced_deployment("d", "default").metadata.generation == 2


@pytest.mark.parametrize(
    ("selector", "expected"),
    [
        ("tier=web", ["a", "b"]),
        ("tier==web,env!=prod", ["b"]),
        ("env in (prod,dev)", ["a", "c"]),
        ("env notin (prod)", ["b", "c"]),
        ("env", ["a", "c"]),
        ("!env", ["b"]),
    ],
    ids=["equals", "double-equals-and-not-equals", "in", "notin", "exists", "not-exists"],
)
def test_list_with_label_selector(
    api: kubernetes.client.ApiClient, selector: str, expected: list[str]
) -> None:
    core = kubernetes.client.CoreV1Api(api)
    for body in (pod("a", tier="web", env="prod"), pod("b", tier="web"), pod("c", tier="db", env="dev")):
        core.create_namespaced_pod("default", body)
    listed = core.list_namespaced_pod("default", label_selector=selector)
    assert [item.metadata.name for item in listed.items] == expected


def test_list_with_field_selectors_kind_and_resource_version(
    kube: Emulator, api: kubernetes.client.ApiClient
) -> None:
    core = kubernetes.client.CoreV1Api(api)
    kube.create_namespace("other")
    for namespace, name in (("default", "a"), ("default", "b"), ("other", "a")):
        core.create_namespaced_pod(namespace, pod(name))
    kube.set_pod_ready("default", "b")
    raw = httpx.get(f"{kube.url}/api/v1/pods").json()
    assert raw["kind"] == "PodList" and int(raw["metadata"]["resourceVersion"]) >= 6
    by_name = core.list_pod_for_all_namespaces(field_selector="metadata.name=a").items
    assert sorted(item.metadata.namespace for item in by_name) == ["default", "other"]
    running = core.list_pod_for_all_namespaces(
        field_selector="status.phase=Running,metadata.namespace=default"
    )
    assert [item.metadata.name for item in running.items] == ["b"]


def test_watch_streams_added_modified_deleted(api: kubernetes.client.ApiClient) -> None:
    core = kubernetes.client.CoreV1Api(api)
    listed = core.list_namespaced_config_map("default")
    events: list[tuple[str, str]] = []

    def consume() -> None:
        watch = kubernetes.watch.Watch()
        for event in watch.stream(
            core.list_namespaced_config_map,
            "default",
            timeout_seconds=60,  # it stops at DELETED; the bound only matters when events go missing
            resource_version=listed.metadata.resource_version,
        ):
            events.append((event["type"], event["object"].metadata.name))
            if event["type"] == "DELETED":
                watch.stop()

    core.create_namespaced_config_map("default", {"metadata": {"name": "early"}})  # before the watch connects
    consumer = threading.Thread(target=consume)
    consumer.start()
    core.patch_namespaced_config_map("early", "default", {"data": {"k": "v"}})
    core.delete_namespaced_config_map("early", "default")
    consumer.join(60)
    assert events == [("ADDED", "early"), ("MODIFIED", "early"), ("DELETED", "early")]


def test_watch_translates_selector_moves_and_ends_at_timeout(api: kubernetes.client.ApiClient) -> None:
    core = kubernetes.client.CoreV1Api(api)
    core.create_namespaced_pod("default", pod("p", role="worker"))
    start = core.list_namespaced_pod("default").metadata.resource_version
    core.patch_namespaced_pod("p", "default", {"metadata": {"labels": {"role": "idle"}}})
    core.patch_namespaced_pod("p", "default", {"metadata": {"labels": {"role": "worker"}}})
    watch = kubernetes.watch.Watch()
    stream = watch.stream(
        core.list_namespaced_pod,
        "default",
        label_selector="role=worker",
        resource_version=start,
        timeout_seconds=1,
    )
    assert [event["type"] for event in stream] == ["DELETED", "ADDED"]


def test_status_subresource_is_separate_from_the_main_resource(api: kubernetes.client.ApiClient) -> None:
    core = kubernetes.client.CoreV1Api(api)
    core.create_namespaced_pod("default", pod("p"))
    core.patch_namespaced_pod(
        "p", "default", {"status": {"phase": "Failed"}, "metadata": {"labels": {"a": "b"}}}
    )
    core.patch_namespaced_pod_status(
        "p", "default", {"status": {"phase": "Running"}, "metadata": {"labels": {}}}
    )
    fetched = core.read_namespaced_pod("p", "default")
    assert fetched.status.phase == "Running" and fetched.metadata.labels == {"a": "b"}


def test_finalizers_hold_deletion_until_removed(kube: Emulator, api: kubernetes.client.ApiClient) -> None:
    core = kubernetes.client.CoreV1Api(api)
    core.create_namespaced_config_map(
        "default", {"metadata": {"name": "held", "finalizers": ["example.dev/x"]}}
    )
    core.delete_namespaced_config_map("held", "default")
    assert kube.get("configmaps", "held")["metadata"]["deletionTimestamp"]
    core.patch_namespaced_config_map("held", "default", {"metadata": {"finalizers": None}})
    assert kube.find("configmaps", "held") is None


def test_no_new_finalizers_on_a_deleting_object(kube: Emulator, api: kubernetes.client.ApiClient) -> None:
    core = kubernetes.client.CoreV1Api(api)
    core.create_namespaced_config_map("default", {"metadata": {"name": "held", "finalizers": ["a.dev/x"]}})
    core.delete_namespaced_config_map("held", "default")
    with pytest.raises(ApiException) as added:
        core.patch_namespaced_config_map(
            "held", "default", {"metadata": {"finalizers": ["a.dev/x", "a.dev/y"]}}
        )
    assert added.value.status == 422
    assert kube.get("configmaps", "held")["metadata"]["finalizers"] == ["a.dev/x"]


def test_delete_preconditions_must_match(kube: Emulator, api: kubernetes.client.ApiClient) -> None:
    core = kubernetes.client.CoreV1Api(api)
    created = core.create_namespaced_config_map("default", {"metadata": {"name": "cm"}})
    stale = kubernetes.client.V1DeleteOptions(preconditions=kubernetes.client.V1Preconditions(uid="other"))
    with pytest.raises(ApiException) as failed:
        core.delete_namespaced_config_map("cm", "default", body=stale)
    assert failed.value.status == 409 and kube.find("configmaps", "cm") is not None
    current = kubernetes.client.V1Preconditions(
        uid=created.metadata.uid, resource_version=created.metadata.resource_version
    )
    core.delete_namespaced_config_map(
        "cm", "default", body=kubernetes.client.V1DeleteOptions(preconditions=current)
    )
    assert kube.find("configmaps", "cm") is None


def test_deleting_an_owner_collects_its_dependents(kube: Emulator, api: kubernetes.client.ApiClient) -> None:
    core = kubernetes.client.CoreV1Api(api)
    owner = core.create_namespaced_config_map("default", {"metadata": {"name": "owner"}})
    ref = {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner.metadata.uid}
    core.create_namespaced_config_map("default", {"metadata": {"name": "child", "ownerReferences": [ref]}})
    core.create_namespaced_secret("default", {"metadata": {"name": "kept", "ownerReferences": [ref]}})
    core.delete_namespaced_secret("kept", "default")  # gone already: the collection must not trip on it
    core.create_namespaced_secret("default", {"metadata": {"name": "orphan", "ownerReferences": [ref]}})
    core.delete_namespaced_config_map("owner", "default", propagation_policy="Background")
    assert kube.find("configmaps", "child") is None and kube.find("secrets", "orphan") is None


def test_orphan_propagation_keeps_dependents(kube: Emulator, api: kubernetes.client.ApiClient) -> None:
    core = kubernetes.client.CoreV1Api(api)
    owner = core.create_namespaced_config_map("default", {"metadata": {"name": "owner"}})
    ref = {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner.metadata.uid}
    core.create_namespaced_config_map("default", {"metadata": {"name": "child", "ownerReferences": [ref]}})
    core.delete_namespaced_config_map("owner", "default", propagation_policy="Orphan")
    assert kube.get("configmaps", "child")["metadata"]["ownerReferences"] == []


def test_crd_makes_its_resource_servable_with_status_and_scale(api: kubernetes.client.ApiClient) -> None:
    kubernetes.client.ApiextensionsV1Api(api).create_custom_resource_definition(WIDGET_CRD)
    custom = kubernetes.client.CustomObjectsApi(api)
    body = {
        "apiVersion": "example.dev/v1",
        "kind": "Widget",
        "metadata": {"name": "w"},
        "spec": {"replicas": 1},
    }
    custom.create_namespaced_custom_object("example.dev", "v1", "default", "widgets", body)
    custom.patch_namespaced_custom_object_status(
        "example.dev", "v1", "default", "widgets", "w", {"status": {"replicas": 1, "selector": "app=w"}}
    )
    scale = custom.patch_namespaced_custom_object_scale(
        "example.dev", "v1", "default", "widgets", "w", {"spec": {"replicas": 4}}
    )
    widget = custom.get_namespaced_custom_object("example.dev", "v1", "default", "widgets", "w")
    assert scale["spec"] == {"replicas": 4} and scale["status"] == {"replicas": 1, "selector": "app=w"}
    assert widget["spec"]["replicas"] == 4 and widget["metadata"]["generation"] == 2
    resources = kubernetes.client.ApisApi(api).get_api_versions()
    assert "example.dev" in [group.name for group in resources.groups]


@pytest.mark.parametrize(
    ("content_type", "patch", "expected_env"),
    [
        ("application/merge-patch+json", {"spec": {"containers": [{"name": "main", "image": "b"}]}}, None),
        (
            "application/strategic-merge-patch+json",
            {"spec": {"containers": [{"name": "main", "env": [{"name": "E", "value": "1"}]}]}},
            [{"name": "E", "value": "1"}],
        ),
        ("application/json-patch+json", [{"op": "add", "path": "/spec/containers/0/env", "value": []}], []),
    ],
    ids=["merge-replaces-lists", "strategic-merges-by-name", "json-patch"],
)
def test_patch_flavours(
    kube: Emulator, content_type: str, patch: Any, expected_env: list[Any] | None
) -> None:
    kube.create(pod("p"))
    response = _patch(kube, "/api/v1/namespaces/default/pods/p", patch, content_type)
    assert response.status_code == 200
    assert response.json()["spec"]["containers"][0].get("env") == expected_env


def test_failed_json_patch_test_is_unprocessable(kube: Emulator) -> None:
    kube.create({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "cm"}})
    ops = [
        {"op": "test", "path": "/metadata/resourceVersion", "value": "1"},
        {"op": "remove", "path": "/metadata"},
    ]
    response = _patch(kube, "/api/v1/namespaces/default/configmaps/cm", ops, "application/json-patch+json")
    assert response.status_code == 422 and response.json()["reason"] == "Invalid"
    assert kube.get("configmaps", "cm")["metadata"]["name"] == "cm"


def _patch(kube: Emulator, path: str, body: Any, content_type: str) -> httpx.Response:
    return httpx.patch(f"{kube.url}{path}", json=body, headers={"Content-Type": content_type})
