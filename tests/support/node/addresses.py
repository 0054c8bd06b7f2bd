"""Addresses on loopback: pod IPs, Services' loopback addresses and each pod's ``/etc/hosts``.

Every pod shares the host's network namespace, so each gets its own loopback address from
127.244.0.0/16 and a server that binds ``0.0.0.0`` is bound to that address instead (the one liberty
this agent takes with a pod's command line). A Service's ClusterIP 10.96.0.X is served on 127.96.0.X:
the host part of the ClusterIP is kept, the network is loopback, and nothing dials the service CIDR.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass, field

__all__ = [
    "ANY_ADDRESS",
    "POD_NETWORK",
    "SERVICE_LOOPBACK",
    "AddressPool",
    "HostsEntry",
    "bind_pod_ip",
    "hosts_file",
    "service_loopback",
]

POD_NETWORK = ipaddress.IPv4Network("127.244.0.0/16")
SERVICE_LOOPBACK = ipaddress.IPv4Network("127.96.0.0/24")
ANY_ADDRESS = "0.0.0.0"


@dataclass
class AddressPool:
    """Pod IPs from ``network``, the lowest free one first (.0.1 upward); released ones are reused."""

    network: ipaddress.IPv4Network = POD_NETWORK
    taken: set[int] = field(default_factory=set)

    def allocate(self) -> str:
        for offset in range(1, self.network.num_addresses - 1):
            if offset not in self.taken:
                self.taken.add(offset)
                return str(self.network.network_address + offset)
        raise RuntimeError(f"every address of {self.network} is taken: delete pods or widen the pod network")

    def release(self, address: str) -> None:
        self.taken.discard(int(ipaddress.IPv4Address(address)) - int(self.network.network_address))


def service_loopback(cluster_ip: str | None, service_cidr: str) -> str | None:
    """127.96.0.X for the ClusterIP 10.96.0.X of ``service_cidr``; None for a headless Service
    (``None``), no ClusterIP, or one outside the CIDR."""
    if not cluster_ip or cluster_ip == "None":
        return None
    address, network = ipaddress.IPv4Address(cluster_ip), ipaddress.IPv4Network(service_cidr)
    if address not in network:
        return None
    host_part = int(address) - int(network.network_address)
    if host_part >= SERVICE_LOOPBACK.num_addresses:
        return None
    return str(SERVICE_LOOPBACK.network_address + host_part)


def bind_pod_ip(words: Iterable[str], pod_ip: str) -> list[str]:
    """``words`` with every ``0.0.0.0`` (alone or inside a URL) replaced by the pod's own IP."""
    return [word.replace(ANY_ADDRESS, pod_ip) for word in words]


@dataclass(frozen=True)
class HostsEntry:
    """A Service a pod may name: ``name.namespace`` at its loopback ``address``."""

    name: str
    namespace: str
    address: str


def hosts_file(pod_ip: str, hostname: str, namespace: str, services: Iterable[HostsEntry]) -> str:
    """A pod's ``/etc/hosts``: loopback, the pod's hostname, and every Service by its DNS names
    (the short name only for Services of the pod's own namespace, as the cluster DNS's search path)."""
    lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback", f"{pod_ip}\t{hostname}"]
    for entry in sorted(services, key=lambda entry: (entry.namespace, entry.name)):
        fqdn = f"{entry.name}.{entry.namespace}"
        names = [f"{fqdn}.svc.cluster.local", f"{fqdn}.svc", fqdn]
        if entry.namespace == namespace:
            names.append(entry.name)
        lines.append(f"{entry.address}\t{' '.join(names)}")
    return "\n".join(lines) + "\n"
