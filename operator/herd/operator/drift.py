"""Drift detection (pure): does an observed child still match its desired body?

A child is up to date when its spec-hash annotation equals the desired one (the spec has not
changed since it was written) *and* every owned field still holds the desired value (nobody edited
it by hand). "Owned" means what herd wrote: the desired body is compared as a subset of the
observed one, so fields the API server defaults or other controllers add never count as drift.
"""

from __future__ import annotations

from typing import Any

from herd.operator.plan import ANNOTATION_SPEC_HASH

__all__ = ["is_drifted", "is_subset", "replacement"]

Object = dict[str, Any]
# Fields the API server assigns once and refuses to change on a replace.
_SERVER_ASSIGNED_SPEC = {"Service": ("clusterIPs", "ipFamilies", "ipFamilyPolicy")}


def is_subset(desired: Any, observed: Any) -> bool:
    if isinstance(desired, dict):
        return isinstance(observed, dict) and all(
            key in observed and is_subset(value, observed[key]) for key, value in desired.items()
        )
    if isinstance(desired, list):
        return (
            isinstance(observed, list)
            and len(desired) == len(observed)
            and all(is_subset(want, have) for want, have in zip(desired, observed, strict=True))
        )
    return bool(desired == observed)


def is_drifted(observed: Object, desired: Object) -> bool:
    meta = observed.get("metadata", {})
    want = desired["metadata"]
    if (meta.get("annotations") or {}).get(ANNOTATION_SPEC_HASH) != want["annotations"][ANNOTATION_SPEC_HASH]:
        return True
    return not (
        is_subset(want["labels"], meta.get("labels") or {})
        and all(is_subset(value, observed.get(key)) for key, value in _content(desired).items())
    )


def _content(body: Object) -> Object:
    """What herd owns of a body besides its labels: ``spec``, or a Role's ``rules``, a binding's ``roleRef``."""
    return {key: value for key, value in body.items() if key not in ("apiVersion", "kind", "metadata")}


def replacement(observed: Object, desired: Object) -> Object:
    """The body to PUT: the desired content, with the observed metadata (resourceVersion included) kept."""
    meta = observed["metadata"]
    want = desired["metadata"]
    metadata = {
        **meta,
        "labels": {**(meta.get("labels") or {}), **want["labels"]},
        "annotations": {**(meta.get("annotations") or {}), **want["annotations"]},
        "ownerReferences": want.get("ownerReferences", meta.get("ownerReferences", [])),
    }
    if "spec" not in desired:
        return {**desired, "metadata": metadata}
    kept = {
        key: observed["spec"][key]
        for key in _SERVER_ASSIGNED_SPEC.get(desired["kind"], ())
        if key in observed.get("spec", {})
    }
    return {**desired, "metadata": metadata, "spec": {**kept, **desired["spec"]}}
