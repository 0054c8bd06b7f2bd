"""The pure planner: a ModelDeployment becomes the Deployments and Services that should exist.

For each pool (``workers``, or ``prefill`` and ``decode``) it plans a Deployment named
``<md>-<pool>`` and a headless Service of the same name. Every object carries herd's labels, and
an annotation with a hash of its desired content, so the applier can tell a changed spec from a
manual edit without a field-by-field diff against server-defaulted objects. The pod template also
carries a hash label of itself, from which status tells updated pods from old ones.
No I/O: the same input always gives the same objects.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from herd.api.crd import POOL_ROLES, ModelDeployment, PoolName, PoolSpec
from herd.api.protocol import LABEL_DEPLOYMENT, LABEL_MANAGED_BY, LABEL_ROLE, MANAGED_BY
from herd.operator.pod import HTTP_PORT, INTERNAL_PORT, plan_pod_spec
from herd.operator.settings import PlanSettings

__all__ = [
    "ANNOTATION_SPEC_HASH",
    "LABEL_TEMPLATE_HASH",
    "DesiredObject",
    "Plan",
    "child_name",
    "plan",
    "pool_labels",
    "selector_string",
    "spec_hash",
]

ANNOTATION_SPEC_HASH = "herd.dev/spec-hash"
LABEL_TEMPLATE_HASH = "herd.dev/template-hash"

Object = dict[str, Any]


@dataclass(frozen=True)
class DesiredObject:
    """One child object: where it lives in the API, and its full desired body."""

    api_version: str
    kind: str
    plural: str
    pool: PoolName
    body: Object

    @property
    def name(self) -> str:
        return str(self.body["metadata"]["name"])

    @property
    def spec_hash(self) -> str:
        return str(self.body["metadata"]["annotations"][ANNOTATION_SPEC_HASH])


@dataclass(frozen=True)
class Plan:
    objects: list[DesiredObject]
    replicas: dict[PoolName, int]

    def summary(self) -> str:
        """One line for the log: ``smollm2: Deployment/smollm2-workers x2, Service/smollm2-workers``."""
        parts = [
            f"{obj.kind}/{obj.name}" + (f" x{self.replicas[obj.pool]}" if obj.kind == "Deployment" else "")
            for obj in self.objects
        ]
        return ", ".join(parts)


def child_name(md_name: str, pool: PoolName) -> str:
    return f"{md_name}-{pool}"


def pool_labels(md_name: str, pool: PoolName) -> dict[str, str]:
    return {LABEL_MANAGED_BY: MANAGED_BY, LABEL_DEPLOYMENT: md_name, LABEL_ROLE: POOL_ROLES[pool]}


def selector_string(labels: dict[str, str]) -> str:
    return ",".join(f"{key}={value}" for key, value in sorted(labels.items()))


def spec_hash(content: Any) -> str:
    canonical = json.dumps(content, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def plan(md: ModelDeployment, settings: PlanSettings) -> Plan:
    pools = md.spec.pools()
    objects = []
    for pool_name, pool in pools.items():
        objects.append(_deployment(md, pool_name, pool, settings))
        objects.append(_service(md, pool_name))
    return Plan(objects, {name: pool.replicas for name, pool in pools.items()})


def _deployment(
    md: ModelDeployment, pool_name: PoolName, pool: PoolSpec, settings: PlanSettings
) -> DesiredObject:
    labels = pool_labels(md.metadata.name, pool_name)
    pod_spec = plan_pod_spec(md, pool_name, pool, settings)
    template_labels = {**labels, LABEL_TEMPLATE_HASH: spec_hash(pod_spec)}
    spec = {
        "replicas": pool.replicas,
        "selector": {"matchLabels": dict(labels)},
        "template": {"metadata": {"labels": template_labels}, "spec": pod_spec},
    }
    return _desired("apps/v1", "Deployment", "deployments", pool_name, md, labels, spec)


def _service(md: ModelDeployment, pool_name: PoolName) -> DesiredObject:
    labels = pool_labels(md.metadata.name, pool_name)
    ports = [("http", HTTP_PORT), ("internal", INTERNAL_PORT)]
    spec = {
        "clusterIP": "None",
        "selector": dict(labels),
        "ports": [
            {"name": name, "port": port, "targetPort": name, "protocol": "TCP"} for name, port in ports
        ],
    }
    return _desired("v1", "Service", "services", pool_name, md, labels, spec)


def _desired(
    api_version: str,
    kind: str,
    plural: str,
    pool: PoolName,
    md: ModelDeployment,
    labels: dict[str, str],
    spec: Object,
) -> DesiredObject:
    metadata = {
        "name": child_name(md.metadata.name, pool),
        "namespace": md.metadata.namespace,
        "labels": dict(labels),
        "annotations": {ANNOTATION_SPEC_HASH: spec_hash({"labels": labels, "spec": spec})},
    }
    body = {"apiVersion": api_version, "kind": kind, "metadata": metadata, "spec": spec}
    return DesiredObject(api_version, kind, plural, pool, body)
