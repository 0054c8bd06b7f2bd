"""Drift detection: a changed spec hash or an edited owned field is drift; server defaults are not."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from herd.api.crd import ModelDeployment
from herd.operator.drift import is_drifted, is_subset, replacement
from herd.operator.plan import ANNOTATION_SPEC_HASH, plan
from herd.operator.settings import PlanSettings

MD = ModelDeployment.model_validate(
    {
        "apiVersion": "herd.dev/v1alpha1",
        "kind": "ModelDeployment",
        "metadata": {"name": "chat"},
        "spec": {"model": {"source": "file:///w"}, "workers": {"replicas": 2}},
    }
)
DEPLOYMENT, SERVICE = (obj.body for obj in plan(MD, PlanSettings()).objects)


def as_served(desired: dict[str, Any]) -> dict[str, Any]:
    """What the API server hands back: the desired body plus defaults and bookkeeping."""
    served = copy.deepcopy(desired)
    served["metadata"].update(uid="u1", resourceVersion="7")
    served["metadata"]["labels"]["added-by-someone"] = "x"
    served["spec"].setdefault("revisionHistoryLimit", 10)
    for container in served["spec"].get("template", {}).get("spec", {}).get("containers", []):
        container["terminationMessagePath"] = "/dev/termination-log"
    if served["kind"] == "Service":
        served["spec"]["clusterIPs"] = ["None"]
    return served


@pytest.mark.parametrize(
    ("desired", "observed", "expected"),
    [
        ({"a": 1}, {"a": 1, "b": 2}, True),
        ({"a": 1}, {"a": 2}, False),
        ({"a": {"b": [1, {"c": 1}]}}, {"a": {"b": [1, {"c": 1, "d": 0}]}}, True),
        ({"a": [1, 2]}, {"a": [1]}, False),
        ({"a": [1]}, {"a": [1, 2]}, False),
        ({"a": {}}, {}, False),
    ],
    ids=["extra-key", "changed-value", "nested-defaults", "list-shorter", "list-longer", "missing-key"],
)
def test_is_subset(desired: Any, observed: Any, expected: bool) -> None:
    assert is_subset(desired, observed) is expected


def edit(body: dict[str, Any], how: str) -> dict[str, Any]:
    edited = as_served(body)
    if how == "replicas":
        edited["spec"]["replicas"] = 5
    elif how == "image":
        edited["spec"]["template"]["spec"]["containers"][0]["image"] = "evil:1"
    elif how == "label":
        edited["metadata"]["labels"]["herd.dev/role"] = "decode"
    elif how == "hash":
        edited["metadata"]["annotations"][ANNOTATION_SPEC_HASH] = "stale"
    return edited


@pytest.mark.parametrize(
    ("how", "expected"),
    [("none", False), ("replicas", True), ("image", True), ("label", True), ("hash", True)],
    ids=["server-defaults-only", "replicas-edited", "image-edited", "owned-label-edited", "spec-changed"],
)
def test_is_drifted(how: str, expected: bool) -> None:
    assert is_drifted(edit(DEPLOYMENT, how), DEPLOYMENT) is expected


def test_replacement_keeps_server_fields_and_restores_owned_ones() -> None:
    observed = edit(DEPLOYMENT, "image")
    body = replacement(observed, DEPLOYMENT)
    assert body["metadata"]["resourceVersion"] == "7"
    assert body["metadata"]["labels"]["added-by-someone"] == "x"
    assert body["spec"] == DEPLOYMENT["spec"]
    assert not is_drifted(as_served(body), DEPLOYMENT)


def test_replacement_of_a_service_keeps_its_assigned_ips() -> None:
    body = replacement(as_served(SERVICE), SERVICE)
    assert body["spec"]["clusterIPs"] == ["None"]
    assert body["spec"]["clusterIP"] == "None"
