"""The workers' NetworkPolicy: only the orchestrator, the operator's scrapes, Prometheus and peer workers
reach worker ports, in every namespace that runs workers; it validates and can be turned off."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest
from support.chart import find, render_chart

from herd.api.crd import ModelDeployment
from herd.operator.plan import plan
from herd.operator.settings import PlanSettings

RESTRICTED: dict[str, Any] = {
    "networkPolicy": {
        "egress": {
            "restrict": True,
            "extra": [{"ports": [{"port": 443, "protocol": "TCP"}]}],
        },
        "prometheus": {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
            "podSelector": {"matchLabels": {"app": "prom"}},
        },
    }
}


def planned_worker_pod() -> dict[str, Any]:
    """The pod template the operator plans for a disaggregated model's prefill pool."""
    md = ModelDeployment.model_validate(
        {
            "apiVersion": "herd.dev/v1alpha1",
            "kind": "ModelDeployment",
            "metadata": {"name": "chat", "namespace": "herd"},
            "spec": {
                "model": {"source": "file:///w"},
                "serving": {"mode": "disaggregated"},
                "prefill": {"replicas": 1},
                "decode": {"replicas": 1},
            },
        }
    )
    objects = plan(md, PlanSettings()).objects
    (deployment,) = [o.body for o in objects if o.kind == "Deployment" and o.name == "chat-prefill"]
    template: dict[str, Any] = deployment["spec"]["template"]
    return template


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A label selector's matchLabels and Exists / In expressions against a pod's labels."""
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for expression in selector.get("matchExpressions", []):
        key, operator = expression["key"], expression["operator"]
        if operator == "Exists" and key not in labels:
            return False
        if operator == "In" and labels.get(key) not in expression["values"]:
            return False
    return True


def pod_labels(manifests: list[dict[str, Any]], deployment: str) -> dict[str, str]:
    (found,) = find(manifests, "Deployment", deployment)
    labels: dict[str, str] = found["spec"]["template"]["metadata"]["labels"]
    return labels


@pytest.mark.parametrize(
    ("values", "namespaces"),
    [
        ({}, ["herd"]),
        ({"watch": {"allNamespaces": False, "namespaces": ["team-a"]}}, ["herd", "team-a"]),
        ({"networkPolicy": {"enabled": False}}, []),
    ],
    ids=["default", "namespaced", "off"],
)
def test_a_policy_in_every_namespace_that_runs_workers(values: dict[str, Any], namespaces: list[str]) -> None:
    policies = find(render_chart(values), "NetworkPolicy")
    assert sorted(policy["metadata"]["namespace"] for policy in policies) == namespaces


@pytest.mark.parametrize("values", [{}, RESTRICTED], ids=["ingress-only", "egress-restricted"])
@pytest.mark.parametrize("version", ["1.30.0", "1.35.0"])
def test_the_policy_passes_strict_kubernetes_validation(values: dict[str, Any], version: str) -> None:
    (policy,) = find(render_chart(values), "NetworkPolicy")
    kubernetes_validate.validate(policy, version, strict=True)


def test_it_selects_the_worker_pods_the_operator_plans_and_admits_only_herd_and_prometheus() -> None:
    manifests = render_chart(RESTRICTED)
    (policy,) = find(manifests, "NetworkPolicy")
    spec = policy["spec"]
    worker = planned_worker_pod()
    assert selects(spec["podSelector"], worker["metadata"]["labels"])
    assert not selects(spec["podSelector"], pod_labels(manifests, "herd-orchestrator"))
    worker_ports = {port["name"] for port in worker["spec"]["containers"][0]["ports"]}
    admitted = {}  # which ports each kind of peer may reach
    for rule in spec["ingress"]:
        ports = {port["port"] for port in rule["ports"]}
        assert ports <= worker_ports, "a rule names a port the worker container does not have"
        for peer in rule["from"]:
            if selects(peer["podSelector"], pod_labels(manifests, "herd-orchestrator")):
                admitted["orchestrator"] = ports
            elif selects(peer["podSelector"], pod_labels(manifests, "herd-operator")):
                admitted["operator"] = ports
            elif selects(peer["podSelector"], worker["metadata"]["labels"]):
                admitted["workers"] = ports
            else:
                assert peer == RESTRICTED["networkPolicy"]["prometheus"]
                admitted["prometheus"] = ports
    assert admitted == {
        "orchestrator": {"http", "internal"},
        "operator": {"http"},  # the autoscaler scrapes /metrics
        "prometheus": {"http"},
        "workers": {"internal"},  # KV blocks between prefill and decode workers
    }


def test_prometheus_defaults_to_its_operators_pod_label() -> None:
    (policy,) = find(render_chart({}), "NetworkPolicy")
    scrapers = policy["spec"]["ingress"][1]["from"]
    assert {
        "namespaceSelector": {},
        "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
    } in scrapers


def test_the_orchestrator_and_operator_are_admitted_from_the_release_namespace_only() -> None:
    manifests = render_chart({"watch": {"allNamespaces": False, "namespaces": ["team-a"]}})
    herd_pods = [pod_labels(manifests, name) for name in ("herd-orchestrator", "herd-operator")]
    checked = 0
    for policy in find(manifests, "NetworkPolicy"):
        for rule in policy["spec"]["ingress"]:
            for peer in rule["from"]:
                if any(selects(peer["podSelector"], labels) for labels in herd_pods):
                    assert peer["namespaceSelector"] == {
                        "matchLabels": {"kubernetes.io/metadata.name": "herd"}
                    }
                    checked += 1
    assert checked == 4  # orchestrator and operator, in the release's and team-a's policies


def test_restricted_egress_allows_dns_peers_and_the_extra_rules() -> None:
    (policy,) = find(render_chart(RESTRICTED), "NetworkPolicy")
    assert policy["spec"]["policyTypes"] == ["Ingress", "Egress"]
    dns, peers, extra = policy["spec"]["egress"]
    assert {(port["port"], port["protocol"]) for port in dns["ports"]} == {(53, "UDP"), (53, "TCP")}
    assert dns["to"] == [{"namespaceSelector": {}, "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}}}]
    assert peers["ports"] == [{"port": "internal", "protocol": "TCP"}]
    assert extra == {"ports": [{"port": 443, "protocol": "TCP"}]}
    (default,) = find(render_chart({}), "NetworkPolicy")
    assert default["spec"]["policyTypes"] == ["Ingress"] and "egress" not in default["spec"]
