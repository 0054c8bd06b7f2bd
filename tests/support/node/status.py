"""A pod's status from what its containers are doing (pure), as a kubelet computes it.

Each container is a :class:`ContainerRecord` (state, last state, ready, started, restarts); from the
records, the restart policy and the pod's earlier conditions come the phase, the conditions (a
condition's ``lastTransitionTime`` moves only when its status changes) and the container statuses,
ready to be sent to the ``pods/status`` subresource as a strategic merge patch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

__all__ = [
    "CONDITION_TYPES",
    "ContainerRecord",
    "PodRecord",
    "now",
    "pod_phase",
    "pod_status",
    "terminated",
    "waiting",
]

Object = dict[str, Any]
CONDITION_TYPES = ("PodReadyToStartContainers", "Initialized", "ContainersReady", "Ready")


def now() -> str:
    """The current time as the API writes it (RFC 3339, seconds, UTC)."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def waiting(reason: str, message: str = "") -> Object:
    return {"waiting": {"reason": reason, **({"message": message} if message else {})}}


def terminated(exit_code: int, started_at: str, *, reason: str = "", message: str = "") -> Object:
    """A terminated state; ``reason`` defaults to Completed for 0 and Error otherwise."""
    state: Object = {
        "exitCode": exit_code,
        "reason": reason or ("Completed" if exit_code == 0 else "Error"),
        "startedAt": started_at,
        "finishedAt": now(),
    }
    if message:
        state["message"] = message
    return {"terminated": state}


@dataclass
class ContainerRecord:
    """What one container is doing; ``pid`` is the process running it, if any."""

    name: str
    image: str
    state: Object = field(default_factory=lambda: waiting("ContainerCreating"))
    last_state: Object = field(default_factory=dict)
    ready: bool = False
    started: bool = False
    restart_count: int = 0
    pid: int | None = None

    @property
    def is_running(self) -> bool:
        return "running" in self.state

    @property
    def exit_code(self) -> int | None:
        return self.state["terminated"]["exitCode"] if "terminated" in self.state else None

    @property
    def has_run(self) -> bool:
        """Terminated now or before (a waiting container with a last state is restarting)."""
        return "terminated" in self.state or bool(self.last_state)

    def status(self) -> Object:
        entry: Object = {
            "name": self.name,
            "image": self.image,
            "imageID": f"herd://{self.image}",
            "state": self.state,
            "lastState": self.last_state,
            "ready": self.ready,
            "started": self.started,
            "restartCount": self.restart_count,
        }
        if self.pid is not None:
            entry["containerID"] = f"herd://{self.pid}"
        return entry


@dataclass
class PodRecord:
    """Everything the status of one pod is computed from."""

    restart_policy: str
    pod_ip: str
    start_time: str
    init: list[ContainerRecord]
    containers: list[ContainerRecord]
    failure: tuple[str, str] | None = None
    """A pod-level failure (reason, message), such as a volume this node cannot provide."""


def _initialized(record: PodRecord) -> bool:
    return all(c.exit_code == 0 for c in record.init)


def _init_failed(record: PodRecord) -> bool:
    return record.restart_policy == "Never" and any(c.exit_code not in (None, 0) for c in record.init)


def pod_phase(record: PodRecord) -> str:
    """Pending until every init container succeeded and every container has started once; Running
    while one runs or restarts; Succeeded/Failed once all terminated and none will restart."""
    if record.failure is not None or _init_failed(record):
        return "Failed"
    if not _initialized(record) or any(not c.is_running and not c.has_run for c in record.containers):
        return "Pending"
    if any(c.is_running for c in record.containers):
        return "Running"
    if any(not c.is_running and "terminated" not in c.state for c in record.containers):
        return "Running"  # waiting to restart (back-off)
    failed = any(c.exit_code != 0 for c in record.containers)
    if record.restart_policy == "Always" or (record.restart_policy == "OnFailure" and failed):
        return "Running"
    return "Failed" if failed else "Succeeded"


def _conditions(record: PodRecord, previous: Sequence[Object]) -> list[Object]:
    ready = bool(record.containers) and all(c.ready for c in record.containers)
    wanted = {
        "PodReadyToStartContainers": bool(record.pod_ip) and record.failure is None,
        "Initialized": _initialized(record),
        "ContainersReady": ready,
        "Ready": ready,
    }
    earlier = {c["type"]: c for c in previous}
    conditions = []
    for kind in CONDITION_TYPES:
        status = "True" if wanted[kind] else "False"
        before = earlier.get(kind, {})
        moved = before.get("status") != status
        condition: Object = {"type": kind, "status": status, "lastProbeTime": None,
                             "lastTransitionTime": now() if moved else before.get("lastTransitionTime")}  # fmt: skip
        # A strategic merge patch keeps fields it is not given: None removes a stale reason.
        condition["reason"] = condition["message"] = None
        if status == "False" and kind in ("ContainersReady", "Ready"):
            unready = sorted(c.name for c in record.containers if not c.ready)
            condition["reason"] = "ContainersNotReady"
            condition["message"] = f"containers with unready status: [{' '.join(unready)}]"
        conditions.append(condition)
    return conditions


def pod_status(record: PodRecord, previous_conditions: Sequence[Object]) -> Object:
    """The ``status`` to patch (the scheduler's PodScheduled condition is left as it is: conditions
    merge by type)."""
    status: Object = {
        "phase": pod_phase(record),
        "hostIP": "127.0.0.1",
        "hostIPs": [{"ip": "127.0.0.1"}],
        "startTime": record.start_time,
        "conditions": _conditions(record, previous_conditions),
        "containerStatuses": [c.status() for c in record.containers],
    }
    if record.init:
        status["initContainerStatuses"] = [c.status() for c in record.init]
    if record.pod_ip:
        status["podIP"], status["podIPs"] = record.pod_ip, [{"ip": record.pod_ip}]
    if record.failure is not None:
        status["reason"], status["message"] = record.failure
    return status
