"""Discovery documents (legacy, unaggregated): what kubectl, kopf and the python client read first.

kmock 0.8 answers ``/api/v1`` with nothing for the core group and builds ``/apis`` from its reactions;
these come from the emulator's registry instead, so a new CRD is discoverable as soon as it is stored.
"""

from __future__ import annotations

from typing import Any

from ._resources import Registry, ResourceType

__all__ = ["api_group", "api_groups", "api_resources", "api_versions", "server_version"]

_VERBS = ["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"]
_SUBRESOURCE_VERBS = ["get", "patch", "update"]


def server_version() -> dict[str, str]:
    return {
        "major": "1",
        "minor": "32",
        "gitVersion": "v1.32.0-herd-emulator",
        "gitCommit": "0" * 40,
        "gitTreeState": "clean",
        "buildDate": "2026-01-01T00:00:00Z",
        "goVersion": "go1.23.0",
        "compiler": "gc",
        "platform": "linux/amd64",
    }


def api_versions(address: str) -> dict[str, Any]:
    return {
        "kind": "APIVersions",
        "versions": ["v1"],
        "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": address}],
    }


def _group_version(group: str, version: str) -> dict[str, str]:
    return {"groupVersion": f"{group}/{version}", "version": version}


def api_group(group: str, versions: list[str]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "APIGroup",
        "name": group,
        "versions": [_group_version(group, version) for version in versions],
        "preferredVersion": _group_version(group, versions[0]),
    }


def api_groups(registry: Registry) -> dict[str, Any]:
    groups = [api_group(group, versions) for group, versions in registry.groups().items() if group]
    return {"apiVersion": "v1", "kind": "APIGroupList", "groups": groups}


def _subresource(rtype: ResourceType, name: str, **kind: str) -> dict[str, Any]:
    entry = {"name": f"{rtype.plural}/{name}", "singularName": "", "namespaced": rtype.is_namespaced}
    return {**entry, "kind": rtype.kind, **kind, "verbs": _SUBRESOURCE_VERBS}


def _entries(rtype: ResourceType) -> list[dict[str, Any]]:
    """The type itself, then its status and scale subresources (kopf looks for ``<plural>/status``)."""
    main = {
        "name": rtype.plural,
        "singularName": rtype.singular or rtype.kind.lower(),
        "namespaced": rtype.is_namespaced,
        "kind": rtype.kind,
        "verbs": _VERBS,
        "shortNames": list(rtype.short_names),
        "categories": list(rtype.categories),
    }
    status = [_subresource(rtype, "status")] if rtype.has_status else []
    scale = (
        [_subresource(rtype, "scale", group="autoscaling", version="v1", kind="Scale")] if rtype.scale else []
    )
    return [main, *status, *scale]


def api_resources(registry: Registry, group: str, version: str) -> dict[str, Any] | None:
    """The APIResourceList of one group version, or None where nothing is served there."""
    types = [rtype for rtype in registry if (rtype.group, rtype.version) == (group, version)]
    if not types:
        return None
    group_version = f"{group}/{version}" if group else version
    resources = [entry for rtype in types for entry in _entries(rtype)]
    return {
        "apiVersion": "v1",
        "kind": "APIResourceList",
        "groupVersion": group_version,
        "resources": resources,
    }
