"""REST paths of namespaced and cluster-wide collections and objects."""

from __future__ import annotations

__all__ = ["resource_path"]


def resource_path(api_version: str, plural: str, namespace: str | None, name: str | None = None) -> str:
    """``/api/v1/...`` for the core group, ``/apis/<group>/<version>/...`` otherwise; a ``namespace``
    of None is the collection across every namespace."""
    prefix = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    path = f"{prefix}/namespaces/{namespace}/{plural}" if namespace else f"{prefix}/{plural}"
    return f"{path}/{name}" if name else path
