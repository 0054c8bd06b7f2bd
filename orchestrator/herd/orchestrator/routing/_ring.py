"""A ketama consistent-hash ring that can be walked cheaply and updated incrementally.

Points and key positions come from uhashring's ketama hash, with uhashring's defaults (40 virtual
nodes x 4 replicas = 160 points per worker), so a key lands on the same worker as on
``uhashring.HashRing(ids, hash_fn="ketama")``. uhashring itself is not used for the continuum:
it re-creates it with one ``insort`` per point on every change (about 3 s for 1,000 workers) and
copies the tail of the point list on every walk; here a worker's points are computed once, a
change re-sorts the nearly sorted list, and a walk is a bisect plus a few steps.
"""

from __future__ import annotations

from bisect import bisect
from collections.abc import Collection, Iterator

from uhashring.ring_ketama import KetamaRing as _KetamaHash

__all__ = ["HashRing"]

_VNODES = 40
_REPLICAS = 4


class HashRing:
    def __init__(self) -> None:
        self._hash = _KetamaHash(replicas=_REPLICAS)
        self._points: list[tuple[int, str]] = []
        self._keys: list[int] = []
        self._members: set[str] = set()

    def __contains__(self, node: str) -> bool:
        return node in self._members

    def add(self, nodes: Collection[str]) -> None:
        """Add every node not yet on the ring (one re-sort for the whole batch)."""
        if self._members.issuperset(nodes):
            return
        new = [node for node in nodes if node not in self._members]
        self._members.update(new)
        self._points.extend(point for node in new for point in self._node_points(node))
        self._points.sort()
        self._keys = [point for point, _ in self._points]

    def remove(self, node: str) -> None:
        if node not in self._members:
            return
        self._members.discard(node)
        self._points = [point for point in self._points if point[1] != node]
        self._keys = [point for point, _ in self._points]

    def walk(self, key: str) -> Iterator[str]:
        """Distinct nodes clockwise from the key's point: its owner first, then its neighbours."""
        num_points = len(self._keys)
        start = bisect(self._keys, self._hash.hashi(key))
        seen: set[str] = set()
        for step in range(num_points):
            node = self._points[(start + step) % num_points][1]
            if node not in seen:
                seen.add(node)
                yield node
                if len(seen) == len(self._members):
                    return

    def _node_points(self, node: str) -> Iterator[tuple[int, str]]:
        for vnode in range(_VNODES):
            for replica in range(_REPLICAS):
                yield self._hash.hashi(f"{node}-{vnode}", replica=replica), node
