"""Server-set metadata: uid, timestamps, generation and the status a new object starts with."""

from __future__ import annotations

import copy
import secrets
import uuid
from datetime import UTC, datetime
from typing import Any

from ._resources import CRD_GROUP, ResourceType

__all__ = [
    "SERVER_FIELDS",
    "carry_server_fields",
    "initial_status",
    "is_spec_changed",
    "new_name",
    "now",
    "stamp_new",
]

# Fields only the server may set; a client's update can neither change nor drop them.
SERVER_FIELDS = ("uid", "creationTimestamp", "deletionTimestamp", "deletionGracePeriodSeconds", "generation")


def now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def new_name(metadata: dict[str, Any]) -> str | None:
    """The given name, or one made from ``generateName`` as the server does."""
    if metadata.get("name"):
        return str(metadata["name"])
    if metadata.get("generateName"):
        return f"{metadata['generateName']}{secrets.token_hex(3)[:5]}"
    return None


def _crd_status(crd: dict[str, Any]) -> dict[str, Any]:
    """A CRD is established at once: there is no controller to wait for."""
    conditions = [
        {"type": kind, "status": "True", "reason": reason, "message": "", "lastTransitionTime": now()}
        for kind, reason in (("NamesAccepted", "NoConflicts"), ("Established", "InitialNamesAccepted"))
    ]
    versions = [
        version["name"] for version in crd.get("spec", {}).get("versions", ()) if version.get("storage")
    ]
    return {
        "acceptedNames": copy.deepcopy(crd["spec"]["names"]),
        "conditions": conditions,
        "storedVersions": versions,
    }


def initial_status(rtype: ResourceType, obj: dict[str, Any]) -> dict[str, Any] | None:
    """Status on creation: the client's status is ignored where the type has a status subresource."""
    if (rtype.group, rtype.plural) == (CRD_GROUP, "customresourcedefinitions"):
        return _crd_status(obj)
    if (rtype.group, rtype.plural) == ("", "pods"):
        return {"phase": "Pending"}
    if (rtype.group, rtype.plural) == ("", "namespaces"):
        return {"phase": "Active"}
    if rtype.has_status:
        return None if rtype.schema is not None else {}  # custom resources start without a status
    return obj.get("status")


def stamp_new(obj: dict[str, Any], rtype: ResourceType, resource_version: int) -> None:
    meta = obj["metadata"]
    for key in SERVER_FIELDS:
        meta.pop(key, None)
    meta.update(
        uid=str(uuid.uuid4()), creationTimestamp=now(), generation=1, resourceVersion=str(resource_version)
    )
    obj.update(apiVersion=rtype.api_version, kind=rtype.kind)
    status = initial_status(rtype, obj)
    obj.pop("status", None)
    if status is not None:
        obj["status"] = status


def carry_server_fields(new: dict[str, Any], old: dict[str, Any]) -> None:
    """Keep what only the server sets; identity (name, namespace) is checked by the caller."""
    meta, old_meta = new.setdefault("metadata", {}), old["metadata"]
    for key in SERVER_FIELDS:
        meta.pop(key, None)
        if key in old_meta:
            meta[key] = old_meta[key]
    new.update(apiVersion=old["apiVersion"], kind=old["kind"])


def _desired_part(obj: dict[str, Any]) -> dict[str, Any]:
    return {
        key: value for key, value in obj.items() if key not in ("metadata", "status", "apiVersion", "kind")
    }


def is_spec_changed(new: dict[str, Any], old: dict[str, Any]) -> bool:
    """Generation counts changes to everything but metadata and status."""
    return _desired_part(new) != _desired_part(old)
