"""Kubernetes discovery: workers are the Ready pods of ModelDeployments, found by herd's labels.

Two informers (list, then watch from the list's resourceVersion; relist after a gap or an error)
keep the ModelDeployments and the worker Pods (``app.kubernetes.io/managed-by=herd``) in memory.
After every event the full membership is recomputed and yielded when it differs from the last:
a pod is routable while it is Ready, has an IP and no ``deletionTimestamp``, so it leaves at once
when it is deleted, turns unready or starts terminating. Each model's settings (routing, block
size, mode) come from its ModelDeployment; pods of an unknown or invalid one are not routed to.
Plain REST over ``httpx``, connected through ``herd.kube`` as the operator is.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
from pydantic import ValidationError

from herd.api.crd import API_VERSION, PLURAL, ModelDeployment
from herd.api.protocol import LABEL_DEPLOYMENT, LABEL_MANAGED_BY, LABEL_ROLE, MANAGED_BY, Role
from herd.kube import load_connection, resource_path
from herd.orchestrator.discovery import Membership, ModelConfig, WorkerEndpoint

__all__ = ["KubeSource", "is_routable", "membership_of", "pod_endpoint"]

Object = dict[str, Any]
log = logging.getLogger(__name__)
_ROLES: tuple[Role, ...] = ("unified", "prefill", "decode")
_DEFAULT_PORTS = {"http": 8000, "internal": 9000}
_WATCH_SECONDS = 240
_RETRY_SECONDS = 1.0


def is_routable(pod: Object) -> bool:
    if pod.get("metadata", {}).get("deletionTimestamp") or not pod.get("status", {}).get("podIP"):
        return False
    conditions = pod.get("status", {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def pod_endpoint(pod: Object, model: str) -> WorkerEndpoint | None:
    """The endpoint of a routable worker pod; its ports are the container ports named http/internal.
    ``ValueError``, ``TypeError``, ``KeyError`` or ``AttributeError`` for a malformed pod."""
    role = pod["metadata"].get("labels", {}).get(LABEL_ROLE)
    if role not in _ROLES or not is_routable(pod):
        return None
    ports = dict(_DEFAULT_PORTS)
    for container in pod.get("spec", {}).get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") in ports:
                ports[port["name"]] = _port_number(port.get("containerPort"))
    host = _url_host(pod["status"]["podIP"])
    pod_id = f"{pod['metadata'].get('namespace', 'default')}/{pod['metadata']['name']}"
    return WorkerEndpoint(
        pod_id, model, f"http://{host}:{ports['http']}", f"http://{host}:{ports['internal']}", role
    )


def _port_number(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
        raise ValueError(f"containerPort must be an integer from 1 to 65535, got {value!r:.40}")
    return value


def _url_host(pod_ip: object) -> str:
    """The pod IP as a URL's host: an IPv6 address goes in brackets (``http://[fd00::1]:8000``)."""
    if not isinstance(pod_ip, str):
        raise TypeError(f"podIP must be a string, got {type(pod_ip).__name__}")
    address = ipaddress.ip_address(pod_ip)  # ValueError for anything but an IP address
    return f"[{address}]" if address.version == 6 else str(address)


def membership_of(deployments: list[Object], pods: list[Object]) -> Membership:
    """The full membership implied by the ModelDeployments and pods currently known; a malformed pod
    is left out with a warning, the others still count."""
    models: dict[tuple[str, str], ModelConfig] = {}
    for body in deployments:
        md = _parse(body)
        if md is not None:
            models[(md.metadata.namespace, md.metadata.name)] = ModelConfig.from_deployment(
                md, model_path=_local_path(md)
            )
    endpoints = []
    for pod in pods:
        try:
            endpoint = _endpoint_of(pod, models)
        except (ValueError, TypeError, KeyError, AttributeError) as error:
            log.warning(
                "pod %s is malformed (%s: %s); not routing to it",
                _described(pod),
                type(error).__name__,
                error,
            )
            continue
        if endpoint is not None:
            endpoints.append(endpoint)
    unique = {config.served_name: config for config in sorted(models.values(), key=lambda c: c.served_name)}
    return Membership(tuple(unique.values()), tuple(sorted(endpoints, key=lambda e: e.id)))


def _endpoint_of(pod: Object, models: dict[tuple[str, str], ModelConfig]) -> WorkerEndpoint | None:
    meta = pod.get("metadata", {})
    config = models.get((meta.get("namespace", "default"), meta.get("labels", {}).get(LABEL_DEPLOYMENT, "")))
    return pod_endpoint(pod, config.served_name) if config else None


class KubeSource:
    """A ``WorkerSource`` over the Kubernetes API (one namespace, or all of them)."""

    def __init__(
        self,
        namespace: str | None = None,
        *,
        kubeconfig: str | None = None,
        http: httpx.AsyncClient | None = None,
    ) -> None:
        self.namespace = namespace
        self.kubeconfig = kubeconfig
        self.http = http

    async def watch(self) -> AsyncIterator[Membership]:
        http = self.http or load_connection(self.kubeconfig).http_client()
        changed = asyncio.Event()
        selector = f"{LABEL_MANAGED_BY}={MANAGED_BY}"
        deployments = _Informer(http, resource_path(API_VERSION, PLURAL, self.namespace), None, changed.set)
        pods = _Informer(http, resource_path("v1", "pods", self.namespace), selector, changed.set)
        tasks = [asyncio.create_task(informer.run()) for informer in (deployments, pods)]
        try:
            last: Membership | None = None
            while True:
                await changed.wait()
                changed.clear()
                if not (deployments.is_synced and pods.is_synced):
                    continue
                current = membership_of(list(deployments.objects.values()), list(pods.objects.values()))
                if current != last:
                    last = current
                    yield current
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if self.http is None:
                await http.aclose()


class _Informer:
    """List, then watch from the list's resourceVersion; on any break, list again."""

    def __init__(
        self, http: httpx.AsyncClient, path: str, selector: str | None, on_change: Callable[[], None]
    ) -> None:
        self.http = http
        self.path = path
        self.params = {"labelSelector": selector} if selector else {}
        self.on_change = on_change
        self.objects: dict[str, Object] = {}
        self.is_synced = False

    async def run(self) -> None:
        while True:
            try:
                version = await self._list()
                await self._watch(version)
            # Beyond the network and bad JSON: an event or object of the wrong shape (a list or a
            # string where a mapping belongs) or JSON nested too deeply to decode. A fresh list
            # repairs what the stream got wrong; dying would freeze the membership for good.
            except (
                httpx.HTTPError,
                ValueError,
                KeyError,
                TypeError,
                AttributeError,
                RecursionError,
            ) as error:
                log.warning(
                    "watch of %s broke (%s: %s); listing again in %.0fs",
                    self.path,
                    type(error).__name__,
                    error,
                    _RETRY_SECONDS,
                )
                await asyncio.sleep(_RETRY_SECONDS)

    async def _list(self) -> str:
        response = await self.http.get(self.path, params=self.params)
        response.raise_for_status()
        listing = response.json()
        self.objects = {_key(item): item for item in listing.get("items") or []}
        self.is_synced = True
        self.on_change()
        return str(listing.get("metadata", {}).get("resourceVersion", ""))

    async def _watch(self, version: str) -> None:
        params = {
            **self.params,
            "watch": "true",
            "resourceVersion": version,
            "timeoutSeconds": str(_WATCH_SECONDS),
        }
        async with self.http.stream("GET", self.path, params=params, timeout=_WATCH_SECONDS + 30) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if line.strip() and not self._apply(json.loads(line)):
                    return

    def _apply(self, event: Object) -> bool:
        """Fold one watch event in; False when the watch must restart from a fresh list."""
        kind, obj = event.get("type"), event.get("object") or {}
        if kind == "ERROR":
            return False
        if kind in ("ADDED", "MODIFIED"):
            self.objects[_key(obj)] = obj
        elif kind == "DELETED":
            self.objects.pop(_key(obj), None)
        if kind != "BOOKMARK":
            self.on_change()
        return True


def _key(obj: Object) -> str:
    meta = obj.get("metadata", {})
    return f"{meta.get('namespace', '')}/{meta.get('name', '')}"


def _described(obj: Object) -> str:
    """``_key`` for a log line, also of an object whose metadata is malformed."""
    try:
        return _key(obj)
    except AttributeError:
        return "(no readable name)"


def _parse(body: Object) -> ModelDeployment | None:
    try:
        return ModelDeployment.from_object(body)
    except ValidationError:
        return None  # The operator reports it (Ready=False, InvalidSpec); nothing to route to.


def _local_path(md: ModelDeployment) -> Path | None:
    """The tokenizer folder: a ``file://`` source that also exists where the orchestrator runs."""
    if md.spec.model.scheme != "file":
        return None
    path = Path(md.spec.model.location).resolve()
    return path if path.is_dir() else None
