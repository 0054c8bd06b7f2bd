"""The pure planner's multi-pod pools: ``podsPerReplica`` > 1 becomes a LeaderWorkerSet whose leader
pods serve (and carry the pool's labels) and whose follower pods run the ranks."""

from __future__ import annotations

import json
from typing import Any

import pytest

from herd.api.crd import ModelDeployment
from herd.operator.plan import LABEL_TEMPLATE_HASH, LWS_API, DesiredObject, plan
from herd.operator.settings import PlanSettings
from herd.operator.status import plan_status

SETTINGS = PlanSettings()
GPUS = {"resources": {"accelerator": {"vendor": "nvidia", "count": 4}}}
POOL_LABELS = {
    "app.kubernetes.io/managed-by": "herd",
    "herd.dev/deployment": "chat",
    "herd.dev/role": "unified",
}


def make_md(**spec: Any) -> ModelDeployment:
    body = {
        "apiVersion": "herd.dev/v1alpha1",
        "kind": "ModelDeployment",
        "metadata": {"name": "chat", "namespace": "ml", "generation": 2},
        "spec": {"model": {"source": "file:///weights/chat"}, **spec},
    }
    return ModelDeployment.model_validate(body)


def lws(md: ModelDeployment) -> DesiredObject:
    (found,) = [obj for obj in plan(md, SETTINGS).objects if obj.kind == "LeaderWorkerSet"]
    return found


def arg(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ({"workers": {"podsPerReplica": 1}}, {"Deployment/chat-workers": 1, "Service/chat-workers": None}),
        (
            {"workers": {"podsPerReplica": 2, "replicas": 3}},
            {"LeaderWorkerSet/chat-workers": 3, "Service/chat-workers": None},
        ),
        (
            {"workers": {"podsPerReplica": 4, "replicas": 1, **GPUS}, "replicas": 2},
            {"LeaderWorkerSet/chat-workers": 2, "Service/chat-workers": None},
        ),
    ],
    ids=["one-pod-a-deployment", "two-pods-an-lws", "scale-sets-groups"],
)
def test_a_pool_over_several_pods_is_a_leader_worker_set(
    spec: dict[str, Any], expected: dict[str, int | None]
) -> None:
    desired = plan(make_md(**spec), SETTINGS)
    assert {f"{obj.kind}/{obj.name}": obj.body["spec"].get("replicas") for obj in desired.objects} == expected
    assert desired.summary().startswith(next(iter(expected)) + f" x{desired.replicas['workers']}")


@pytest.mark.parametrize(("pods", "gpus", "ranks"), [(2, 0, 2), (2, 4, 8), (3, 8, 24)])
def test_the_group_has_pods_per_replica_pods_and_a_rank_per_device(pods: int, gpus: int, ranks: int) -> None:
    resources = {"resources": {"accelerator": {"vendor": "nvidia", "count": gpus}}} if gpus else {}
    obj = lws(make_md(workers={"podsPerReplica": pods, "replicas": 2, **resources}))
    assert (obj.api_version, obj.plural) == (LWS_API, "leaderworkersets")
    spec = obj.body["spec"]
    template = spec["leaderWorkerTemplate"]
    assert template["size"] == pods
    assert template["restartPolicy"] == "RecreateGroupOnPodRestart"
    assert spec["networkConfig"] == {"subdomainPolicy": "UniquePerReplica"}
    for role in ("leaderTemplate", "workerTemplate"):
        (worker,) = template[role]["spec"]["containers"]
        argv = worker["command"]
        assert json.loads(arg(argv, "--engine-json"))["tensorParallelSize"] == ranks
        assert (arg(argv, "--group-size"), arg(argv, "--rendezvous-port")) == (str(pods), "29500")
        assert "--group-index" not in argv  # each pod's index comes from LWS_WORKER_INDEX
        assert worker.get("resources") == ({"limits": {"nvidia.com/gpu": str(gpus)}} if gpus else None)


def test_the_leader_serves_and_carries_the_pool_labels_the_followers_do_not() -> None:
    obj = lws(make_md(workers={"podsPerReplica": 2}))
    template = obj.body["spec"]["leaderWorkerTemplate"]
    leader, follower = template["leaderTemplate"], template["workerTemplate"]
    assert obj.body["metadata"]["labels"] == POOL_LABELS
    assert {k: v for k, v in leader["metadata"]["labels"].items() if k != LABEL_TEMPLATE_HASH} == POOL_LABELS
    assert follower["metadata"]["labels"] == {
        "app.kubernetes.io/managed-by": "herd",
        "herd.dev/deployment": "chat",
        "herd.dev/group-role": "follower",
    }
    (serving,), (ranks,) = leader["spec"]["containers"], follower["spec"]["containers"]
    assert {port["name"]: port["containerPort"] for port in serving["ports"]} == {
        "http": 8000,
        "internal": 9000,
        "rendezvous": 29500,
    }
    assert {"readinessProbe", "livenessProbe", "startupProbe", "lifecycle"} <= serving.keys()
    assert not {"ports", "readinessProbe", "livenessProbe", "startupProbe", "lifecycle"} & ranks.keys()
    assert ranks["command"] == serving["command"] and ranks["env"] == serving["env"]


def test_the_pool_service_selects_the_leaders_only() -> None:
    (service,) = [
        obj.body
        for obj in plan(make_md(workers={"podsPerReplica": 2}), SETTINGS).objects
        if obj.kind == "Service"
    ]
    assert service["spec"]["selector"] == {**POOL_LABELS, "leaderworkerset.sigs.k8s.io/worker-index": "0"}


def test_status_counts_the_leaders_as_replicas() -> None:
    md = make_md(workers={"podsPerReplica": 2, "replicas": 2})
    desired = plan(md, SETTINGS)
    leader_hash = desired.objects[0].serving_template["metadata"]["labels"][LABEL_TEMPLATE_HASH]
    ready = {"conditions": [{"type": "Ready", "status": "True"}]}
    leaders = [
        {
            "metadata": {
                "name": f"chat-workers-{i}",
                "labels": {**POOL_LABELS, LABEL_TEMPLATE_HASH: leader_hash},
            },
            "status": ready,
        }
        for i in range(2)
    ]
    followers = [
        {
            "metadata": {"name": f"chat-workers-{i}-1", "labels": {"herd.dev/group-role": "follower"}},
            "status": ready,
        }
        for i in range(2)
    ]
    status = plan_status(md, desired, ([*leaders, *followers], []), {}, now="t", settings=SETTINGS)
    assert status["pools"]["workers"] == {
        "replicas": 2,
        "readyReplicas": 2,
        "updatedReplicas": 2,
        "ready": "2/2",
    }
