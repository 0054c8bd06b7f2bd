"""Services on this node, a userspace kube-proxy and the cluster DNS in miniature.

Each Service with a ClusterIP 10.96.0.X is served on 127.96.B.X at each of its TCP ports: a
connection goes to the next ready pod the Service selects (round robin), at the port its targetPort
names (a number, or a container port's name). kube-proxy reads EndpointSlices instead; here they
stay empty: the apiserver refuses loopback addresses in them ("may not be in the loopback range"),
so the endpointslice controller cannot list these pods, and the proxy reads the pods themselves. Every pod's own ``/etc/hosts`` names each Service by its DNS names and
is rewritten in place (same inode: it is bind-mounted) when Services come and go. Headless Services
get no address, NodePorts and LoadBalancers nothing beyond their ClusterIP, UDP nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from support.node.addresses import HostsEntry, hosts_file, service_loopback

__all__ = ["HostsFile", "Listener", "ServiceTable", "desired_listeners", "service_endpoints"]

Object = dict[str, Any]
Key = tuple[str, str]
_log = logging.getLogger("herd.node.services")
_CHUNK = 65536


@dataclass(frozen=True)
class Listener:
    """One proxied port: ``address:port`` to the same port of Service ``namespace/name``."""

    address: str
    port: int
    namespace: str
    name: str


def desired_listeners(services: Iterable[Object], service_cidr: str, loopback: str) -> set[Listener]:
    """The loopback listeners for ``services``: every TCP port of each with a ClusterIP."""
    wanted = set()
    for service in services:
        address = service_loopback(service["spec"].get("clusterIP"), service_cidr, loopback)
        if address is None:
            continue
        metadata = service["metadata"]
        for port in service["spec"].get("ports") or []:
            if port.get("protocol", "TCP") == "TCP":
                wanted.add(Listener(address, port["port"], metadata["namespace"], metadata["name"]))
    return wanted


def service_endpoints(service: Object, port: Object, pods: Iterable[Object]) -> list[tuple[str, int]]:
    """``(pod IP, target port)`` of every ready, not terminating pod ``service`` selects for its
    ``port``, in a stable order; a named targetPort is looked up in each pod's container ports."""
    selector = service["spec"].get("selector") or {}
    target: int | str = port.get("targetPort") or port["port"]
    found: set[tuple[str, int]] = set()
    for pod in pods:
        labels, status = pod["metadata"].get("labels") or {}, pod.get("status") or {}
        if not selector or any(labels.get(key) != value for key, value in selector.items()):
            continue
        if pod["metadata"].get("deletionTimestamp") or not status.get("podIP") or not _is_ready(status):
            continue
        number = _target_port(pod, target)
        if number is not None:
            found.add((status["podIP"], number))
    return sorted(found)


def _is_ready(status: Object) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in status.get("conditions") or [])


def _target_port(pod: Object, target: int | str) -> int | None:
    if isinstance(target, int) or target.isdigit():
        return int(target)
    ports = [p for c in pod["spec"]["containers"] for p in c.get("ports") or [] if p.get("name") == target]
    return int(ports[0]["containerPort"]) if ports else None


@dataclass(frozen=True)
class HostsFile:
    """A pod's hosts file and what goes into it besides the Services."""

    path: Path
    pod_ip: str
    hostname: str
    namespace: str


@dataclass
class ServiceTable:
    """Services and pods as watched; keeps the listeners and hosts files in step."""

    service_cidr: str
    loopback: str
    """The block of loopback addresses this cluster's Services are served on (127.96.B.0/24)."""
    is_proxy: bool = True
    """Whether this agent serves them (the cluster's first node does; another only names them)."""
    services: dict[Key, Object] = field(default_factory=dict)
    pods: dict[Key, Object] = field(default_factory=dict)
    servers: dict[Listener, asyncio.Server] = field(default_factory=dict)
    hosts: dict[Path, HostsFile] = field(default_factory=dict)
    turns: dict[Listener, itertools.count[int]] = field(default_factory=dict)

    async def on_services(self, items: list[Object]) -> None:
        self.services = {_key(item): item for item in items}
        await self._sync()

    async def on_service(self, kind: str, item: Object) -> None:
        if kind == "DELETED":
            self.services.pop(_key(item), None)
        else:
            self.services[_key(item)] = item
        await self._sync()

    def on_pods(self, items: list[Object]) -> None:
        self.pods = {_key(item): item for item in items}

    def on_pod(self, kind: str, item: Object) -> None:
        if kind == "DELETED":
            self.pods.pop(_key(item), None)
        else:
            self.pods[_key(item)] = item

    def entries(self) -> list[HostsEntry]:
        entries = []
        for (namespace, name), service in self.services.items():
            address = service_loopback(service["spec"].get("clusterIP"), self.service_cidr, self.loopback)
            if address is not None:
                entries.append(HostsEntry(name, namespace, address))
        return entries

    def write_hosts(self, hosts: HostsFile) -> None:
        """Write (or rewrite in place: the same inode stays bind-mounted) one pod's hosts file."""
        text = hosts_file(hosts.pod_ip, hosts.hostname, hosts.namespace, self.entries()).encode()
        hosts.path.touch()
        with hosts.path.open("r+b") as sink:
            sink.write(text)
            sink.truncate()
        self.hosts[hosts.path] = hosts

    def forget_hosts(self, path: Path) -> None:
        self.hosts.pop(path, None)

    async def _sync(self) -> None:
        wanted = (
            desired_listeners(self.services.values(), self.service_cidr, self.loopback)
            if self.is_proxy
            else set()
        )
        for listener in set(self.servers) - wanted:
            self.servers.pop(listener).close()
        for listener in wanted - set(self.servers):
            with contextlib.suppress(OSError):
                await self._listen(listener)
        for hosts in list(self.hosts.values()):
            self.write_hosts(hosts)

    async def _listen(self, listener: Listener) -> None:
        async def proxy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await self._proxy(listener, reader, writer)

        try:
            self.servers[listener] = await asyncio.start_server(proxy, listener.address, listener.port)
        except OSError as error:
            _log.warning(json.dumps({"msg": "cannot serve a Service port", "listener": str(listener), "error": str(error)}))  # fmt: skip
            raise

    def pick(self, listener: Listener) -> tuple[str, int] | None:
        """The next ready endpoint for ``listener`` (round robin), None when it has none."""
        service = self.services.get((listener.namespace, listener.name))
        ports = (service or {}).get("spec", {}).get("ports") or []
        port = next((p for p in ports if p["port"] == listener.port), None)
        if service is None or port is None:
            return None
        pods = (pod for (namespace, _), pod in self.pods.items() if namespace == listener.namespace)
        endpoints = service_endpoints(service, port, pods)
        if not endpoints:
            return None
        turn = next(self.turns.setdefault(listener, itertools.count()))
        return endpoints[turn % len(endpoints)]

    async def _proxy(
        self, listener: Listener, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        endpoint = self.pick(listener)
        try:
            if endpoint is None:
                return  # no ready endpoint: the connection is closed, as kube-proxy rejects it
            upstream_reader, upstream_writer = await asyncio.open_connection(*endpoint)
            try:
                await asyncio.gather(_pump(reader, upstream_writer), _pump(upstream_reader, writer))
            finally:
                upstream_writer.close()
        except OSError:
            pass  # the endpoint refused or a side went away: the client sees its connection end
        finally:
            writer.close()

    def close(self) -> None:
        for server in self.servers.values():
            server.close()
        self.servers.clear()


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while chunk := await reader.read(_CHUNK):
            writer.write(chunk)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except OSError:
        writer.close()


def _key(item: Object) -> Key:
    return item["metadata"]["namespace"], item["metadata"]["name"]
