"""Kubernetes Events for condition transitions, posted through kopf's event queue."""

from __future__ import annotations

from typing import Any

import kopf

from herd.operator.conditions import DEGRADED

__all__ = ["announce_transitions"]

Object = dict[str, Any]


def announce_transitions(body: kopf.Body, previous: list[Object], current: list[Object]) -> None:
    """One Event per condition whose status changed; a Degraded=True one is a Warning.

    A condition's first value is not a transition and is only announced when it is bad news.
    """
    before = {item.get("type"): item.get("status") for item in previous}
    for cond in current:
        was = before.get(cond["type"])
        is_bad = cond["type"] == DEGRADED and cond["status"] == "True"
        if was == cond["status"] or (was is None and not is_bad):
            continue
        message = f"{cond['type']}={cond['status']}: {cond['message']}".rstrip(": ")
        post = kopf.warn if is_bad else kopf.info
        post(body, reason=cond["reason"], message=message)
