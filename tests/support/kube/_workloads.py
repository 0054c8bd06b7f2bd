"""What the missing controllers would write: a started pod's status and a Deployment's counts.

The emulator runs no controllers; tests call these (through ``Emulator.set_pod_ready`` and
``Emulator.sync_deployment_status``) when their scenario needs pods to run.
"""

from __future__ import annotations

import copy
from typing import Any

from ._meta import now
from ._selectors import parse_label_selector, selector_to_string

__all__ = ["deployment_status", "is_pod_ready", "pod_from_template", "pod_status", "selects"]


def _container_status(container: dict[str, Any], is_ready: bool, stamp: str) -> dict[str, Any]:
    return {
        "name": container.get("name", ""),
        "image": container.get("image", ""),
        "imageID": "",
        "ready": is_ready,
        "started": True,
        "restartCount": 0,
        "state": {"running": {"startedAt": stamp}},
    }


def pod_status(pod: dict[str, Any], *, is_ready: bool, pod_ip: str) -> dict[str, Any]:
    """A running pod's status, Ready or not, as the kubelet would report it."""
    flag, stamp = ("True" if is_ready else "False"), now()
    conditions = [
        {"type": kind, "status": status, "lastTransitionTime": stamp}
        for kind, status in (
            ("PodScheduled", "True"),
            ("Initialized", "True"),
            ("ContainersReady", flag),
            ("Ready", flag),
        )
    ]
    containers = [_container_status(c, is_ready, stamp) for c in pod.get("spec", {}).get("containers", ())]
    return {
        "phase": "Running",
        "hostIP": pod_ip,
        "podIP": pod_ip,
        "podIPs": [{"ip": pod_ip}],
        "startTime": stamp,
        "conditions": conditions,
        "containerStatuses": containers,
    }


def is_pod_ready(pod: dict[str, Any]) -> bool:
    conditions = pod.get("status", {}).get("conditions", ())
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def selects(deployment: dict[str, Any], pod: dict[str, Any]) -> bool:
    """Whether the Deployment's selector takes this live (not terminating) pod."""
    selector = parse_label_selector(selector_to_string(deployment.get("spec", {}).get("selector", {})))
    is_live = not pod["metadata"].get("deletionTimestamp")
    return is_live and selector.matches(pod["metadata"].get("labels", {}))


def pod_from_template(deployment: dict[str, Any], name: str) -> dict[str, Any]:
    """A pod as the ReplicaSet controller would make it: the template, owned by the Deployment."""
    meta, template = deployment["metadata"], deployment["spec"]["template"]
    owner = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }
    pod_meta = {
        **copy.deepcopy(template.get("metadata", {})),
        "name": name,
        "namespace": meta["namespace"],
        "ownerReferences": [owner],
    }
    return {"apiVersion": "v1", "kind": "Pod", "metadata": pod_meta, "spec": copy.deepcopy(template["spec"])}


def deployment_status(deployment: dict[str, Any], pods: list[dict[str, Any]]) -> dict[str, Any]:
    """Counts from the live pods that match the Deployment's selector (no ReplicaSets in between)."""
    owned = [pod for pod in pods if selects(deployment, pod)]
    ready = sum(is_pod_ready(pod) for pod in owned)
    wanted = deployment.get("spec", {}).get("replicas", 1)
    available = {
        "type": "Available",
        "status": "True" if ready >= wanted else "False",
        "reason": "MinimumReplicasAvailable" if ready >= wanted else "MinimumReplicasUnavailable",
        "lastTransitionTime": now(),
    }
    return {
        "observedGeneration": deployment["metadata"].get("generation", 1),
        "replicas": len(owned),
        "updatedReplicas": len(owned),
        "readyReplicas": ready,
        "availableReplicas": ready,
        "unavailableReplicas": max(wanted - ready, 0),
        "conditions": [available],
    }
