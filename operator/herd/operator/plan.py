"""The pure planner: a ModelDeployment becomes the Deployments and Services that should exist.

For each pool (``workers``, or ``prefill`` and ``decode``) it plans a Deployment named
``<md>-<pool>`` and a headless Service of the same name. A pool whose replica spans several pods
(``podsPerReplica`` > 1) gets a LeaderWorkerSet of that name instead of the Deployment
(``leaderworkerset.x-k8s.io/v1``; the LWS controller must be installed): ``replicas`` groups of
``podsPerReplica`` pods, the leader pod serving and carrying the pool's labels (so status, discovery
and the Service see one worker per replica), the follower pods running its ranks under herd's
ownership labels only. With ``spec.gateway.inferencePool`` it also
plans what an Envoy-based gateway needs (``component="gateway"``): herd's endpoint picker (``herd epp``
watching the namespace's workers, as a ServiceAccount with a Role to read pods and ModelDeployments, a
Deployment and a Service ``<md>-epp``) and an ``InferencePool`` ``<md>`` selecting the serving pool's
pods with that picker as its ``endpointPickerRef``. Every object carries herd's labels, and
an annotation with a hash of its desired content, so the applier can tell a changed spec from a
manual edit without a field-by-field diff against server-defaulted objects. The pod template also
carries a hash label of itself, from which status tells updated pods from old ones.
No I/O: the same input always gives the same objects.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Literal

from herd.api.crd import POOL_ROLES, ModelDeployment, PoolName, PoolSpec
from herd.api.protocol import LABEL_DEPLOYMENT, LABEL_MANAGED_BY, LABEL_ROLE, MANAGED_BY, TOKEN_ENV
from herd.operator.pod import HTTP_PORT, INTERNAL_PORT, plan_follower_pod_spec, plan_pod_spec
from herd.operator.settings import PlanSettings

__all__ = [
    "ANNOTATION_SPEC_HASH",
    "EPP_PORT",
    "INFERENCE_POOL_API",
    "LABEL_TEMPLATE_HASH",
    "LWS_API",
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
LABEL_COMPONENT = "app.kubernetes.io/component"
EPP_PORT = 9002
"""The ext_proc and gRPC health port of the endpoint picker, the extension's default."""
INFERENCE_POOL_API = "inference.networking.k8s.io/v1"
LWS_API = "leaderworkerset.x-k8s.io/v1"
LWS_WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"
"""The LWS controller's label of a pod's index in its group ("0": the leader)."""
LABEL_GROUP_ROLE = "herd.dev/group-role"
"""``follower`` on the pods of a multi-pod replica that run ranks and serve nothing."""
_POOL_KINDS = ("Deployment", "LeaderWorkerSet")

Object = dict[str, Any]


@dataclass(frozen=True)
class DesiredObject:
    """One child object: where it lives in the API, and its full desired body."""

    api_version: str
    kind: str
    plural: str
    pool: PoolName
    body: Object
    component: Literal["pool", "gateway"] = "pool"
    """``pool``: a pool's Deployment or Service (status reads them); ``gateway``: the InferencePool and
    the endpoint picker of ``spec.gateway.inferencePool``."""

    @property
    def name(self) -> str:
        return str(self.body["metadata"]["name"])

    @property
    def spec_hash(self) -> str:
        return str(self.body["metadata"]["annotations"][ANNOTATION_SPEC_HASH])

    @property
    def is_workload(self) -> bool:
        """A pool's pods come from it: its Deployment or LeaderWorkerSet."""
        return self.component == "pool" and self.kind in _POOL_KINDS

    @property
    def serving_template(self) -> Object:
        """The pod template of the pool's serving pods: a Deployment's, or the LWS leaders'."""
        spec = self.body["spec"]
        return dict(
            spec["leaderWorkerTemplate"]["leaderTemplate"]
            if self.kind == "LeaderWorkerSet"
            else spec["template"]
        )


@dataclass(frozen=True)
class Plan:
    objects: list[DesiredObject]
    replicas: dict[PoolName, int]

    def summary(self) -> str:
        """One line for the log: ``smollm2: Deployment/smollm2-workers x2, Service/smollm2-workers``."""
        parts = [
            f"{obj.kind}/{obj.name}" + (f" x{self.replicas[obj.pool]}" if obj.is_workload else "")
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
        is_group = pool.pods_per_replica > 1
        objects.append((_leader_worker_set if is_group else _deployment)(md, pool_name, pool, settings))
        objects.append(_service(md, pool_name, leaders_only=is_group))
    if md.spec.gateway.inference_pool:
        objects += _gateway(md, settings)
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


def _leader_worker_set(
    md: ModelDeployment, pool_name: PoolName, pool: PoolSpec, settings: PlanSettings
) -> DesiredObject:
    """``replicas`` groups of ``podsPerReplica`` pods. Each group's services are its own
    (``UniquePerReplica``): LWS's shared one would take the name of the pool's Service. A restarted
    pod recreates its whole group, since its ranks left the others' collectives."""
    labels = pool_labels(md.metadata.name, pool_name)
    leader = plan_pod_spec(md, pool_name, pool, settings)
    follower = plan_follower_pod_spec(md, pool_name, pool, settings)
    owned = {LABEL_MANAGED_BY: MANAGED_BY, LABEL_DEPLOYMENT: md.metadata.name}
    spec = {
        "replicas": pool.replicas,
        "startupPolicy": "LeaderCreated",
        "networkConfig": {"subdomainPolicy": "UniquePerReplica"},
        "leaderWorkerTemplate": {
            "size": pool.pods_per_replica,
            "restartPolicy": "RecreateGroupOnPodRestart",
            "leaderTemplate": {
                "metadata": {"labels": {**labels, LABEL_TEMPLATE_HASH: spec_hash(leader)}},
                "spec": leader,
            },
            "workerTemplate": {
                "metadata": {"labels": {**owned, LABEL_GROUP_ROLE: "follower"}},
                "spec": follower,
            },
        },
    }
    return _desired(LWS_API, "LeaderWorkerSet", "leaderworkersets", pool_name, md, labels, spec)


def _service(md: ModelDeployment, pool_name: PoolName, *, leaders_only: bool = False) -> DesiredObject:
    """The pool's headless Service; of a multi-pod pool's leaders only (the followers serve nothing)."""
    labels = pool_labels(md.metadata.name, pool_name)
    ports = [("http", HTTP_PORT), ("internal", INTERNAL_PORT)]
    spec = {
        "clusterIP": "None",
        "selector": {**labels, **({LWS_WORKER_INDEX_LABEL: "0"} if leaders_only else {})},
        "ports": [
            {"name": name, "port": port, "targetPort": name, "protocol": "TCP"} for name, port in ports
        ],
    }
    return _desired("v1", "Service", "services", pool_name, md, labels, spec)


def _gateway(md: ModelDeployment, settings: PlanSettings) -> list[DesiredObject]:
    """The endpoint picker (its account, Role, binding, Deployment and Service) and the InferencePool."""
    name, namespace, pool = f"{md.metadata.name}-epp", md.metadata.namespace, md.spec.serving_pool
    labels = {LABEL_MANAGED_BY: MANAGED_BY, LABEL_DEPLOYMENT: md.metadata.name, LABEL_COMPONENT: "epp"}
    rules = [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
        {"apiGroups": ["herd.dev"], "resources": ["modeldeployments"], "verbs": ["get", "list", "watch"]},
    ]
    binding = {
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": namespace}],
    }
    deployment = {
        "replicas": 1,
        "selector": {"matchLabels": dict(labels)},
        "template": {"metadata": {"labels": dict(labels)}, "spec": _epp_pod(name, namespace, settings)},
    }
    service = {
        "selector": dict(labels),
        "ports": [
            {
                "name": "grpc",
                "port": EPP_PORT,
                "targetPort": "grpc",
                "protocol": "TCP",
                "appProtocol": "http2",
            }
        ],
    }
    inference_pool = {
        "selector": {"matchLabels": pool_labels(md.metadata.name, pool)},
        "targetPorts": [{"number": HTTP_PORT}],
        "endpointPickerRef": {"name": name, "port": {"number": EPP_PORT}, "failureMode": "FailClose"},
    }
    rbac = "rbac.authorization.k8s.io/v1"
    parts: list[tuple[str, str, str, str, Object]] = [
        ("v1", "ServiceAccount", "serviceaccounts", name, {}),
        (rbac, "Role", "roles", name, {"rules": rules}),
        (rbac, "RoleBinding", "rolebindings", name, binding),
        ("apps/v1", "Deployment", "deployments", name, {"spec": deployment}),
        ("v1", "Service", "services", name, {"spec": service}),
        (INFERENCE_POOL_API, "InferencePool", "inferencepools", md.metadata.name, {"spec": inference_pool}),
    ]
    return [
        _desired(api, kind, plural, pool, md, labels, content, name=obj_name, component="gateway")
        for api, kind, plural, obj_name, content in parts
    ]


def _epp_pod(name: str, namespace: str, settings: PlanSettings) -> Object:
    """``herd epp`` watching this namespace's worker pods; probed over its gRPC health services."""
    argv = [
        "herd",
        "epp",
        "--kubernetes",
        "--namespace",
        namespace,
        "--host",
        "0.0.0.0",
        "--port",
        str(EPP_PORT),
    ]
    token = {
        "name": TOKEN_ENV,
        "valueFrom": {"secretKeyRef": {"name": settings.token_secret, "key": "token"}},
    }
    container = {
        "name": "epp",
        "image": settings.epp_image,
        "args": argv[1:],
        "env": [token],
        "ports": [{"name": "grpc", "containerPort": EPP_PORT, "protocol": "TCP"}],
        "livenessProbe": {"grpc": {"port": EPP_PORT, "service": "liveness"}, "periodSeconds": 10},
        "readinessProbe": {"grpc": {"port": EPP_PORT, "service": "readiness"}, "periodSeconds": 2},
        "securityContext": {
            "runAsNonRoot": True,
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"},
        },
    }
    return {"serviceAccountName": name, "containers": [container]}


def _desired(
    api_version: str,
    kind: str,
    plural: str,
    pool: PoolName,
    md: ModelDeployment,
    labels: dict[str, str],
    spec: Object,
    *,
    name: str | None = None,
    component: Literal["pool", "gateway"] = "pool",
) -> DesiredObject:
    """A child named ``name`` (``<md>-<pool>``) whose content is ``spec`` (a pool's) or, for the
    gateway's objects, the top-level fields besides the metadata (``spec``, ``rules``, ``roleRef``...)."""
    content = {"spec": spec} if component == "pool" else spec
    metadata = {
        "name": name or child_name(md.metadata.name, pool),
        "namespace": md.metadata.namespace,
        "labels": dict(labels),
        "annotations": {ANNOTATION_SPEC_HASH: spec_hash({"labels": labels, **_hashed(content)})},
    }
    body = {"apiVersion": api_version, "kind": kind, "metadata": metadata, **content}
    return DesiredObject(api_version, kind, plural, pool, body, component)


def _hashed(content: Object) -> Object:
    return content if content else {"spec": {}}
