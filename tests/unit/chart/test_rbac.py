"""RBAC is least privilege: exactly what each component needs, no wildcards, namespaced on request."""

from __future__ import annotations

from typing import Any

import pytest
from support.chart import find, render_chart

ROLE_KINDS = ("ClusterRole", "Role")
# (apiGroup, resource, verb) the operator must be able to use: reconcile children, follow pods,
# write status and events.
OPERATOR_NEEDS = [("herd.dev", "modeldeployments", verb) for verb in ("get", "list", "watch", "patch")] + [
    ("herd.dev", "modeldeployments/status", "patch"),
    ("herd.dev", "modeldeployments/scale", "get"),
    *(("apps", "deployments", verb) for verb in ("get", "list", "watch", "create", "patch", "delete")),
    *(("", "services", verb) for verb in ("get", "list", "watch", "create", "patch", "delete")),
    *(("", "pods", verb) for verb in ("get", "list", "watch")),
    ("", "events", "create"),
]
ORCHESTRATOR_NEEDS = [("herd.dev", "modeldeployments", v) for v in ("get", "list", "watch")] + [
    ("", "pods", v) for v in ("get", "list", "watch")
]


def _rules(manifests: list[dict[str, Any]], name: str, namespace: str | None = None) -> list[dict[str, Any]]:
    roles = [role for kind in ROLE_KINDS for role in find(manifests, kind, name)]
    return [
        rule
        for role in roles
        if namespace is None or role["metadata"].get("namespace") in (None, namespace)
        for rule in role["rules"]
    ]


def _grants(rules: list[dict[str, Any]]) -> set[tuple[str, str, str]]:
    return {
        (group, resource, verb)
        for rule in rules
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def test_no_rule_uses_a_wildcard(manifests: list[dict[str, Any]]) -> None:
    for role in find(manifests, "ClusterRole") + find(manifests, "Role"):
        for rule in role["rules"]:
            fields = ("apiGroups", "resources", "verbs", "resourceNames", "nonResourceURLs")
            assert not any("*" in item for field in fields for item in rule.get(field, [])), rule


def test_operator_has_what_it_needs(manifests: list[dict[str, Any]]) -> None:
    namespace = "team-a" if find(manifests, "Role") else None
    missing = set(OPERATOR_NEEDS) - _grants(_rules(manifests, "herd-operator", namespace))
    assert missing == set()


def test_no_component_touches_secrets(manifests: list[dict[str, Any]]) -> None:
    # Worker pods and the orchestrator get the token through secretKeyRef, resolved by the kubelet.
    for role in find(manifests, "ClusterRole") + find(manifests, "Role"):
        assert not any("secrets" in rule["resources"] for rule in role["rules"]), role["metadata"]["name"]


def test_orchestrator_only_reads_models_and_pods(manifests: list[dict[str, Any]]) -> None:
    namespace = "team-a" if find(manifests, "Role") else None
    assert _grants(_rules(manifests, "herd-orchestrator", namespace)) == set(ORCHESTRATOR_NEEDS)


def test_namespaced_mode_grants_roles_only_in_the_watched_namespaces() -> None:
    manifests = render_chart({"watch": {"allNamespaces": False, "namespaces": ["team-a"]}})
    placements = sorted(
        (role["metadata"]["name"], role["metadata"]["namespace"]) for role in find(manifests, "Role")
    )
    assert placements == [
        ("herd-operator", "team-a"),
        ("herd-operator-demand", "herd"),
        ("herd-orchestrator", "team-a"),
    ]
    # In the release's namespace, left out of the watched ones, the operator reads only the orchestrator
    # Service and its pods: the requests they hold for pools at zero.
    (demand,) = find(manifests, "Role", "herd-operator-demand")
    assert _grants(demand["rules"]) == {("", "services", "get"), ("", "pods", "list")}
    # Only kopf's reads of CRDs and of namespace names stay cluster-wide: neither has a namespace.
    (cluster_role,) = find(manifests, "ClusterRole")
    assert _grants(cluster_role["rules"]) == {
        ("apiextensions.k8s.io", "customresourcedefinitions", verb) for verb in ("get", "list", "watch")
    } | {("", "namespaces", verb) for verb in ("list", "watch")}


def test_namespaced_mode_defaults_to_the_release_namespace() -> None:
    manifests = render_chart({"watch": {"allNamespaces": False}}, namespace="serving")
    assert {role["metadata"]["namespace"] for role in find(manifests, "Role")} == {"serving"}


@pytest.mark.parametrize("kind", ["ClusterRoleBinding", "RoleBinding"])
def test_bindings_name_the_accounts_the_pods_run_as(kind: str) -> None:
    values = {"watch": {"allNamespaces": kind == "ClusterRoleBinding"}}
    manifests = render_chart(values)
    accounts = {
        deployment["metadata"]["name"]: deployment["spec"]["template"]["spec"]["serviceAccountName"]
        for deployment in find(manifests, "Deployment")
    }
    for binding in find(manifests, kind):
        (subject,) = binding["subjects"]
        assert subject == {
            "kind": "ServiceAccount",
            "name": accounts[binding["metadata"]["name"].removesuffix("-demand")],
            "namespace": "herd",
        }
        assert binding["roleRef"]["name"] == binding["metadata"]["name"]
    assert {sa["metadata"]["name"] for sa in find(manifests, "ServiceAccount")} == set(accounts.values())
