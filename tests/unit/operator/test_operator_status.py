"""Pure status planning: observed pods and Deployments -> conditions, pool counts, scale fields."""

from __future__ import annotations

from typing import Any

import pytest

from herd.api.crd import ModelDeployment
from herd.operator.plan import LABEL_TEMPLATE_HASH, plan
from herd.operator.settings import PlanSettings
from herd.operator.status import blocked_status, plan_status

SETTINGS = PlanSettings()
NOW = "2026-11-22T01:00:00Z"
EARLIER = "2026-11-22T00:00:00Z"
DISAGG = {"serving": {"mode": "disaggregated"}, "prefill": {"replicas": 1}, "decode": {"replicas": 2}}


def make_md(**spec: Any) -> ModelDeployment:
    body = {
        "apiVersion": "herd.dev/v1alpha1",
        "kind": "ModelDeployment",
        "metadata": {"name": "chat", "namespace": "ml", "generation": 4},
        "spec": {"model": {"source": "file:///w"}, "workers": {"replicas": 2}, **spec},
    }
    return ModelDeployment.model_validate(body)


def template_hash(md: ModelDeployment, role: str) -> str:
    for obj in plan(md, SETTINGS).objects:
        labels = obj.body["spec"].get("template", {}).get("metadata", {}).get("labels", {})
        if labels.get("herd.dev/role") == role:
            return str(labels[LABEL_TEMPLATE_HASH])
    raise AssertionError(role)


def pod(md: ModelDeployment, name: str, role: str = "unified", **state: Any) -> dict[str, Any]:
    """A pod as the Deployment controller would make it; ``state`` tweaks it."""
    labels = {"herd.dev/deployment": "chat", "herd.dev/role": role}
    labels[LABEL_TEMPLATE_HASH] = "old" if state.get("old") else template_hash(md, role)
    metadata: dict[str, Any] = {"name": name, "labels": labels}
    if state.get("terminating"):
        metadata["deletionTimestamp"] = EARLIER
    conditions = [{"type": "Ready", "status": "True" if state.get("ready", True) else "False"}]
    if state.get("unschedulable"):
        conditions = [
            {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": "0/3 nodes"}
        ]
    status: dict[str, Any] = {"conditions": conditions}
    if "waiting" in state:
        status["containerStatuses"] = [{"name": "worker", "state": {"waiting": {"reason": state["waiting"]}}}]
    return {"metadata": metadata, "status": status}


def status_of(
    md: ModelDeployment, pods: list[dict[str, Any]], deployments: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    return plan_status(md, plan(md, SETTINGS), (pods, deployments or []), {}, now=NOW, settings=SETTINGS)


def conditions(status: dict[str, Any]) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}


MD = make_md()
CASES = {
    "all-ready": ([pod(MD, "a"), pod(MD, "b")], ("True", "AllPoolsReady"), ("False", "RolloutComplete"), ("False", "AsExpected"), "2/2"),
    "no-pods": ([], ("False", "PoolsNotReady"), ("True", "RollingOut"), ("False", "AsExpected"), "0/2"),
    "one-not-ready": ([pod(MD, "a"), pod(MD, "b", ready=False)], ("False", "PoolsNotReady"), ("False", "RolloutComplete"), ("False", "AsExpected"), "1/2"),
    "rolling-out": ([pod(MD, "a", old=True), pod(MD, "b", old=True), pod(MD, "c")], ("True", "AllPoolsReady"), ("True", "RollingOut"), ("False", "AsExpected"), "3/2"),
    "terminating-not-counted": ([pod(MD, "a"), pod(MD, "b", terminating=True)], ("False", "PoolsNotReady"), ("True", "RollingOut"), ("False", "AsExpected"), "1/2"),
    "crash-loop": ([pod(MD, "a"), pod(MD, "b", ready=False, waiting="CrashLoopBackOff")], ("False", "PoolsNotReady"), ("False", "RolloutComplete"), ("True", "CrashLoop"), "1/2"),
    "image-pull": ([pod(MD, "a", ready=False, waiting="ImagePullBackOff")], ("False", "PoolsNotReady"), ("True", "RollingOut"), ("True", "ImagePullFailed"), "0/2"),
    "unschedulable": ([pod(MD, "a"), pod(MD, "b", unschedulable=True)], ("False", "PoolsNotReady"), ("False", "RolloutComplete"), ("True", "Unschedulable"), "1/2"),
}  # fmt: skip


@pytest.mark.parametrize(
    ("pods", "ready", "progressing", "degraded", "column"), CASES.values(), ids=CASES.keys()
)
def test_roll_up(
    pods: list[dict[str, Any]],
    ready: tuple[str, str],
    progressing: tuple[str, str],
    degraded: tuple[str, str],
    column: str,
) -> None:
    status = status_of(MD, pods)
    assert conditions(status) == {"Ready": ready, "Progressing": progressing, "Degraded": degraded}
    assert status["pools"]["workers"]["ready"] == column
    assert all(c["observedGeneration"] == 4 and c["lastTransitionTime"] == NOW for c in status["conditions"])


def test_counts_and_scale_fields_aggregated() -> None:
    status = status_of(
        MD, [pod(MD, "a", old=True), pod(MD, "b", ready=False), pod(MD, "c", terminating=True)]
    )
    assert status["pools"] == {
        "workers": {"replicas": 2, "readyReplicas": 1, "updatedReplicas": 1, "ready": "1/2"}
    }
    assert status["replicas"] == 2
    assert (
        status["selector"]
        == "app.kubernetes.io/managed-by=herd,herd.dev/deployment=chat,herd.dev/role=unified"
    )
    assert status["observedGeneration"] == 4
    assert status["endpoint"] == "http://herd-orchestrator.ml.svc:8000/v1"


def test_disaggregated_pools_roll_up_and_scale_decode() -> None:
    md = make_md(**DISAGG)
    pods = [pod(md, "p", "prefill"), pod(md, "d1", "decode"), pod(md, "d2", "decode", ready=False)]
    status = status_of(md, pods)
    assert {name: pool["ready"] for name, pool in status["pools"].items()} == {
        "prefill": "1/1",
        "decode": "1/2",
    }
    assert conditions(status)["Ready"] == ("False", "PoolsNotReady")
    assert "decode 1/2" in next(c["message"] for c in status["conditions"] if c["type"] == "Ready")
    assert status["replicas"] == 2
    assert status["selector"].endswith("herd.dev/role=decode")
    status = status_of(md, [*pods[:2], pod(md, "d2", "decode")])
    assert conditions(status)["Ready"] == ("True", "AllPoolsReady")


def test_replica_failure_on_a_deployment_is_degraded() -> None:
    failed = {"metadata": {"name": "chat-workers"}, "status": {"conditions": [
        {"type": "ReplicaFailure", "status": "True", "message": "exceeded quota: gpu"}]}}  # fmt: skip
    status = status_of(MD, [], [failed])
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "ReplicaFailure")
    assert "exceeded quota" in degraded["message"]


@pytest.mark.parametrize(
    ("old_status", "new_status", "stamp"),
    [("True", "True", EARLIER), ("False", "True", NOW), (None, "True", NOW)],
    ids=["unchanged-keeps-time", "changed-new-time", "new-condition"],
)
def test_last_transition_time_only_moves_on_change(
    old_status: str | None, new_status: str, stamp: str
) -> None:
    previous = (
        [] if old_status is None else [{"type": "Ready", "status": old_status, "lastTransitionTime": EARLIER}]
    )
    status = plan_status(
        MD,
        plan(MD, SETTINGS),
        ([pod(MD, "a"), pod(MD, "b")], []),
        {"conditions": previous},
        now=NOW,
        settings=SETTINGS,
    )
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert (ready["status"], ready["lastTransitionTime"]) == (new_status, stamp)


def test_invalid_spec_status_names_the_field() -> None:
    status = blocked_status(7, "InvalidSpec", "spec.prefill: missing", {}, now=NOW)
    assert conditions(status) == {
        "Ready": ("False", "InvalidSpec"), "Progressing": ("False", "InvalidSpec"), "Degraded": ("True", "InvalidSpec")
    }  # fmt: skip
    assert "spec.prefill" in status["conditions"][0]["message"]
    assert status["observedGeneration"] == 7


def test_a_second_pass_with_the_same_pods_changes_nothing() -> None:
    pods = [pod(MD, "a"), pod(MD, "b")]
    first = status_of(MD, pods)
    again = plan_status(MD, plan(MD, SETTINGS), (pods, []), first, now="later", settings=SETTINGS)
    assert again == first


def test_adapters_list_the_ready_pods_started_with_them() -> None:
    """A worker loads every adapter of its command line before it is Ready: the status names those
    pods; a pod that is not Ready, or was started before the adapter was added, is not counted."""
    adapters = [{"name": "sql", "source": "pvc://loras/sql"}, {"name": "poet", "source": "file:///l/poet"}]
    md = make_md(adapters=adapters)
    template = next(obj for obj in plan(md, SETTINGS).objects if obj.kind == "Deployment")
    command = template.body["spec"]["template"]["spec"]["containers"][0]["command"]

    def started(name: str, argv: list[str], ready: bool = True) -> dict[str, Any]:
        return {**pod(md, name, ready=ready), "spec": {"containers": [{"name": "worker", "command": argv}]}}

    old = [*command[: command.index("--lora-modules")], "--lora-modules", "sql=/adapters/0/pvc/loras/sql"]
    pods = [started("a", command), started("b", command, ready=False), started("c", old)]
    assert status_of(md, pods)["adapters"] == [
        {"name": "sql", "source": "pvc://loras/sql", "loadedOn": ["a", "c"]},
        {"name": "poet", "source": "file:///l/poet", "loadedOn": ["a"]},
    ]
    assert "adapters" not in status_of(MD, [pod(MD, "a")])
