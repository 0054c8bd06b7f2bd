"""The chart lints clean and renders valid Kubernetes objects for every values scenario."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest
from support.chart import find, lint_chart, render_chart

# The oldest Kubernetes the chart supports (Chart.yaml kubeVersion; preStop `sleep` needs 1.30)
# and a recent one: kubernetes-validate ships schemas for both.
KUBERNETES_VERSIONS = ("1.30.0", "1.35.0")
# Custom resources of the Prometheus Operator: kubernetes-validate has no schema for CRD-typed
# objects, so their shape is checked by test_monitoring_objects_select_the_right_targets instead.
CUSTOM_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor"), ("monitoring.coreos.com/v1", "PodMonitor")}


def test_lint_is_clean(values: dict[str, Any]) -> None:
    assert lint_chart(values) == []


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_object_passes_strict_kubernetes_validation(
    manifests: list[dict[str, Any]], version: str
) -> None:
    failures = []
    for manifest in manifests:
        if (manifest["apiVersion"], manifest["kind"]) in CUSTOM_KINDS:
            continue
        try:
            kubernetes_validate.validate(manifest, version, strict=True)
        except kubernetes_validate.ValidationError as error:
            failures.append(f"{manifest['kind']}/{manifest['metadata']['name']}: {error.message}")
    assert failures == []


def test_every_object_is_namespaced_into_the_release_or_cluster_scoped(
    manifests: list[dict[str, Any]],
) -> None:
    cluster_scoped = {"CustomResourceDefinition", "ClusterRole", "ClusterRoleBinding"}
    watched = {"herd", "team-a"}
    for manifest in manifests:
        namespace = manifest["metadata"].get("namespace")
        assert (namespace is None) == (manifest["kind"] in cluster_scoped), manifest["metadata"]["name"]
        assert namespace is None or namespace in watched


def test_every_object_carries_the_standard_labels(manifests: list[dict[str, Any]]) -> None:
    for manifest in manifests:
        labels = manifest["metadata"]["labels"]
        assert labels["app.kubernetes.io/name"] == "herd"
        assert labels["app.kubernetes.io/instance"] == "herd"
        assert labels["app.kubernetes.io/managed-by"] == "Helm"
        assert labels["app.kubernetes.io/version"] == "0.1.0"
        assert "app.kubernetes.io/component" in labels


SHAPES = {
    "default": (
        {},
        {"Deployment": 2, "Service": 1, "PodDisruptionBudget": 0, "ServiceMonitor": 0, "PodMonitor": 0},
    ),
    "redis": ({"redis": {"enabled": True}}, {"Deployment": 3, "Service": 2}),
    "monitoring": ({"serviceMonitor": {"enabled": True}}, {"ServiceMonitor": 1, "PodMonitor": 1}),
    "monitoring-without-workers": (
        {"serviceMonitor": {"enabled": True, "workers": False}},
        {"ServiceMonitor": 1, "PodMonitor": 0},
    ),
    "pdb": ({"orchestrator": {"podDisruptionBudget": {"enabled": True}}}, {"PodDisruptionBudget": 1}),
    "no-crd": ({"crds": {"install": False}}, {"CustomResourceDefinition": 0}),
    "no-dashboards": ({"dashboards": {"enabled": False}}, {"ConfigMap": 0}),
    "existing-token": ({"internalToken": {"existingSecret": "my-token"}}, {"Secret": 0}),
    "no-service-accounts": (
        {
            "operator": {"serviceAccount": {"create": False}},
            "orchestrator": {"serviceAccount": {"create": False}},
        },
        {"ServiceAccount": 0},
    ),
}


@pytest.mark.parametrize(("overrides", "expected"), SHAPES.values(), ids=SHAPES.keys())
def test_optional_parts_follow_their_values(overrides: dict[str, Any], expected: dict[str, int]) -> None:
    manifests = render_chart(overrides)
    counts = {kind: len(find(manifests, kind)) for kind in expected}
    assert counts == expected


def test_install_order_puts_the_crd_and_accounts_before_workloads() -> None:
    kinds = [manifest["kind"] for manifest in render_chart(FULL_ORDER_VALUES)]
    assert kinds[0] == "CustomResourceDefinition"
    assert kinds.index("ServiceAccount") < kinds.index("ClusterRoleBinding") < kinds.index("Deployment")
    assert kinds[-2:] == ["ServiceMonitor", "PodMonitor"] or kinds[-2:] == ["PodMonitor", "ServiceMonitor"]


FULL_ORDER_VALUES: dict[str, Any] = {"serviceMonitor": {"enabled": True}, "redis": {"enabled": True}}


def test_monitoring_objects_select_the_right_targets() -> None:
    manifests = render_chart({"serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}}})
    (service_monitor,) = find(manifests, "ServiceMonitor")
    (service,) = find(manifests, "Service", "herd-orchestrator")
    assert service_monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert service_monitor["spec"]["endpoints"][0]["port"] == service["spec"]["ports"][0]["name"]
    assert service_monitor["metadata"]["labels"]["release"] == "prometheus"
    (pod_monitor,) = find(manifests, "PodMonitor")
    assert pod_monitor["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/managed-by": "herd"}
    assert pod_monitor["spec"]["namespaceSelector"] == {"any": True}
    assert pod_monitor["spec"]["podMetricsEndpoints"][0] == {
        "port": "http",
        "path": "/metrics",
        "interval": "30s",
        "scrapeTimeout": "10s",
        "relabelings": [
            {"sourceLabels": ["__meta_kubernetes_pod_label_herd_dev_role"], "targetLabel": "role"}
        ],
    }


def test_namespaced_monitoring_watches_only_the_listed_namespaces() -> None:
    values = {
        "serviceMonitor": {"enabled": True},
        "watch": {"allNamespaces": False, "namespaces": ["team-a"]},
    }
    (pod_monitor,) = find(render_chart(values), "PodMonitor")
    assert pod_monitor["spec"]["namespaceSelector"] == {"matchNames": ["team-a"]}
