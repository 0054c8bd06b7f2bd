"""A ketama consistent-hash ring that can be walked cheaply and updated incrementally.

Points and key positions come from uhashring's ketama hash, with uhashring's defaults (40 virtual
nodes x 4 replicas = 160 points per worker), so a key lands on the same worker as on
``uhashring.HashRing(ids, hash_fn="ketama")``. uhashring itself is not used for the continuum:
it re-creates it with one ``insort`` per point on every change (about 3 s for 1,000 workers) and
copies the tail of the point list on every walk. Here a worker's points are computed once (one md5
per virtual node), a change sorts the plain integer points again, and a walk is a bisect plus a
few steps. Building the ring for 1,000 workers takes a few tenths of a second instead of seconds.
"""

from __future__ import annotations

import hashlib
from bisect import bisect
from collections.abc import Iterator
from collections.abc import Set as AbstractSet

from uhashring.ring_ketama import KetamaRing as _KetamaHash

__all__ = ["HashRing"]

_VNODES = 40
_REPLICAS = 4


class HashRing:
    def __init__(self) -> None:
        self._hash = _KetamaHash(replicas=_REPLICAS)
        self._owners: dict[int, str] = {}
        """Point -> node; as in uhashring, a later node takes a colliding point."""
        self._points: dict[str, list[int]] = {}
        self._keys: list[int] = []

    def add(self, nodes: AbstractSet[str]) -> None:
        """Add every node not yet on the ring (one sort for the whole batch)."""
        if self._points.keys() >= nodes:
            return
        for node in nodes:
            if node not in self._points:
                self._points[node] = _node_points(node)
                self._owners.update(dict.fromkeys(self._points[node], node))
        self._keys = sorted(self._owners)

    def remove(self, node: str) -> None:
        for point in self._points.pop(node, ()):
            if self._owners.get(point) == node:
                del self._owners[point]
        self._keys = sorted(self._owners)

    def walk(self, key: str) -> Iterator[str]:
        """Distinct nodes clockwise from the key's point: its owner first, then its neighbours."""
        num_points = len(self._keys)
        start = bisect(self._keys, self._hash.hashi(key))
        seen: set[str] = set()
        for step in range(num_points):
            node = self._owners[self._keys[(start + step) % num_points]]
            if node not in seen:
                seen.add(node)
                yield node
                if len(seen) == len(self._points):
                    return


def _node_points(node: str) -> list[int]:
    """uhashring's ketama points of ``node``: ``hashi(f"{node}-{vnode}", replica=r)`` is bytes
    4r..4r+3 of the name's md5, little-endian, so one digest per virtual node gives all four."""
    points: list[int] = []
    for vnode in range(_VNODES):
        digest = hashlib.md5(f"{node}-{vnode}".encode(), usedforsecurity=False).digest()
        points.extend(int.from_bytes(digest[4 * r : 4 * r + 4], "little") for r in range(_REPLICAS))
    return points
