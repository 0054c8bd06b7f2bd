"""The ``/scale`` subresource: an ``autoscaling/v1 Scale`` view onto the paths the type declares."""

from __future__ import annotations

import copy
from typing import Any

from ._resources import ResourceType, ScalePaths
from ._selectors import field_value, selector_to_string

__all__ = ["apply_scale", "scale_of"]


def _selector(paths: ScalePaths, obj: dict[str, Any]) -> str | None:
    value = field_value(obj, paths.label_selector) if paths.label_selector else None
    return selector_to_string(value) if isinstance(value, dict) else value


def scale_of(rtype: ResourceType, obj: dict[str, Any]) -> dict[str, Any]:
    assert rtype.scale is not None, "only called for types with a scale subresource"
    meta = obj["metadata"]
    status: dict[str, Any] = {"replicas": field_value(obj, rtype.scale.status_replicas) or 0}
    selector = _selector(rtype.scale, obj)
    if selector is not None:
        status["selector"] = selector
    return {
        "apiVersion": "autoscaling/v1",
        "kind": "Scale",
        "metadata": {
            key: meta[key]
            for key in ("name", "namespace", "uid", "resourceVersion", "creationTimestamp")
            if key in meta
        },
        "spec": {"replicas": field_value(obj, rtype.scale.spec_replicas) or 0},
        "status": status,
    }


def apply_scale(rtype: ResourceType, obj: dict[str, Any], scale: dict[str, Any]) -> dict[str, Any]:
    """The object with the scale's spec.replicas written to the spec path; its resourceVersion is the lock."""
    assert rtype.scale is not None, "only called for types with a scale subresource"
    result = copy.deepcopy(obj)
    node = result
    *parents, leaf = rtype.scale.spec_replicas.strip(".").split(".")
    for step in parents:
        node = node.setdefault(step, {})
    node[leaf] = scale.get("spec", {}).get("replicas", 0)
    wanted = scale.get("metadata", {}).get("resourceVersion")
    if wanted:
        result["metadata"]["resourceVersion"] = wanted
    return result
