"""The pod template of one worker pool: the containers that serve herd's worker contract and
everything around them.

A ``herd`` or ``simulated`` pool runs one ``herd worker`` container (the simulated one fetches no
weights). A ``vllm`` pool runs two: vLLM's server on the pod's loopback, and ``herd sidecar`` on
the worker's ``http`` and ``internal`` ports in front of it, so that the Service, discovery and
readiness are the same for every backend.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from herd.api.backends import lora_module_args, sidecar_argv, vllm_server_argv
from herd.api.crd import POOL_ROLES, ModelDeployment, PoolName, PoolSpec, Resources, VLLMSpec
from herd.api.protocol import TOKEN_ENV
from herd.operator.settings import PlanSettings
from herd.operator.source import ModelSource, adapter_place, plan_source

__all__ = ["HTTP_PORT", "INTERNAL_PORT", "plan_pod_spec", "worker_argv"]

HTTP_PORT = 8000
INTERNAL_PORT = 9000
VLLM_PORT = 8100
"""vLLM's HTTP port in a vllm pool, on the pod's loopback; the KV event ports follow."""
VLLM_KV_EVENTS_PORT = 5557
VLLM_KV_REPLAY_PORT = 5558
_GPU_RESOURCE = {"nvidia": "nvidia.com/gpu", "amd": "amd.com/gpu"}
# Neither the worker nor the fetchers need privileges; GPUs come through the device plugin.
_CONTAINER_SECURITY = {
    "runAsNonRoot": True,
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}

Object = dict[str, Any]


def worker_argv(
    md: ModelDeployment, pool: PoolName, model_path: str, adapters: Mapping[str, str] | None = None
) -> list[str]:
    """The worker command line; the pool's engine settings travel as one camelCase JSON argument,
    the LoRA adapters (name -> folder in the pod) as ``--lora-modules``."""
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
        *lora_module_args(adapters or {}),
    ]  # fmt: skip


def plan_sources(
    md: ModelDeployment, settings: PlanSettings, image: str
) -> tuple[ModelSource, dict[str, str]]:
    """The model's source and every adapter's in one (volumes, mounts and fetchers together), and
    each adapter's folder in the pod."""
    needs_weights = md.spec.engine.backend != "simulated"
    model = plan_source(md.spec.model, settings, worker_image=image, needs_weights=needs_weights)
    adapters = [
        plan_source(
            adapter.as_model(),
            settings,
            worker_image=image,
            needs_weights=needs_weights,
            place=adapter_place(index),
        )
        for index, adapter in enumerate(md.spec.adapters)
    ]
    merged = ModelSource(
        model.path,
        [volume for source in (model, *adapters) for volume in source.volumes],
        [mount for source in (model, *adapters) for mount in source.mounts],
        [init for source in (model, *adapters) for init in source.init_containers],
    )
    return merged, {
        adapter.name: source.path for adapter, source in zip(md.spec.adapters, adapters, strict=True)
    }


def plan_pod_spec(md: ModelDeployment, pool_name: PoolName, pool: PoolSpec, settings: PlanSettings) -> Object:
    image = pool.image or settings.worker_image
    source, adapters = plan_sources(md, settings, image)
    if md.spec.engine.backend == "vllm":
        containers = [
            _vllm_container(md, pool_name, pool, settings, source, adapters),
            _sidecar_container(md, pool, settings, image, source),
        ]
    else:
        containers = [_worker_container(md, pool_name, pool, settings, image, source, adapters)]
    spec: Object = {
        "securityContext": _pod_security(settings),
        "containers": containers,
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
    adapters: Mapping[str, str],
) -> Object:
    """``herd worker``: herd's engine, or the simulated one (the argv's engine JSON says which)."""
    argv = worker_argv(md, pool_name, source.path, adapters)
    return _serving_container("worker", image, argv, plan_resources(pool.resources), pool, settings, source)


def _sidecar_container(
    md: ModelDeployment, pool: PoolSpec, settings: PlanSettings, image: str, source: ModelSource
) -> Object:
    """``herd sidecar``: herd's worker contract in front of the vLLM container, on the worker's
    ports, so that discovery, the Service and the probes see a worker like any other."""
    argv = sidecar_argv(
        vllm_port=VLLM_PORT,
        kv_events_port=VLLM_KV_EVENTS_PORT,
        replay_port=VLLM_KV_REPLAY_PORT,
        served_name=md.served_name,
        model_path=source.path,
        block_size=md.spec.engine.kv_cache.block_size,
        host="0.0.0.0",  # probes and the orchestrator come from outside the pod
        port=HTTP_PORT,
        internal_port=INTERNAL_PORT,
    )
    # No resources of its own: the accelerator and the memory are vLLM's.
    return _serving_container("sidecar", image, argv, {}, pool, settings, source)


def _serving_container(
    name: str,
    image: str,
    argv: list[str],
    resources: Object,
    pool: PoolSpec,
    settings: PlanSettings,
    source: ModelSource,
) -> Object:
    """The container that answers herd's worker contract on the ``http`` and ``internal`` ports."""
    container: Object = {
        "name": name,
        "image": image,
        "command": argv,
        "ports": [
            {"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"},
            {"name": "internal", "containerPort": INTERNAL_PORT, "protocol": "TCP"},
        ],
        "env": _env(pool, settings),
        "resources": resources,
        **_probes(),
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(settings.drain_seconds)]}}},
        "volumeMounts": source.mounts,
        "securityContext": _CONTAINER_SECURITY,
    }
    return _without_empty(container, keep=set())


def _vllm_container(
    md: ModelDeployment,
    pool_name: PoolName,
    pool: PoolSpec,
    settings: PlanSettings,
    source: ModelSource,
    adapters: Mapping[str, str],
) -> Object:
    """vLLM's server, on the pod's loopback only (the sidecar is its one client): no ports, no
    readiness of its own (the sidecar's says when vLLM serves), liveness by its ``/health``."""
    engine = md.spec.engine_for(pool_name)
    vllm = engine.vllm or VLLMSpec()
    argv = vllm_server_argv(
        engine,
        source.path,
        md.served_name,
        VLLM_PORT,
        VLLM_KV_EVENTS_PORT,
        VLLM_KV_REPLAY_PORT,
        python="python3",
        adapters=adapters,
    )
    container: Object = {
        "name": "vllm",
        "image": vllm.image or settings.vllm_image,
        "command": argv,
        "env": [{"name": name, "value": value} for name, value in sorted(pool.env.items())],
        "resources": plan_resources(pool.resources),
        **_vllm_probes(),
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


def _probe(handler: Object, period: int, timeout: int, failures: int) -> Object:
    return {**handler, "periodSeconds": period, "timeoutSeconds": timeout, "failureThreshold": failures}


def _probes() -> Object:
    def probe(path: str, period: int, timeout: int, failures: int) -> Object:
        return _probe({"httpGet": {"path": path, "port": "http"}}, period, timeout, failures)

    # /health: the process can serve (liveness: restart it when it cannot); /ready: it admits requests
    # (503 while loading, draining or full: out of the Service, never restarted for it). Loading a
    # large model takes minutes: the startup probe holds liveness off until /health first answers.
    # The timeouts leave room for a busy CPU worker, whose answers are slower than the 1 s default.
    # Startup and readiness probe every second: a new pod (a scale-up, a start from zero) takes
    # requests within a second of loading its model, not within a probe period of 5 s; the startup
    # budget stays 10 minutes.
    return {
        "startupProbe": probe("/health", 1, 5, 600),
        "livenessProbe": probe("/health", 10, 5, 3),
        "readinessProbe": probe("/ready", 1, 3, 1),
    }


def _vllm_probes() -> Object:
    # vLLM listens on the pod's loopback, which the kubelet's httpGet (to the pod IP) cannot reach:
    # the check runs inside the container, with the Python its image has.
    url = f"http://127.0.0.1:{VLLM_PORT}/health"
    check = {
        "exec": {
            "command": ["python3", "-c", f"import urllib.request; urllib.request.urlopen({url!r}, timeout=4)"]
        }
    }
    return {"startupProbe": _probe(check, 5, 5, 180), "livenessProbe": _probe(check, 10, 5, 3)}
