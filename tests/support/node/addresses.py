"""Addresses on loopback: pod IPs, Services' loopback addresses and each pod's ``/etc/hosts``.

Every pod shares the host's network namespace, so each gets its own loopback address and a server
that binds ``0.0.0.0`` is bound to that address instead (the one liberty this agent takes with a
pod's command line). A Service's ClusterIP 10.96.0.X is served on 127.96.B.X: the host part of the
ClusterIP is kept, the network is loopback, and nothing dials the service CIDR.

Several control planes may run on one machine at once (tests of several engineers, a test's own
cluster beside the session's), so each agent claims a /24 of pod addresses in 127.244.0.0/16 and each
cluster a /24 of Service addresses in 127.96.0.0/16, the first free ones: a claim is a socket bound to
the block's .0 address (which no pod or Service uses), held as long as the agent lives. The first
agent on a machine gets 127.244.0.0/24 and 127.96.0.0/24.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable
from dataclasses import dataclass, field

__all__ = [
    "ANY_ADDRESS",
    "POD_SPACE",
    "SERVICE_SPACE",
    "AddressPool",
    "HostsEntry",
    "bind_pod_ip",
    "claim_block",
    "hosts_file",
    "service_loopback",
]

POD_SPACE = ipaddress.IPv4Network("127.244.0.0/16")
SERVICE_SPACE = ipaddress.IPv4Network("127.96.0.0/16")
ANY_ADDRESS = "0.0.0.0"
_CLAIM_PORT = 65244  # above the ephemeral range, on addresses nothing else uses


def claim_block(space: ipaddress.IPv4Network, wanted: str | None = None) -> tuple[ipaddress.IPv4Network, socket.socket]:  # fmt: skip
    """``wanted`` (a /24), or the first /24 of ``space`` that no other agent holds, and the socket
    that holds it until closed."""
    blocks = [ipaddress.IPv4Network(wanted)] if wanted else list(space.subnets(new_prefix=24))
    for block in blocks:
        claim = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            claim.bind((str(block.network_address), _CLAIM_PORT))
        except OSError:
            claim.close()
            continue
        return block, claim
    raise RuntimeError(
        f"no free /24 in {wanted or space}: other node agents on this machine hold them; "
        "stop the control planes left running (make cluster-down) or name a free block"
    )


@dataclass
class AddressPool:
    """Pod IPs from ``network``, the lowest free one first (.1 upward); released ones are reused."""

    network: ipaddress.IPv4Network
    taken: set[int] = field(default_factory=set)

    def allocate(self) -> str:
        for offset in range(1, self.network.num_addresses - 1):
            if offset not in self.taken:
                self.taken.add(offset)
                return str(self.network.network_address + offset)
        raise RuntimeError(f"every address of {self.network} is taken: delete pods or widen the pod network")

    def release(self, address: str) -> None:
        self.taken.discard(int(ipaddress.IPv4Address(address)) - int(self.network.network_address))


def service_loopback(cluster_ip: str | None, service_cidr: str, loopback: str) -> str | None:
    """127.96.B.X of the ``loopback`` block for the ClusterIP 10.96.0.X of ``service_cidr``; None for a
    headless Service (``None``), no ClusterIP, or one outside the CIDR."""
    if not cluster_ip or cluster_ip == "None":
        return None
    address, network = ipaddress.IPv4Address(cluster_ip), ipaddress.IPv4Network(service_cidr)
    block = ipaddress.IPv4Network(loopback)
    if address not in network:
        return None
    host_part = int(address) - int(network.network_address)
    if host_part >= block.num_addresses:
        return None
    return str(block.network_address + host_part)


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
