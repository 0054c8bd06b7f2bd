"""Services on this node, a userspace kube-proxy and the cluster DNS in miniature.

Each Service with a ClusterIP 10.96.0.X is served on 127.96.0.X at each of its TCP ports: a
connection goes to the next ready endpoint of the Service's EndpointSlices (round robin), at the
port the slice gives for that service port (the endpointslice controller has already resolved a
named targetPort per pod). Every pod's own ``/etc/hosts`` names each Service by its DNS names and
is rewritten in place (same inode: it is bind-mounted) when Services come and go. Headless Services
get no address, NodePorts and LoadBalancers nothing beyond their ClusterIP, UDP nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from support.node.addresses import HostsEntry, hosts_file, service_loopback

__all__ = ["HostsFile", "Listener", "ServiceTable", "desired_listeners", "ready_endpoints"]

Object = dict[str, Any]
Key = tuple[str, str]
_log = logging.getLogger("herd.node.services")
_SERVICE_NAME = "kubernetes.io/service-name"
_CHUNK = 65536


@dataclass(frozen=True)
class Listener:
    """One proxied port: ``address:port`` to service ``namespace/name``'s port ``port_name``."""

    address: str
    port: int
    namespace: str
    name: str
    port_name: str


def desired_listeners(services: Iterable[Object], service_cidr: str) -> set[Listener]:
    """The loopback listeners for ``services``: every TCP port of each with a ClusterIP."""
    wanted = set()
    for service in services:
        address = service_loopback(service["spec"].get("clusterIP"), service_cidr)
        if address is None:
            continue
        metadata = service["metadata"]
        for port in service["spec"].get("ports") or []:
            if port.get("protocol", "TCP") == "TCP":
                wanted.add(Listener(address, port["port"], metadata["namespace"], metadata["name"], port.get("name", "")))  # fmt: skip
    return wanted


def ready_endpoints(slices: Iterable[Object], port_name: str) -> list[tuple[str, int]]:
    """``(address, port)`` of every ready endpoint of ``slices`` for the service port ``port_name``,
    in a stable order."""
    found: set[tuple[str, int]] = set()
    for endpoint_slice in slices:
        port = next(
            (p["port"] for p in endpoint_slice.get("ports") or [] if p.get("name", "") == port_name), None
        )
        if port is None:
            continue
        for endpoint in endpoint_slice.get("endpoints") or []:
            if (endpoint.get("conditions") or {}).get("ready", True):
                found.update((address, port) for address in endpoint["addresses"])
    return sorted(found)


@dataclass(frozen=True)
class HostsFile:
    """A pod's hosts file and what goes into it besides the Services."""

    path: Path
    pod_ip: str
    hostname: str
    namespace: str


@dataclass
class ServiceTable:
    """Services and EndpointSlices as watched; keeps the listeners and hosts files in step."""

    service_cidr: str
    services: dict[Key, Object] = field(default_factory=dict)
    slices: dict[Key, Object] = field(default_factory=dict)
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

    async def on_slices(self, items: list[Object]) -> None:
        self.slices = {_key(item): item for item in items}

    async def on_slice(self, kind: str, item: Object) -> None:
        if kind == "DELETED":
            self.slices.pop(_key(item), None)
        else:
            self.slices[_key(item)] = item

    def entries(self) -> list[HostsEntry]:
        entries = []
        for (namespace, name), service in self.services.items():
            address = service_loopback(service["spec"].get("clusterIP"), self.service_cidr)
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
        wanted = desired_listeners(self.services.values(), self.service_cidr)
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
        slices = [s for (ns, _), s in self.slices.items()
                  if ns == listener.namespace and _labels(s).get(_SERVICE_NAME) == listener.name]  # fmt: skip
        endpoints = ready_endpoints(slices, listener.port_name)
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


def _labels(item: Mapping[str, Any]) -> dict[str, str]:
    return dict(item["metadata"].get("labels") or {})
