"""The pod template of one worker pool: the ``herd worker`` container and everything around it."""

from __future__ import annotations

import json
from typing import Any

from herd.api.crd import POOL_ROLES, ModelDeployment, PoolName, PoolSpec, Resources
from herd.api.protocol import TOKEN_ENV
from herd.operator.settings import PlanSettings
from herd.operator.source import ModelSource, plan_source

__all__ = ["HTTP_PORT", "INTERNAL_PORT", "plan_pod_spec", "worker_argv"]

HTTP_PORT = 8000
INTERNAL_PORT = 9000
_GPU_RESOURCE = {"nvidia": "nvidia.com/gpu", "amd": "amd.com/gpu"}
# Neither the worker nor the fetchers need privileges; GPUs come through the device plugin.
_CONTAINER_SECURITY = {
    "runAsNonRoot": True,
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}

Object = dict[str, Any]


def worker_argv(md: ModelDeployment, pool: PoolName, model_path: str) -> list[str]:
    """The worker command line; the pool's engine settings travel as one camelCase JSON argument."""
    engine = md.spec.engine_for(pool).model_dump(by_alias=True, mode="json", exclude_none=True)
    return [
        "herd", "worker",
        "--model", model_path,
        "--served-name", md.served_name,
        "--role", POOL_ROLES[pool],
        "--engine-json", json.dumps(engine, sort_keys=True, separators=(",", ":")),
        "--host", "0.0.0.0",  # the worker binds loopback by default; probes and peers come from outside
        "--port", str(HTTP_PORT),
        "--internal-port", str(INTERNAL_PORT),
    ]  # fmt: skip


def plan_pod_spec(md: ModelDeployment, pool_name: PoolName, pool: PoolSpec, settings: PlanSettings) -> Object:
    image = pool.image or settings.worker_image
    source = plan_source(md.spec.model, settings, worker_image=image)
    worker = _worker_container(md, pool_name, pool, settings, image, source)
    spec: Object = {
        "securityContext": _pod_security(settings),
        "containers": [worker],
        "initContainers": [
            {**init, "securityContext": _CONTAINER_SECURITY} for init in source.init_containers
        ],
        "volumes": source.volumes,
        "nodeSelector": dict(pool.node_selector),
        "tolerations": list(pool.tolerations),
        # The preStop pause runs inside the grace period, so the drain budget comes on top of it.
        "terminationGracePeriodSeconds": settings.drain_seconds + settings.grace_seconds,
    }
    return _without_empty(spec, keep={"containers"})


def _worker_container(
    md: ModelDeployment,
    pool_name: PoolName,
    pool: PoolSpec,
    settings: PlanSettings,
    image: str,
    source: ModelSource,
) -> Object:
    container: Object = {
        "name": "worker",
        "image": image,
        "command": worker_argv(md, pool_name, source.path),
        "ports": [
            {"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"},
            {"name": "internal", "containerPort": INTERNAL_PORT, "protocol": "TCP"},
        ],
        "env": _env(pool, settings),
        "resources": plan_resources(pool.resources),
        **_probes(),
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(settings.drain_seconds)]}}},
        "volumeMounts": source.mounts,
        "securityContext": _CONTAINER_SECURITY,
    }
    return _without_empty(container, keep=set())


def plan_resources(resources: Resources) -> Object:
    """Accelerators are limits (Kubernetes wants them there); cpu and memory are requests."""
    requests = {
        name: value for name, value in (("cpu", resources.cpu), ("memory", resources.memory)) if value
    }
    accelerator = resources.accelerator
    limits = {}
    if accelerator.vendor != "none" and accelerator.count > 0:
        limits[_GPU_RESOURCE[accelerator.vendor]] = str(accelerator.count)
    return {key: value for key, value in (("requests", requests), ("limits", limits)) if value}


def _pod_security(settings: PlanSettings) -> Object:
    # An explicit user: runAsNonRoot alone rejects a pool image whose USER is root or a name.
    return {
        "runAsNonRoot": True,
        "runAsUser": settings.run_as_user,
        "runAsGroup": settings.run_as_user,
        "fsGroup": settings.fs_group,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _without_empty(fields: Object, *, keep: set[str]) -> Object:
    # The API server drops empty lists and maps; leaving them out keeps desired and observed alike.
    return {key: value for key, value in fields.items() if value or key in keep}


def _env(pool: PoolSpec, settings: PlanSettings) -> list[Object]:
    token = {
        "name": TOKEN_ENV,
        "valueFrom": {"secretKeyRef": {"name": settings.token_secret, "key": "token"}},
    }
    return [token, *({"name": name, "value": value} for name, value in sorted(pool.env.items()))]


def _probes() -> Object:
    def probe(path: str, period: int, timeout: int, failures: int) -> Object:
        return {
            "httpGet": {"path": path, "port": "http"},
            "periodSeconds": period,
            "timeoutSeconds": timeout,
            "failureThreshold": failures,
        }

    # /health: the process can serve (liveness: restart it when it cannot); /ready: it admits requests
    # (503 while loading, draining or full: out of the Service, never restarted for it). Loading a
    # large model takes minutes: the startup probe holds liveness off until /health first answers.
    # The timeouts leave room for a busy CPU worker, whose answers are slower than the 1 s default.
    return {
        "startupProbe": probe("/health", 5, 5, 120),
        "livenessProbe": probe("/health", 10, 5, 3),
        "readinessProbe": probe("/ready", 2, 3, 1),
    }
