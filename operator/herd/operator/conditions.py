"""Standard status conditions: constant types and reasons, and transition-time bookkeeping."""

from __future__ import annotations

from typing import Any, Final, Literal

from herd.api.crd import Condition

__all__ = [
    "DEGRADED",
    "PROGRESSING",
    "READY",
    "Reason",
    "Status",
    "condition",
    "merge_conditions",
]

READY: Final = "Ready"
PROGRESSING: Final = "Progressing"
DEGRADED: Final = "Degraded"
Status = Literal["True", "False", "Unknown"]


class Reason:
    """The reasons herd writes; CamelCase as Kubernetes conventions ask."""

    ALL_POOLS_READY: Final = "AllPoolsReady"
    POOLS_NOT_READY: Final = "PoolsNotReady"
    ROLLING_OUT: Final = "RollingOut"
    ROLLOUT_COMPLETE: Final = "RolloutComplete"
    AS_EXPECTED: Final = "AsExpected"
    CRASH_LOOP: Final = "CrashLoop"
    IMAGE_PULL_FAILED: Final = "ImagePullFailed"
    UNSCHEDULABLE: Final = "Unschedulable"
    REPLICA_FAILURE: Final = "ReplicaFailure"
    INVALID_SPEC: Final = "InvalidSpec"
    CHILD_CONFLICT: Final = "ChildConflict"


def condition(type_: str, status: Status, reason: str, message: str, generation: int | None) -> Condition:
    return Condition(
        type=type_, status=status, reason=reason, message=message, observed_generation=generation
    )


def merge_conditions(new: list[Condition], previous: list[dict[str, Any]], now: str) -> list[dict[str, Any]]:
    """``new`` as wire dicts; lastTransitionTime is kept from ``previous`` unless the status changed."""
    before = {item.get("type"): item for item in previous}
    merged = []
    for cond in new:
        old = before.get(cond.type)
        is_same = old is not None and old.get("status") == cond.status and old.get("lastTransitionTime")
        stamp = old["lastTransitionTime"] if is_same and old is not None else now
        merged.append(cond.model_copy(update={"last_transition_time": stamp}).model_dump(by_alias=True))
    return merged
