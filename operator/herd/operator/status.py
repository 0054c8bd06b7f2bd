"""Pure status planning: observed Pods (and Deployments) become the ModelDeployment's status.

Counts come from the pods themselves rather than from Deployment status, so they hold with or
without a Deployment controller: a pool's ``replicas`` are its pods that are not terminating,
``readyReplicas`` those whose Ready condition is True, ``updatedReplicas`` those whose template-hash
label matches the current plan. Ready rolls up from the pools, Progressing says a rollout is under
way, Degraded names the first pod (or Deployment) that cannot run and why.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from herd.api.crd import POOL_ROLES, AdapterStatus, Condition, ModelDeployment, PoolName, PoolStatus
from herd.api.protocol import LABEL_ROLE
from herd.operator.conditions import DEGRADED, PROGRESSING, READY, Reason, condition, merge_conditions
from herd.operator.plan import LABEL_TEMPLATE_HASH, Plan, pool_labels, selector_string
from herd.operator.settings import PlanSettings

__all__ = [
    "Problem",
    "adapter_status",
    "blocked_status",
    "find_problem",
    "is_pod_ready",
    "plan_status",
    "pool_status",
]

Object = dict[str, Any]
_WAITING_REASONS = {
    "CrashLoopBackOff": Reason.CRASH_LOOP,
    "CreateContainerConfigError": Reason.CRASH_LOOP,
    "CreateContainerError": Reason.CRASH_LOOP,
    "RunContainerError": Reason.CRASH_LOOP,
    "ImagePullBackOff": Reason.IMAGE_PULL_FAILED,
    "ErrImagePull": Reason.IMAGE_PULL_FAILED,
    "InvalidImageName": Reason.IMAGE_PULL_FAILED,
}


@dataclass(frozen=True)
class Problem:
    reason: str
    message: str


def is_pod_ready(pod: Object) -> bool:
    if pod.get("metadata", {}).get("deletionTimestamp"):
        return False
    conditions = pod.get("status", {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def pool_status(pods: list[Object], desired: int, template_hash: str) -> PoolStatus:
    live = [pod for pod in pods if not pod.get("metadata", {}).get("deletionTimestamp")]
    ready = sum(1 for pod in live if is_pod_ready(pod))
    updated = sum(1 for pod in live if _labels(pod).get(LABEL_TEMPLATE_HASH) == template_hash)
    return PoolStatus(
        replicas=len(live), ready_replicas=ready, updated_replicas=updated, ready=f"{ready}/{desired}"
    )


def find_problem(pods: list[Object], deployments: list[Object]) -> Problem | None:
    """The first reason the spec cannot run as asked, or None."""
    for pod in pods:
        problem = _pod_problem(pod)
        if problem is not None:
            return problem
    for deployment in deployments:
        for cond in deployment.get("status", {}).get("conditions") or []:
            if cond.get("type") == "ReplicaFailure" and cond.get("status") == "True":
                name = deployment["metadata"]["name"]
                return Problem(Reason.REPLICA_FAILURE, f"Deployment {name}: {cond.get('message', '')}")
    return None


def plan_status(
    md: ModelDeployment,
    plan: Plan,
    observed: tuple[list[Object], list[Object]],
    previous: Object,
    *,
    now: str,
    settings: PlanSettings,
) -> Object:
    """The whole status body (camelCase) for ``md``, given its ``(pods, deployments)``."""
    pods, deployments = observed
    templates = {obj.pool: obj.body["spec"]["template"]["metadata"]["labels"][LABEL_TEMPLATE_HASH]
                 for obj in plan.objects if obj.kind == "Deployment" and obj.component == "pool"}  # fmt: skip
    pools = {
        name: pool_status(
            [p for p in pods if _labels(p).get(LABEL_ROLE) == POOL_ROLES[name]], desired, templates[name]
        )
        for name, desired in plan.replicas.items()
    }
    generation = md.metadata.generation
    conditions = _conditions(pools, plan.replicas, find_problem(pods, deployments), generation)
    scaled: PoolName = "decode" if "decode" in pools else "workers"
    namespace = settings.orchestrator_namespace or md.metadata.namespace
    adapters = (
        {"adapters": [a.model_dump(by_alias=True) for a in adapter_status(md, pods)]}
        if md.spec.adapters
        else {}
    )
    return {
        **adapters,
        "observedGeneration": generation,
        "conditions": merge_conditions(conditions, previous.get("conditions") or [], now),
        "pools": {name: pool.model_dump(by_alias=True) for name, pool in pools.items()},
        "replicas": pools[scaled].replicas,
        "selector": selector_string(pool_labels(md.metadata.name, scaled)),
        "endpoint": f"http://{settings.orchestrator_service}.{namespace}.svc:8000/v1",
    }


def adapter_status(md: ModelDeployment, pods: list[Object]) -> list[AdapterStatus]:
    """Each of ``spec.adapters`` with the Ready pods whose command line loads it (``--lora-modules``)."""
    ready = [pod for pod in pods if is_pod_ready(pod)]
    loaded = {pod["metadata"]["name"]: _lora_modules(pod) for pod in ready}
    return [
        AdapterStatus(
            name=adapter.name,
            source=adapter.source,
            loaded_on=sorted(pod for pod, names in loaded.items() if adapter.name in names),
        )
        for adapter in md.spec.adapters
    ]


def _lora_modules(pod: Object) -> set[str]:
    """The adapter names a pod's containers load at start: the NAME of each ``--lora-modules`` NAME=PATH."""
    names: set[str] = set()
    for container in pod.get("spec", {}).get("containers") or []:
        command = list(container.get("command") or [])
        if "--lora-modules" not in command:
            continue
        for value in command[command.index("--lora-modules") + 1 :]:
            if value.startswith("--"):
                break
            names.add(value.partition("=")[0])
    return names


def blocked_status(
    generation: int | None, reason: str, message: str, previous: Object, *, now: str
) -> Object:
    """Status when herd cannot act on the spec (invalid, or a child's name taken); the rest is kept."""
    conditions = [
        condition(READY, "False", reason, message, generation),
        condition(PROGRESSING, "False", reason, "fix this to resume reconciling", generation),
        condition(DEGRADED, "True", reason, message, generation),
    ]
    return {
        "observedGeneration": generation,
        "conditions": merge_conditions(conditions, previous.get("conditions") or [], now),
    }


def _conditions(
    pools: dict[PoolName, PoolStatus],
    desired: dict[PoolName, int],
    problem: Problem | None,
    generation: int | None,
) -> list[Condition]:
    waiting = [f"{name} {pool.ready}" for name, pool in pools.items() if pool.ready_replicas < desired[name]]
    rolling = [
        name for name, pool in pools.items()
        if pool.updated_replicas < desired[name] or pool.replicas > desired[name]
    ]  # fmt: skip
    summary = ", ".join(f"{name} {pool.ready}" for name, pool in pools.items())
    ready = condition(READY, "True", Reason.ALL_POOLS_READY, f"ready: {summary}", generation)
    if waiting:
        ready = condition(
            READY, "False", Reason.POOLS_NOT_READY, "waiting for " + ", ".join(waiting), generation
        )
    progressing = condition(
        PROGRESSING, "False", Reason.ROLLOUT_COMPLETE, "every pod runs the current spec", generation
    )
    if rolling:
        message = "rolling out " + ", ".join(rolling)
        progressing = condition(PROGRESSING, "True", Reason.ROLLING_OUT, message, generation)
    degraded = condition(DEGRADED, "False", Reason.AS_EXPECTED, "", generation)
    if problem is not None:
        degraded = condition(DEGRADED, "True", problem.reason, problem.message, generation)
    return [ready, progressing, degraded]


def _pod_problem(pod: Object) -> Problem | None:
    name = pod.get("metadata", {}).get("name", "?")
    status = pod.get("status", {})
    for cond in status.get("conditions") or []:
        if cond.get("type") == "PodScheduled" and cond.get("reason") == "Unschedulable":
            return Problem(Reason.UNSCHEDULABLE, f"pod {name} cannot be scheduled: {cond.get('message', '')}")
    statuses = (status.get("initContainerStatuses") or []) + (status.get("containerStatuses") or [])
    for container in statuses:
        waiting = (container.get("state") or {}).get("waiting") or {}
        reason = _WAITING_REASONS.get(waiting.get("reason", ""))
        if reason is not None:
            detail = f"{waiting['reason']}: {waiting.get('message', '')}".rstrip(": ")
            return Problem(reason, f"pod {name} container {container.get('name', '?')}: {detail}")
    return None


def _labels(pod: Object) -> dict[str, str]:
    return dict(pod.get("metadata", {}).get("labels") or {})
