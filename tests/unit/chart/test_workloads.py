"""The operator and orchestrator Deployments run the right commands with the right wiring."""

from __future__ import annotations

import base64
import string
from typing import Any

import helm_python as helm
import pytest
from support.chart import find, render_chart


def _container(manifests: list[dict[str, Any]], name: str) -> dict[str, Any]:
    (deployment,) = find(manifests, "Deployment", name)
    container: dict[str, Any] = deployment["spec"]["template"]["spec"]["containers"][0]
    return container


def _flag(args: list[str], flag: str) -> list[str]:
    """Every value given to ``flag``."""
    return [args[index + 1] for index, arg in enumerate(args) if arg == flag]


WATCH_SCOPES = {
    "all-namespaces": ({}, ["--all-namespaces"], []),
    "listed": (
        {"watch": {"allNamespaces": False, "namespaces": ["team-a"]}},
        ["--namespace", "team-a"],
        None,
    ),
    "release-namespace": ({"watch": {"allNamespaces": False}}, ["--namespace", "herd"], None),
}


@pytest.mark.parametrize(
    ("values", "operator_scope", "orchestrator_scope"), WATCH_SCOPES.values(), ids=WATCH_SCOPES.keys()
)
def test_operator_and_orchestrator_watch_the_configured_namespaces(
    values: dict[str, Any], operator_scope: list[str], orchestrator_scope: list[str] | None
) -> None:
    manifests = render_chart(values)
    operator_args = _container(manifests, "herd-operator")["args"]
    assert operator_args[: 1 + len(operator_scope)] == ["operator", *operator_scope]
    assert "--standalone" in operator_args
    # The orchestrator watches every namespace unless it is given one.
    expected = operator_scope if orchestrator_scope is None else orchestrator_scope
    orchestrator_args = _container(manifests, "herd-orchestrator")["args"]
    assert orchestrator_args[: 2 + len(expected)] == ["orchestrator", "--kubernetes", *expected]


def test_several_namespaces_are_refused_because_the_orchestrator_watches_one_or_all() -> None:
    with pytest.raises(
        helm.HelmRenderError, match=r"watches one or all: list one, or set watch\.allNamespaces=true"
    ):
        render_chart({"watch": {"allNamespaces": False, "namespaces": ["team-a", "team-b"]}})


def test_the_token_secret_is_copied_into_each_watched_namespace() -> None:
    secrets = find(render_chart({"watch": {"allNamespaces": False, "namespaces": ["team-a"]}}), "Secret")
    assert sorted(secret["metadata"]["namespace"] for secret in secrets) == ["herd", "team-a"]
    assert len({secret["data"]["token"] for secret in secrets}) == 1


REDIS = {
    "none": ({}, []),
    "in-cluster": ({"redis": {"enabled": True}}, ["redis://herd-redis.herd.svc:6379/0"]),
    "external": ({"redis": {"externalUrl": "rediss://cache:6380/2"}}, ["rediss://cache:6380/2"]),
}


@pytest.mark.parametrize(("values", "expected"), REDIS.values(), ids=REDIS.keys())
def test_orchestrator_gets_redis_only_when_there_is_one(values: dict[str, Any], expected: list[str]) -> None:
    manifests = render_chart(values)
    assert _flag(_container(manifests, "herd-orchestrator")["args"], "--redis") == expected
    assert len(find(manifests, "Service", "herd-redis")) == (values.get("redis", {}).get("enabled") is True)


def test_orchestrator_serves_on_its_port_with_probes_and_replicas() -> None:
    manifests = render_chart({"orchestrator": {"replicas": 3, "port": 8080}})
    (deployment,) = find(manifests, "Deployment", "herd-orchestrator")
    assert deployment["spec"]["replicas"] == 3
    container = _container(manifests, "herd-orchestrator")
    assert _flag(container["args"], "--port") == ["8080"]
    assert _flag(container["args"], "--host") == ["0.0.0.0"]
    assert container["ports"] == [{"name": "http", "containerPort": 8080, "protocol": "TCP"}]
    assert container["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    (service,) = find(manifests, "Service", "herd-orchestrator")
    assert service["spec"]["ports"][0]["targetPort"] == "http"


def _token_env(container: dict[str, Any]) -> dict[str, Any]:
    (entry,) = [env for env in container["env"] if env["name"] == "HERD_INTERNAL_TOKEN"]
    ref: dict[str, Any] = entry["valueFrom"]["secretKeyRef"]
    return ref


def test_generated_token_is_long_random_and_shared_by_both_components() -> None:
    manifests = render_chart({})
    (secret,) = find(manifests, "Secret")
    token = base64.b64decode(secret["data"]["token"]).decode()
    assert len(token) == 48 and set(token) <= set(string.ascii_letters + string.digits)
    assert _token_env(_container(manifests, "herd-orchestrator")) == {
        "name": secret["metadata"]["name"],
        "key": "token",
    }
    # The orchestrator reads it from the environment: neither the pod spec nor its argv holds it.
    assert "--internal-token" not in _container(manifests, "herd-orchestrator")["args"]
    (other,) = find(render_chart({}), "Secret")
    assert other["data"]["token"] != secret["data"]["token"]


def test_given_token_is_used_as_is() -> None:
    (secret,) = find(render_chart({"internalToken": {"value": "s3cret-token"}}), "Secret")
    assert base64.b64decode(secret["data"]["token"]) == b"s3cret-token"


def test_existing_token_secret_is_referenced_not_rendered() -> None:
    manifests = render_chart({"internalToken": {"existingSecret": "vault-token"}})
    assert find(manifests, "Secret") == []
    assert _token_env(_container(manifests, "herd-orchestrator"))["name"] == "vault-token"
    assert _flag(_container(manifests, "herd-operator")["args"], "--token-secret") == ["vault-token"]


def test_operator_is_told_the_worker_image_and_the_token_secret() -> None:
    values = {"worker": {"image": {"repository": "registry.local/herd-worker", "tag": "cuda-1"}}}
    args = _container(render_chart(values), "herd-operator")["args"]
    assert _flag(args, "--worker-image") == ["registry.local/herd-worker:cuda-1"]
    assert _flag(args, "--token-secret") == ["herd-internal-token"]


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ({}, "vllm/vllm-openai:v0.32.0"),
        (
            {"vllm": {"image": {"repository": "registry.local/vllm", "tag": "cu12"}}},
            "registry.local/vllm:cu12",
        ),
    ],
    ids=["default", "set"],
)
def test_operator_is_told_the_vllm_image(values: dict[str, Any], expected: str) -> None:
    args = _container(render_chart(values), "herd-operator")["args"]
    assert _flag(args, "--vllm-image") == [expected]


@pytest.mark.parametrize("replicas", [1, 0], ids=["runs", "kept-off"])
def test_operator_runs_alone_or_not_at_all(replicas: int) -> None:
    (deployment,) = find(render_chart({"operator": {"replicas": replicas}}), "Deployment", "herd-operator")
    assert deployment["spec"]["replicas"] == replicas
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}


def test_api_keys_are_mounted_from_their_secret() -> None:
    manifests = render_chart({"orchestrator": {"apiKeys": {"existingSecret": "keys", "key": "list"}}})
    container = _container(manifests, "herd-orchestrator")
    assert _flag(container["args"], "--api-keys-file") == ["/etc/herd/api-keys/list"]
    (deployment,) = find(manifests, "Deployment", "herd-orchestrator")
    volumes = deployment["spec"]["template"]["spec"]["volumes"]
    assert {"name": "api-keys", "secret": {"secretName": "keys"}} in volumes


SCHEDULING = {
    "nodeSelector": {"pool": "cpu"},
    "tolerations": [{"key": "k", "operator": "Exists"}],
    "affinity": {},
}


@pytest.mark.parametrize("component", ["operator", "orchestrator"])
def test_scheduling_values_reach_the_pod(component: str) -> None:
    (deployment,) = find(render_chart({component: SCHEDULING}), "Deployment", f"herd-{component}")
    spec = deployment["spec"]["template"]["spec"]
    assert spec["nodeSelector"] == SCHEDULING["nodeSelector"]
    assert spec["tolerations"] == SCHEDULING["tolerations"]
    assert "affinity" not in spec


BUDGETS = {
    "max-unavailable": ({"enabled": True}, {"maxUnavailable": 1}),
    "min-available-percent": (
        {"enabled": True, "maxUnavailable": None, "minAvailable": "50%"},
        {"minAvailable": "50%"},
    ),
}


@pytest.mark.parametrize(("budget", "expected"), BUDGETS.values(), ids=BUDGETS.keys())
def test_disruption_budget_bounds(budget: dict[str, Any], expected: dict[str, Any]) -> None:
    (pdb,) = find(render_chart({"orchestrator": {"podDisruptionBudget": budget}}), "PodDisruptionBudget")
    bounds = {key: value for key, value in pdb["spec"].items() if key != "selector"}
    assert bounds == expected
    assert pdb["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == "orchestrator"
