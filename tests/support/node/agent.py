"""The node agent: ``python -m support.node.agent --kubeconfig K --node herd-node --workdir W
--apiserver-port P [--image-root R]``.

It registers a Ready Node (support.node.node: its Lease and heartbeat renewed every 10 s), watches
every pod, runs those bound to it as local processes (support.node.pods), and serves Services on
loopback to their ready pods, with each pod's ``/etc/hosts`` naming them (support.node.services). On SIGTERM it stops
every container it runs (SIGTERM, a grace of at most 5 s, SIGKILL, each by its pid; no preStop, and
the pods stay as they are in the apiserver) and exits; killed outright, it leaves no container behind
either, since each asked the kernel for SIGKILL when its parent dies.

The liberties it takes with a kubelet's work: pods share the host's network (each listens on its
own 127.244.0.0/16 address, ``0.0.0.0`` in a command line replaced by it); images are not pulled
(a container runs ``command + args`` on this machine's filesystem, in ``workingDir`` or the image
root); securityContext and resources are not enforced; restarts back off 1-10 s.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import json
import logging
import os
import shlex
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from herd.kube import load_connection, resource_path
from support.node.addresses import POD_SPACE, SERVICE_SPACE, AddressPool, claim_block
from support.node.client import Kube, KubeError
from support.node.containers import PodContext
from support.node.node import heartbeat, register
from support.node.pods import PodRunner, pod_folder
from support.node.services import HostsFile, ServiceTable
from support.node.status import now

__all__ = ["Agent", "Settings", "main"]

Object = dict[str, Any]
_log = logging.getLogger("herd.node.agent")
REPO = Path(__file__).resolve().parents[3]
SHUTDOWN_GRACE_S = 5.0
IMAGE_ENV = ("HOME", "LANG", "LC_ALL", "TMPDIR", "OMP_NUM_THREADS", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
"""Variables of the agent's own environment a container gets, as if its image set them."""


@dataclass(frozen=True)
class Settings:
    kubeconfig: str
    node: str
    workdir: Path
    apiserver_port: int
    image_root: Path = REPO
    service_cidr: str = "10.96.0.0/24"
    taints: tuple[Object, ...] = ()
    entrypoints: dict[str, list[str]] = field(default_factory=dict)
    pod_cidr: str | None = None
    """This node's /24 of pod addresses in 127.244.0.0/16; None: the first free one."""
    service_loopback: str | None = None
    """The cluster's /24 of Service addresses in 127.96.0.0/16; None: the first free one (the first
    node of a cluster claims it, a second node of the same cluster is given it)."""


@dataclass
class Agent:
    """The running agent: the pods it runs by uid, their addresses, the Service table."""

    settings: Settings
    kube: Kube
    pool: AddressPool
    services: ServiceTable
    runners: dict[str, PodRunner] = field(default_factory=dict)
    tasks: dict[str, asyncio.Task[None]] = field(default_factory=dict)
    ending: set[str] = field(default_factory=set)
    background: set[asyncio.Task[None]] = field(default_factory=set)

    # Pods.

    def _is_mine(self, pod: Object) -> bool:
        return bool(pod["spec"].get("nodeName") == self.settings.node)

    async def on_pods(self, items: list[Object]) -> None:
        """A fresh list of every pod (the Services' endpoints): of this node's, those no longer there
        are gone (killed), the others handled as changes."""
        self.services.on_pods(items)
        listed = {item["metadata"]["uid"] for item in items if self._is_mine(item)}
        for uid in set(self.runners) - listed:
            self._spawn(self._kill(uid))
        for item in items:
            if self._is_mine(item):
                await self._on_my_pod("MODIFIED", item)

    async def on_pod(self, kind: str, pod: Object) -> None:
        self.services.on_pod(kind, pod)
        if self._is_mine(pod):
            await self._on_my_pod(kind, pod)

    async def _on_my_pod(self, kind: str, pod: Object) -> None:
        uid, metadata = pod["metadata"]["uid"], pod["metadata"]
        if kind == "DELETED":
            if uid in self.runners:
                self._spawn(self._kill(uid))
            return
        if uid in self.runners:
            self.runners[uid].ctx.pod = {**pod, "spec": self.runners[uid].ctx.pod["spec"]}
        if metadata.get("deletionTimestamp"):
            if uid not in self.ending:
                self.ending.add(uid)
                self._spawn(self._terminate(pod))
        elif uid not in self.runners and (pod.get("status") or {}).get("phase") not in (
            "Succeeded",
            "Failed",
        ):
            self._start(pod)

    def _start(self, pod: Object) -> None:
        uid, pod_ip = pod["metadata"]["uid"], self.pool.allocate()
        folder = pod_folder(self.settings.workdir, pod)
        folder.mkdir(parents=True, exist_ok=True)
        hostname = pod["spec"].get("hostname") or pod["metadata"]["name"]
        hosts = HostsFile(folder / "etc-hosts", pod_ip, hostname, pod["metadata"]["namespace"])
        self.services.write_hosts(hosts)
        ctx = PodContext(pod, pod_ip, folder, hosts.path, self.settings.image_root,
                         self._base_env(hostname), _launcher_env(), self.settings.entrypoints)  # fmt: skip
        runner = PodRunner(self.kube, ctx, self.post_event)
        self.runners[uid] = runner
        self.tasks[uid] = _logged(asyncio.ensure_future(runner.run()))

    def _base_env(self, hostname: str) -> dict[str, str]:
        path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "/usr/bin:/bin")])
        image = {name: os.environ[name] for name in IMAGE_ENV if name in os.environ}
        return {"PATH": path, **image, "HOSTNAME": hostname, "KUBERNETES_SERVICE_HOST": "127.0.0.1",
                "KUBERNETES_SERVICE_PORT": str(self.settings.apiserver_port)}  # fmt: skip

    async def _terminate(self, pod: Object) -> None:
        """Graceful deletion; a pod this agent does not run (it restarted) is removed at once."""
        uid = pod["metadata"]["uid"]
        runner = self.runners.get(uid)
        if runner is None:
            metadata = pod["metadata"]
            body = {"gracePeriodSeconds": 0, "preconditions": {"uid": uid}}
            with contextlib.suppress(KubeError):
                await self.kube.request("DELETE", resource_path("v1", "pods", metadata["namespace"], metadata["name"]), body=body)  # fmt: skip
            return
        await runner.terminate(float(pod["metadata"].get("deletionGracePeriodSeconds", 30)))
        await self._forget(uid)

    async def _kill(self, uid: str) -> None:
        runner = self.runners.get(uid)
        if runner is not None:
            await runner.kill()
            await self._forget(uid)

    async def _forget(self, uid: str) -> None:
        """Once every process of the pod is gone: its task ended, its address free again."""
        runner, task = self.runners.pop(uid, None), self.tasks.pop(uid, None)
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if runner is not None:
            self.pool.release(runner.ctx.pod_ip)
            self.services.forget_hosts(runner.ctx.hosts)
        self.ending.discard(uid)

    def _spawn(self, work: Any) -> None:
        task = _logged(asyncio.ensure_future(work))
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    async def post_event(self, pod: Object, kind: str, reason: str, message: str, field_path: str) -> None:
        """An Event about ``pod`` as a kubelet posts it; a refused one is logged, never fatal."""
        metadata, stamp = pod["metadata"], now()
        involved = {"kind": "Pod", "apiVersion": "v1", "namespace": metadata["namespace"],
                    "name": metadata["name"], "uid": metadata["uid"]}  # fmt: skip
        if field_path:
            involved["fieldPath"] = field_path
        event = {"apiVersion": "v1", "kind": "Event", "type": kind, "reason": reason, "message": message,
                 "metadata": {"generateName": f"{metadata['name']}.", "namespace": metadata["namespace"]},
                 "involvedObject": involved, "source": {"component": "kubelet", "host": self.settings.node},
                 "reportingComponent": "herd-node-agent", "reportingInstance": self.settings.node,
                 "firstTimestamp": stamp, "lastTimestamp": stamp, "count": 1}  # fmt: skip
        try:
            await self.kube.create(resource_path("v1", "events", metadata["namespace"]), event)
        except KubeError as error:
            _log.warning(json.dumps({"msg": "event refused", "reason": reason, "error": str(error)}))

    # Running.

    async def serve(self, stop: asyncio.Event) -> None:
        blocks = {"pod-cidr": str(self.pool.network), "service-loopback": self.services.loopback}
        await register(self.kube, self.settings.node, self.settings.taints, blocks)
        loops = [
            heartbeat(self.kube, self.settings.node),
            self.kube.watch("/api/v1/pods", self.on_pods, self.on_pod),
            self.kube.watch("/api/v1/services", self.services.on_services, self.services.on_service),
        ]
        tasks = [asyncio.ensure_future(loop) for loop in loops]
        _log.info(json.dumps({"msg": "node agent serving", "node": self.settings.node, "pid": os.getpid()}))
        await stop.wait()
        for task in tasks:
            task.cancel()
        await self.shut_down()

    async def shut_down(self) -> None:
        """Every container stopped by its pid, the listeners closed."""
        await asyncio.gather(
            *(runner.shut_down(min(runner.ctx.grace_s, SHUTDOWN_GRACE_S)) for runner in self.runners.values())
        )
        for task in [*self.tasks.values(), *self.background]:
            task.cancel()
        self.services.close()
        await self.kube.close()


def _logged(task: asyncio.Task[None]) -> asyncio.Task[None]:
    """``task``, whose failure is logged when it ends (a pod's task failing must not go unseen)."""

    def report(done: asyncio.Task[None]) -> None:
        if not done.cancelled() and done.exception() is not None:
            _log.error(json.dumps({"msg": "pod task failed", "error": repr(done.exception())}), exc_info=done.exception())  # fmt: skip

    task.add_done_callback(report)
    return task


def _launcher_env() -> dict[str, str]:
    """The sandbox launcher's own environment: the agent's, so that ``support.node`` imports."""
    return dict(os.environ)


def _parse(argv: list[str] | None) -> Settings:
    parser = argparse.ArgumentParser(prog="python -m support.node.agent", description=__doc__)
    parser.add_argument("--kubeconfig", required=True)
    parser.add_argument("--node", default="herd-node")
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--apiserver-port", type=int, required=True)
    parser.add_argument("--image-root", type=Path, default=REPO)
    parser.add_argument("--service-cidr", default="10.96.0.0/24")
    parser.add_argument("--pod-cidr", help="a /24 of 127.244.0.0/16 (default: the first free one)")
    parser.add_argument("--service-loopback", help="a /24 of 127.96.0.0/16 (default: the first free one)")
    parser.add_argument("--taint", action="append", default=[], help="key=value:Effect, as the kubelet's --register-with-taints")  # fmt: skip
    parser.add_argument("--entrypoint", action="append", default=[], metavar="IMAGE=COMMAND",
                        help="the entrypoint of an image (repository, no tag), for containers that give only args")  # fmt: skip
    args = parser.parse_args(argv)
    taints = tuple(_taint(text) for text in args.taint)
    entrypoints = {image: shlex.split(command) for image, _, command in (text.partition("=") for text in args.entrypoint)}  # fmt: skip
    return Settings(args.kubeconfig, args.node, args.workdir.resolve(), args.apiserver_port,
                    args.image_root.resolve(), args.service_cidr, taints, entrypoints, args.pod_cidr,
                    args.service_loopback)  # fmt: skip


def _taint(text: str) -> Object:
    pair, _, effect = text.partition(":")
    key, _, value = pair.partition("=")
    return {"key": key, "value": value, "effect": effect or "NoSchedule"}


async def _amain(settings: Settings) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    pods, pod_claim = claim_block(POD_SPACE, settings.pod_cidr)
    services, service_claim = (
        (ipaddress.IPv4Network(settings.service_loopback), None)  # held by the cluster's first node
        if settings.service_loopback
        else claim_block(SERVICE_SPACE)
    )
    table = ServiceTable(settings.service_cidr, str(services), is_proxy=service_claim is not None)
    agent = Agent(settings, Kube(load_connection(settings.kubeconfig)), AddressPool(pods), table)
    try:
        await agent.serve(stop)
    finally:
        for claim in (pod_claim, service_claim):
            if claim is not None:
                claim.close()


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request otherwise
    asyncio.run(_amain(_parse(argv)))


if __name__ == "__main__":
    main()
