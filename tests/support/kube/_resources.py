"""The resource types the emulator serves: a built-in table plus whatever CRDs declare.

Objects of one group and plural share one storage whatever version they are served at,
as in a real API server (without conversion: all versions see the same fields).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from ._names import version_priority

__all__ = ["BUILTIN_TYPES", "Registry", "ResourceType", "ScalePaths", "types_from_crd"]

CRD_GROUP = "apiextensions.k8s.io"


@dataclass(frozen=True)
class ScalePaths:
    """Where a scalable resource keeps what its ``/scale`` subresource shows (JSON paths, ``.a.b``)."""

    spec_replicas: str = ".spec.replicas"
    status_replicas: str = ".status.replicas"
    label_selector: str | None = None


@dataclass(frozen=True)
class ResourceType:
    group: str
    version: str
    plural: str
    kind: str
    is_namespaced: bool
    singular: str = ""
    short_names: tuple[str, ...] = ()
    categories: tuple[str, ...] = ()
    has_status: bool = False
    scale: ScalePaths | None = None
    schema: Mapping[str, Any] | None = field(default=None, compare=False, hash=False)
    printer_columns: tuple[Mapping[str, Any], ...] = field(default=(), compare=False, hash=False)

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def storage_key(self) -> tuple[str, str]:
        """All versions of a group's resource share one storage."""
        return (self.group, self.plural)

    def names(self) -> set[str]:
        """Every lower-case name a user may call it by (as ``kubectl get NAME`` does)."""
        return {self.plural, self.kind.lower(), self.singular or self.kind.lower(), *self.short_names}


def _builtin(group: str, version: str, plural: str, kind: str, **extra: Any) -> ResourceType:
    return ResourceType(group, version, plural, kind, is_namespaced=extra.pop("namespaced", True), **extra)


_DEPLOYMENT_SCALE = ScalePaths(label_selector=".spec.selector")

BUILTIN_TYPES: tuple[ResourceType, ...] = (
    _builtin("", "v1", "pods", "Pod", short_names=("po",), has_status=True),
    _builtin("", "v1", "services", "Service", short_names=("svc",), has_status=True),
    _builtin("", "v1", "endpoints", "Endpoints", short_names=("ep",)),
    _builtin("", "v1", "events", "Event", short_names=("ev",)),
    _builtin("", "v1", "secrets", "Secret"),
    _builtin("", "v1", "configmaps", "ConfigMap", short_names=("cm",)),
    _builtin("", "v1", "serviceaccounts", "ServiceAccount", short_names=("sa",)),
    _builtin(
        "", "v1", "persistentvolumeclaims", "PersistentVolumeClaim", short_names=("pvc",), has_status=True
    ),
    _builtin("", "v1", "namespaces", "Namespace", namespaced=False, short_names=("ns",), has_status=True),
    _builtin("", "v1", "nodes", "Node", namespaced=False, short_names=("no",), has_status=True),
    _builtin(
        "",
        "v1",
        "persistentvolumes",
        "PersistentVolume",
        namespaced=False,
        short_names=("pv",),
        has_status=True,
    ),
    _builtin(
        "apps",
        "v1",
        "deployments",
        "Deployment",
        short_names=("deploy",),
        has_status=True,
        scale=_DEPLOYMENT_SCALE,
    ),
    _builtin(
        "apps",
        "v1",
        "statefulsets",
        "StatefulSet",
        short_names=("sts",),
        has_status=True,
        scale=_DEPLOYMENT_SCALE,
    ),
    _builtin(
        "apps",
        "v1",
        "replicasets",
        "ReplicaSet",
        short_names=("rs",),
        has_status=True,
        scale=_DEPLOYMENT_SCALE,
    ),
    _builtin(
        CRD_GROUP,
        "v1",
        "customresourcedefinitions",
        "CustomResourceDefinition",
        namespaced=False,
        short_names=("crd", "crds"),
        has_status=True,
    ),
    _builtin("coordination.k8s.io", "v1", "leases", "Lease"),
    _builtin("events.k8s.io", "v1", "events", "Event", short_names=("ev",)),
    _builtin("rbac.authorization.k8s.io", "v1", "roles", "Role"),
    _builtin("rbac.authorization.k8s.io", "v1", "rolebindings", "RoleBinding"),
    _builtin("rbac.authorization.k8s.io", "v1", "clusterroles", "ClusterRole", namespaced=False),
    _builtin(
        "rbac.authorization.k8s.io", "v1", "clusterrolebindings", "ClusterRoleBinding", namespaced=False
    ),
    _builtin(
        "policy", "v1", "poddisruptionbudgets", "PodDisruptionBudget", short_names=("pdb",), has_status=True
    ),
    _builtin(
        "autoscaling",
        "v2",
        "horizontalpodautoscalers",
        "HorizontalPodAutoscaler",
        short_names=("hpa",),
        has_status=True,
    ),
    _builtin("networking.k8s.io", "v1", "networkpolicies", "NetworkPolicy", short_names=("netpol",)),
    _builtin("networking.k8s.io", "v1", "ingresses", "Ingress", short_names=("ing",), has_status=True),
    _builtin(
        "scheduling.k8s.io", "v1", "priorityclasses", "PriorityClass", namespaced=False, short_names=("pc",)
    ),
)


def _scale_paths(subresources: Mapping[str, Any]) -> ScalePaths | None:
    scale = subresources.get("scale")
    if scale is None:
        return None
    return ScalePaths(
        spec_replicas=scale.get("specReplicasPath", ".spec.replicas"),
        status_replicas=scale.get("statusReplicasPath", ".status.replicas"),
        label_selector=scale.get("labelSelectorPath"),
    )


def types_from_crd(crd: Mapping[str, Any]) -> list[ResourceType]:
    """The resource types a CRD makes servable: one per served version."""
    spec = crd.get("spec", {})
    names = spec.get("names", {})
    return [
        ResourceType(
            group=spec["group"],
            version=version["name"],
            plural=names["plural"],
            kind=names["kind"],
            is_namespaced=spec.get("scope", "Namespaced") == "Namespaced",
            singular=names.get("singular", ""),
            short_names=tuple(names.get("shortNames", ())),
            categories=tuple(names.get("categories", ())),
            has_status="status" in version.get("subresources", {}),
            scale=_scale_paths(version.get("subresources", {})),
            schema=version.get("schema", {}).get("openAPIV3Schema"),
            printer_columns=tuple(version.get("additionalPrinterColumns", ())),
        )
        for version in spec.get("versions", ())
        if version.get("served", True)
    ]


@dataclass
class Registry:
    """Built-in types plus the types of every stored CRD, keyed by CRD name."""

    _crd_types: dict[str, list[ResourceType]] = field(default_factory=dict)

    def __iter__(self) -> Iterator[ResourceType]:
        yield from BUILTIN_TYPES
        for types in self._crd_types.values():
            yield from types

    def set_crd(self, name: str, types: Iterable[ResourceType]) -> None:
        self._crd_types[name] = list(types)

    def drop_crd(self, name: str) -> list[ResourceType]:
        return self._crd_types.pop(name, [])

    def lookup(self, group: str, version: str, plural: str) -> ResourceType | None:
        for rtype in self:
            if (rtype.group, rtype.version, rtype.plural) == (group, version, plural):
                return rtype
        return None

    def resolve(self, name: str) -> ResourceType:
        """Find a type by plural, kind, singular or short name, optionally suffixed ``.group``."""
        base, _, group = name.lower().partition(".")
        matches = [rtype for rtype in self if base in rtype.names() and (not group or rtype.group == group)]
        if not matches:
            raise LookupError(f"no resource type is called {name!r}: create its CRD first or fix the name")
        return matches[0]

    def groups(self) -> dict[str, list[str]]:
        """Each API group with its versions, the preferred version (GA over beta over alpha) first."""
        result: dict[str, set[str]] = {}
        for rtype in self:
            result.setdefault(rtype.group, set()).add(rtype.version)
        return {group: sorted(versions, key=version_priority) for group, versions in result.items()}
