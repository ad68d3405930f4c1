"""Consistent hashing of page keys onto peers (virtual nodes, xxh3-64).

Each node owns ``vnodes`` points on a 64-bit ring at ``xxh3_64("<node>#<i>")``; a key belongs to
the first point at or after ``xxh3_64(key)`` (wrapping). Adding or removing a node moves only
the keys whose first point belonged to (or now belongs to) that node. Stable across processes
and runs (no Python ``hash()``), so the scheduler and worker processes agree.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence

import xxhash

__all__ = ["HashRing"]


class HashRing:
    """Immutable ring over ``nodes`` (distinct strings)."""

    def __init__(self, nodes: Iterable[str], vnodes: int = 160) -> None:
        self.nodes: tuple[str, ...] = tuple(nodes)
        if not self.nodes:
            raise ValueError("a hash ring needs at least one node")
        if len(set(self.nodes)) != len(self.nodes):
            raise ValueError(f"duplicate nodes in {self.nodes}")
        if vnodes < 1:
            raise ValueError("vnodes must be >= 1")
        points = sorted(
            (xxhash.xxh3_64_intdigest(f"{node}#{i}".encode()), n)
            for n, node in enumerate(self.nodes)
            for i in range(vnodes)
        )
        self._hashes = [h for h, _ in points]
        self._owners = [n for _, n in points]

    def index_for(self, key: str) -> int:
        """Position in :attr:`nodes` of the node owning ``key``."""
        i = bisect.bisect_left(self._hashes, xxhash.xxh3_64_intdigest(key.encode()))
        return self._owners[i if i < len(self._owners) else 0]

    def node_for(self, key: str) -> str:
        return self.nodes[self.index_for(key)]

    def group(self, keys: Sequence[str]) -> dict[int, list[int]]:
        """Node position -> positions in ``keys`` that it owns (input order kept)."""
        groups: dict[int, list[int]] = {}
        for i, key in enumerate(keys):
            groups.setdefault(self.index_for(key), []).append(i)
        return groups
