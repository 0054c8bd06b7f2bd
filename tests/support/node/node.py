"""The Node object and its liveness: registered as a kubelet registers itself, Ready at once, its
Lease in kube-node-lease and its conditions' heartbeat renewed every 10 s."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import platform
from datetime import UTC, datetime
from typing import Any

from herd.kube import resource_path
from support.node.client import Kube, KubeError
from support.node.status import now

__all__ = ["heartbeat", "node_object", "register"]

Object = dict[str, Any]
_log = logging.getLogger("herd.node.node")
LEASE_S = 40
RENEW_S = 10.0
_ARCH = {"x86_64": "amd64", "aarch64": "arm64"}
_MERGE = "application/merge-patch+json"
_CONDITIONS = (
    ("MemoryPressure", "False", "KubeletHasSufficientMemory", "kubelet has sufficient memory available"),
    ("DiskPressure", "False", "KubeletHasNoDiskPressure", "kubelet has no disk pressure"),
    ("PIDPressure", "False", "KubeletHasSufficientPID", "kubelet has sufficient PID available"),
    ("Ready", "True", "KubeletReady", "herd node agent is posting ready status"),
)


def node_object(node: str, kubelet_version: str, taints: tuple[Object, ...] = ()) -> Object:
    """The Node as a kubelet registers it: labels, generous capacity, loopback addresses, Ready."""
    arch = _ARCH.get(platform.machine(), platform.machine())
    resources = {"cpu": "64", "memory": "256Gi", "pods": "110", "ephemeral-storage": "1Ti"}
    labels = {"kubernetes.io/hostname": node, "kubernetes.io/os": "linux", "kubernetes.io/arch": arch,
              "beta.kubernetes.io/os": "linux", "beta.kubernetes.io/arch": arch}  # fmt: skip
    info = {"kubeletVersion": kubelet_version, "kubeProxyVersion": kubelet_version, "operatingSystem": "linux",
            "architecture": arch, "osImage": "herd test node", "kernelVersion": platform.release(),
            "containerRuntimeVersion": "herd://0.1.0", "machineID": node, "systemUUID": node, "bootID": node}  # fmt: skip
    stamp = now()
    conditions = [{"type": kind, "status": status, "reason": reason, "message": message,
                   "lastHeartbeatTime": stamp, "lastTransitionTime": stamp}
                  for kind, status, reason, message in _CONDITIONS]  # fmt: skip
    addresses = [{"type": "InternalIP", "address": "127.0.0.1"}, {"type": "Hostname", "address": node}]
    status = {"capacity": resources, "allocatable": resources, "addresses": addresses, "nodeInfo": info,
              "conditions": conditions, "daemonEndpoints": {"kubeletEndpoint": {"Port": 0}}}  # fmt: skip
    spec = {"taints": list(taints)} if taints else {}
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": node, "labels": labels}, "spec": spec, "status": status}  # fmt: skip


async def register(kube: Kube, node: str, taints: tuple[Object, ...], blocks: dict[str, str]) -> None:
    """The Node created (or found, after a restart) with its status, its taints as given, its Lease,
    and its address ``blocks`` as ``herd.dev/<name>`` annotations (ControlPlane reads them)."""
    version = await kube.get("/version")
    assert version is not None, "the apiserver has no /version"
    body = node_object(node, version["gitVersion"], taints)
    with contextlib.suppress(KubeError):  # 409: registered before (an agent restarted)
        await kube.create("/api/v1/nodes", body)
    path = f"/api/v1/nodes/{node}"
    await kube.patch_status(path, body["status"])
    # The TaintNodesByCondition admission plugin taints a new Node not-ready; the node lifecycle
    # controller (not run here) would lift it once Ready: the agent, Ready at once, does.
    annotations = {f"herd.dev/{name}": block for name, block in blocks.items()}
    patch = {"metadata": {"annotations": annotations}, "spec": {"taints": list(taints) or None}}
    await kube.request("PATCH", path, body=patch, content_type=_MERGE)
    await _renew_lease(kube, node)


async def _renew_lease(kube: Kube, node: str) -> None:
    renewed = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    spec = {"holderIdentity": node, "leaseDurationSeconds": LEASE_S, "renewTime": renewed}
    path = resource_path("coordination.k8s.io/v1", "leases", "kube-node-lease", node)
    if await kube.request("PATCH", path, body={"spec": spec}, content_type=_MERGE) is None:
        metadata = {"name": node, "namespace": "kube-node-lease"}
        lease = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": metadata, "spec": spec}
        await kube.create(resource_path("coordination.k8s.io/v1", "leases", "kube-node-lease"), lease)


async def heartbeat(kube: Kube, node: str) -> None:
    """The Lease every 10 s and the conditions' heartbeat with it (their transition times kept)."""
    while True:
        await asyncio.sleep(RENEW_S)
        beats = [{"type": kind, "lastHeartbeatTime": now()} for kind, *_ in _CONDITIONS]
        try:
            await _renew_lease(kube, node)
            await kube.patch_status(f"/api/v1/nodes/{node}", {"conditions": beats})
        except KubeError as error:
            _log.warning(json.dumps({"msg": "node heartbeat refused", "error": str(error)}))
