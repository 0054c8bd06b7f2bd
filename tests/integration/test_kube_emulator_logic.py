"""The kube emulator's pure parts, table-driven: selectors, patches, paths, schemas, the event log."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from kmock import KubernetesError
from support.kube._events import EventLog, StoreEvent
from support.kube._names import check_labels, check_name, version_priority
from support.kube._patches import json_patch, merge_patch, strategic_merge_patch
from support.kube._paths import Route, parse_route
from support.kube._schema import apply_schema
from support.kube._selectors import parse_field_selector, parse_label_selector, selector_to_string
from support.kube._tables import json_path

LABELS = {"app": "web", "tier": "front", "env": "prod"}


@pytest.mark.parametrize(
    ("selector", "expected"),
    [
        ("", True),
        ("app=web", True),
        ("app==web", True),
        ("app!=web", False),
        ("app=web,tier=back", False),
        ("tier in (front, back)", True),
        ("tier in (back)", False),
        ("tier notin (back),env", True),
        ("missing notin (x)", True),
        ("missing", False),
        ("!missing", True),
        ("!app", False),
        ("app in (web,api),env!=dev,!missing", True),
    ],
    ids=[
        "empty",
        "equals",
        "double-equals",
        "not-equals",
        "and",
        "in",
        "not-in-set",
        "notin-and-exists",
        "notin-absent-key",
        "exists-absent",
        "not-exists",
        "not-exists-present",
        "mixed",
    ],
)
def test_label_selector(selector: str, expected: bool) -> None:
    assert parse_label_selector(selector).matches(LABELS) is expected


@pytest.mark.parametrize(
    "selector", ["a in b", "=x", "a=b=c"], ids=["set-without-parens", "no-key", "two-equals"]
)
def test_bad_label_selector_is_a_bad_request(selector: str) -> None:
    with pytest.raises(KubernetesError) as error:
        parse_label_selector(selector)
    assert error.value.status == 400


@pytest.mark.parametrize(
    ("selector", "expected"),
    [
        ("metadata.name=p", True),
        ("metadata.namespace==ns", True),
        ("status.phase!=Running", True),
        ("status.phase=Pending,metadata.name=q", False),
        ("spec.nodeName=", True),
    ],
    ids=["name", "namespace", "not-equals", "and", "missing-is-empty"],
)
def test_field_selector(selector: str, expected: bool) -> None:
    obj = {"metadata": {"name": "p", "namespace": "ns"}, "status": {"phase": "Pending"}}
    assert parse_field_selector(selector).matches(obj) is expected


def test_label_selector_objects_become_strings() -> None:
    selector = {
        "matchLabels": {"b": "2", "a": "1"},
        "matchExpressions": [
            {"key": "c", "operator": "In", "values": ["x", "y"]},
            {"key": "d", "operator": "DoesNotExist"},
        ],
    }
    assert selector_to_string(selector) == "a=1,b=2,c in (x,y),!d"


@pytest.mark.parametrize(
    ("target", "patch", "expected"),
    [
        ({"a": 1, "b": {"c": 2}}, {"b": {"d": 3}}, {"a": 1, "b": {"c": 2, "d": 3}}),
        ({"a": 1, "b": 2}, {"a": None}, {"b": 2}),
        ({"l": [1, 2]}, {"l": [3]}, {"l": [3]}),
        ({"a": {"b": 1}}, {"a": "x"}, {"a": "x"}),
    ],
    ids=["nested-merge", "null-deletes", "lists-replace", "scalar-replaces-object"],
)
def test_merge_patch(target: dict[str, Any], patch: dict[str, Any], expected: dict[str, Any]) -> None:
    assert merge_patch(target, patch) == expected


CONTAINERS = {"containers": [{"name": "a", "image": "a:1"}, {"name": "b", "image": "b:1"}]}


@pytest.mark.parametrize(
    ("patch", "expected"),
    [
        (
            {"containers": [{"name": "b", "image": "b:2"}]},
            [{"name": "a", "image": "a:1"}, {"name": "b", "image": "b:2"}],
        ),
        (
            {"containers": [{"name": "c", "image": "c:1"}]},
            [{"name": "a", "image": "a:1"}, {"name": "b", "image": "b:1"}, {"name": "c", "image": "c:1"}],
        ),
        ({"containers": [{"name": "a", "$patch": "delete"}]}, [{"name": "b", "image": "b:1"}]),
        (
            {
                "$setElementOrder/containers": [{"name": "b"}, {"name": "a"}],
                "containers": [{"name": "a", "image": "a:2"}],
            },
            [{"name": "a", "image": "a:2"}, {"name": "b", "image": "b:1"}],
        ),
    ],
    ids=["merge-by-name", "append-new-name", "patch-delete", "element-order-hint-ignored"],
)
def test_strategic_merge_patch(patch: dict[str, Any], expected: list[dict[str, Any]]) -> None:
    assert strategic_merge_patch(CONTAINERS, patch)["containers"] == expected


def test_strategic_merge_patch_replace_and_ports() -> None:
    target = {"spec": {"selector": {"a": "1", "b": "2"}, "ports": [{"containerPort": 80, "name": "http"}]}}
    patch = {"spec": {"selector": {"$patch": "replace", "c": "3"}, "ports": [{"containerPort": 81}]}}
    result = strategic_merge_patch(target, patch)
    assert result["spec"]["selector"] == {"c": "3"}
    assert result["spec"]["ports"] == [{"containerPort": 80, "name": "http"}, {"containerPort": 81}]


@pytest.mark.parametrize(
    ("ops", "expected"),
    [
        ([{"op": "add", "path": "/l/-", "value": 3}], {"a": {"b": 1}, "l": [1, 2, 3]}),
        ([{"op": "add", "path": "/l/0", "value": 0}], {"a": {"b": 1}, "l": [0, 1, 2]}),
        ([{"op": "remove", "path": "/a/b"}], {"a": {}, "l": [1, 2]}),
        ([{"op": "replace", "path": "/a/b", "value": 5}], {"a": {"b": 5}, "l": [1, 2]}),
        ([{"op": "move", "from": "/a/b", "path": "/c"}], {"a": {}, "l": [1, 2], "c": 1}),
        ([{"op": "copy", "from": "/l", "path": "/m"}], {"a": {"b": 1}, "l": [1, 2], "m": [1, 2]}),
        (
            [{"op": "test", "path": "/a/b", "value": 1}, {"op": "add", "path": "/a~1x", "value": 2}],
            {"a": {"b": 1}, "l": [1, 2], "a/x": 2},
        ),
    ],
    ids=["append", "insert", "remove", "replace", "move", "copy", "test-then-escaped-add"],
)
def test_json_patch(ops: list[dict[str, Any]], expected: dict[str, Any]) -> None:
    target = {"a": {"b": 1}, "l": [1, 2]}
    assert json_patch(target, ops) == expected
    assert target == {"a": {"b": 1}, "l": [1, 2]}


@pytest.mark.parametrize(
    ("ops", "status"),
    [
        ([{"op": "test", "path": "/a", "value": 2}], 422),
        ([{"op": "remove", "path": "/missing/x"}], 422),
        ([{"op": "frobnicate", "path": "/a"}], 400),
        ({"op": "add"}, 400),
    ],
    ids=["test-fails", "missing-path", "unknown-op", "not-a-list"],
)
def test_json_patch_errors(ops: Any, status: int) -> None:
    with pytest.raises(KubernetesError) as error:
        json_patch({"a": 1}, ops)
    assert error.value.status == status


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("/api/v1/pods", Route("", "v1", None, "pods")),
        ("/api/v1/namespaces", Route("", "v1", None, "namespaces")),
        ("/api/v1/namespaces/ns", Route("", "v1", None, "namespaces", "ns")),
        ("/api/v1/namespaces/ns/status", Route("", "v1", None, "namespaces", "ns", "status")),
        ("/api/v1/namespaces/ns/pods", Route("", "v1", "ns", "pods")),
        ("/api/v1/namespaces/ns/pods/p/status", Route("", "v1", "ns", "pods", "p", "status")),
        (
            "/apis/apps/v1/namespaces/ns/deployments/d/scale",
            Route("apps", "v1", "ns", "deployments", "d", "scale"),
        ),
        ("/apis/herd.dev/v1alpha1/modeldeployments", Route("herd.dev", "v1alpha1", None, "modeldeployments")),
        ("/api/v1", Route("", "v1")),
        ("/apis/apps", None),
        ("/version", None),
    ],
    ids=[
        "core-list",
        "namespaces",
        "namespace",
        "namespace-status",
        "namespaced-list",
        "status",
        "scale",
        "custom-all-namespaces",
        "core-version",
        "group",
        "other",
    ],
)
def test_parse_route(path: str, expected: Route | None) -> None:
    assert parse_route(path) == expected


def test_event_log_replays_after_a_version_and_refuses_compacted_ones() -> None:
    async def scenario() -> None:
        log = EventLog(size=3)
        for version in range(1, 6):
            log.append(StoreEvent(version, "ADDED", ("", "pods"), {}, None))
        assert [event.resource_version for event in log.since(3)] == [4, 5]
        assert log.since(5) == []
        with pytest.raises(KubernetesError) as error:
            log.since(1)
        assert error.value.status == 410

    asyncio.run(scenario())


SCHEMA = {
    "type": "object",
    "properties": {
        "spec": {
            "type": "object",
            "properties": {
                "replicas": {"type": "integer", "minimum": 0, "default": 1},
                "ratio": {"type": "number", "minimum": 0, "exclusiveMinimum": True},
                "note": {"type": "string", "nullable": True},
                "extra": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
                "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                "items": {
                    "type": "array",
                    "items": {"type": "object", "properties": {"n": {"type": "string"}}},
                },
            },
        },
    },
}


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ({}, {"replicas": 1}),
        ({"replicas": 3, "unknown": 1}, {"replicas": 3}),
        (
            {"note": None, "extra": {"anything": [1]}},
            {"replicas": 1, "note": None, "extra": {"anything": [1]}},
        ),
        (
            {"labels": {"a": "b"}, "items": [{"n": "x", "drop": 1}]},
            {"replicas": 1, "labels": {"a": "b"}, "items": [{"n": "x"}]},
        ),
    ],
    ids=["default", "prune-unknown", "nullable-and-preserved", "maps-and-lists"],
)
def test_schema_defaults_and_prunes(spec: dict[str, Any], expected: dict[str, Any]) -> None:
    obj = {"apiVersion": "x/v1", "kind": "X", "metadata": {"name": "n", "labels": {"k": "v"}}, "spec": spec}
    result = apply_schema(obj, SCHEMA, "X.x")
    assert result["spec"] == expected and result["metadata"] == obj["metadata"]


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({"replicas": -1}, "spec.replicas"),
        ({"ratio": 0}, "spec.ratio"),
        ({"labels": {"a": 1}}, "spec.labels.a"),
    ],
    ids=["minimum", "exclusive-minimum", "map-value-type"],
)
def test_schema_rejects_invalid_values_naming_the_field(spec: dict[str, Any], field: str) -> None:
    with pytest.raises(KubernetesError) as error:
        apply_schema({"metadata": {"name": "n"}, "spec": spec}, SCHEMA, "X.x")
    assert error.value.status == 422
    assert f'X.x "n" is invalid: {field}: Invalid value' in str(error.value.message)


@pytest.mark.parametrize(
    ("plural", "name", "is_valid"),
    [
        ("configmaps", "a.b-c", True),
        ("configmaps", "A", False),
        ("configmaps", "a_b", False),
        ("configmaps", "a" * 254, False),
        ("services", "web-1", True),
        ("services", "1web", False),
        ("services", "a.b", False),
        ("namespaces", "a" * 64, False),
    ],
    ids=[
        "subdomain",
        "upper-case",
        "underscore",
        "too-long",
        "service",
        "service-digit-first",
        "service-dot",
        "namespace-too-long",
    ],
)
def test_object_names(plural: str, name: str, is_valid: bool) -> None:
    if is_valid:
        check_name(plural, name)
    else:
        with pytest.raises(KubernetesError, match=r"metadata\.name"):
            check_name(plural, name)


@pytest.mark.parametrize(
    ("labels", "is_valid"),
    [
        ({"app.kubernetes.io/managed-by": "herd", "herd.dev/role": "unified", "empty": ""}, True),
        ({"k": "v" * 64}, False),
        ({"k": "-v"}, False),
        ({"Bad_Prefix/k": "v"}, False),
        ({"k" * 64: "v"}, False),
    ],
    ids=["valid", "value-too-long", "value-starts-with-dash", "bad-prefix", "name-too-long"],
)
def test_labels(labels: dict[str, str], is_valid: bool) -> None:
    if is_valid:
        check_labels(labels)
    else:
        with pytest.raises(KubernetesError, match=r"metadata\.labels"):
            check_labels(labels)


def test_version_priority_prefers_ga_then_beta_then_alpha() -> None:
    versions = ["v1alpha1", "v2beta1", "v1", "foo", "v1beta2", "v2", "v1beta1"]
    assert sorted(versions, key=version_priority) == [
        "v2",
        "v1",
        "v2beta1",
        "v1beta2",
        "v1beta1",
        "v1alpha1",
        "foo",
    ]


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        (".spec.mode", ["a"]),
        ('.status.conditions[?(@.type=="Ready")].status', ["True"]),
        (".status.conditions[1].type", ["Degraded"]),
        ("{.status.conditions[?(@.type=='Missing')].status}", []),
        (".spec.absent.deeper", []),
    ],
    ids=["dotted", "filter", "index", "filter-no-match-braced", "absent"],
)
def test_printer_column_json_path(path: str, expected: list[Any]) -> None:
    obj = {
        "spec": {"mode": "a"},
        "status": {
            "conditions": [{"type": "Ready", "status": "True"}, {"type": "Degraded", "status": "False"}]
        },
    }
    assert json_path(obj, path) == expected
