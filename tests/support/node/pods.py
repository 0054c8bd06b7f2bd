"""One pod on this node: its folder, volumes and hosts file, its init containers in order then its
containers, its status sent promptly (each change wakes the publisher), and its end: a graceful
termination when its deletionTimestamp is set, a kill at once when it is removed outright.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from herd.kube import resource_path
from support.node.client import Kube, KubeError
from support.node.containers import ContainerRunner, PodContext
from support.node.env import decoded_data
from support.node.status import PodRecord, now, pod_status, waiting
from support.node.volumes import VolumeError, materialise, token_refresh_s

__all__ = ["PodRunner", "pod_folder"]

Object = dict[str, Any]
_log = logging.getLogger("herd.node.pods")
_MOUNT_RETRY_S = 1.0
_MOUNT_TRIES = 60
EventSink = Callable[[Object, str, str, str, str], Awaitable[None]]
"""(pod, type, reason, message, fieldPath) -> an Event posted about the pod."""


def pod_folder(root: Path, pod: Object) -> Path:
    metadata = pod["metadata"]
    return root / "pods" / f"{metadata['namespace']}_{metadata['name']}_{metadata['uid']}"


class PodRunner:
    """Runs one pod until it is deleted; :meth:`run` is its task."""

    def __init__(self, kube: Kube, ctx: PodContext, post_event: EventSink) -> None:
        self.kube, self.ctx, self.post_event = kube, ctx, post_event
        spec = ctx.pod["spec"]
        self.init = [ContainerRunner(ctx, c, is_init=True) for c in spec.get("initContainers") or []]
        self.containers = [ContainerRunner(ctx, c) for c in spec["containers"]]
        first = "PodInitializing" if self.init else "ContainerCreating"
        for runner in self.containers:
            runner.record.state = waiting(first)
        self.record = PodRecord(
            spec.get("restartPolicy", "Always"), ctx.pod_ip, now(),
            [r.record for r in self.init], [r.record for r in self.containers],
        )  # fmt: skip
        self.conditions: list[Object] = list((ctx.pod.get("status") or {}).get("conditions") or [])
        self.dirty = asyncio.Event()
        self.is_terminating = False
        self.publish_lock = asyncio.Lock()
        ctx.changed, ctx.event, ctx.fetch = self.dirty.set, self._container_event, self._fetch

    @property
    def path(self) -> str:
        metadata = self.ctx.pod["metadata"]
        return resource_path("v1", "pods", metadata["namespace"], metadata["name"])

    async def run(self) -> None:
        helpers = [asyncio.ensure_future(self._publish_changes())]
        try:
            self.dirty.set()
            if await self._prepare():
                helpers.append(asyncio.ensure_future(self._renew_tokens()))
                await self._run_containers()
        finally:
            await self.publish()
            for helper in helpers:
                helper.cancel()
            await asyncio.gather(*helpers, return_exceptions=True)

    async def _renew_tokens(self) -> None:
        """The volumes written again before the ServiceAccount tokens in them expire."""
        period = token_refresh_s(self.ctx.pod)
        while period is not None:
            await asyncio.sleep(period)
            try:
                await materialise(self.kube, self.ctx.pod, self.ctx.folder / "volumes")
            except (VolumeError, KubeError) as error:
                _log.warning(
                    json.dumps({"msg": "token renewal failed", "pod": self.path, "error": str(error)})
                )

    async def _prepare(self) -> bool:
        """The pod's folder and volumes; False (the pod failed, or went) when they cannot be made."""
        self.ctx.folder.mkdir(parents=True, exist_ok=True)
        for attempt in range(_MOUNT_TRIES):
            try:
                self.ctx.volumes = await materialise(self.kube, self.ctx.pod, self.ctx.folder / "volumes")
                return True
            except VolumeError as error:
                await self.post_event(self.ctx.pod, "Warning", error.reason, error.message, "")
                if error.is_permanent or attempt == _MOUNT_TRIES - 1 or self.is_terminating:
                    self.record.failure = (error.reason, error.message)
                    return False
            await asyncio.sleep(_MOUNT_RETRY_S)
        return False

    async def _run_containers(self) -> None:
        for runner in self.init:
            if self.is_terminating or await runner.run() != 0:
                return
        self.dirty.set()
        if not self.is_terminating:
            await asyncio.gather(*(runner.run() for runner in self.containers))

    async def _fetch(self, kind: str, name: str) -> dict[str, str] | None:
        body = await self.kube.get(
            resource_path("v1", f"{kind.lower()}s", self.ctx.pod["metadata"]["namespace"], name)
        )
        return None if body is None else decoded_data(kind, body)

    async def _container_event(self, kind: str, reason: str, message: str, container: str) -> None:
        group = "initContainers" if any(r.name == container for r in self.init) else "containers"
        await self.post_event(self.ctx.pod, kind, reason, message, f"spec.{group}{{{container}}}")

    async def _publish_changes(self) -> None:
        while True:
            await self.dirty.wait()
            self.dirty.clear()
            await self.publish()

    async def publish(self) -> None:
        """Send the status now (a 404 means the pod is gone: nothing to do)."""
        async with self.publish_lock:
            status = pod_status(self.record, self.conditions)
            try:
                await self.kube.patch_status(self.path, status)
                self.conditions = status["conditions"]
            except KubeError as error:
                _log.warning(json.dumps({"msg": "pod status refused", "pod": self.path, "error": str(error)}))

    async def terminate(self, grace_s: float) -> None:
        """The kubelet's graceful deletion: preStop, SIGTERM, SIGKILL when ``grace_s`` runs out, the
        final status, then the pod removed (grace 0, only this uid)."""
        self.is_terminating = True
        await asyncio.gather(*(runner.stop(grace_s) for runner in [*self.init, *self.containers]))
        await self.publish()
        metadata = self.ctx.pod["metadata"]
        body = {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0,
                "preconditions": {"uid": metadata["uid"]}}  # fmt: skip
        with contextlib.suppress(KubeError):  # 409: a pod of the same name and another uid
            await self.kube.request("DELETE", self.path, body=body)

    async def kill(self) -> None:
        """The pod is gone from the apiserver: every process SIGKILLed at once."""
        self.is_terminating = True
        await asyncio.gather(*(runner.kill() for runner in [*self.init, *self.containers]))

    async def shut_down(self, grace_s: float) -> None:
        """The agent is stopping: SIGTERM, SIGKILL after ``grace_s``; no hooks, the pod stays."""
        self.is_terminating = True
        for runner in [*self.init, *self.containers]:
            runner.spec = {**runner.spec, "lifecycle": {}}
        await asyncio.gather(*(runner.stop(grace_s) for runner in [*self.init, *self.containers]))
