"""Which chunks earlier requests saw, for ``store_threshold`` and for the junctions where a
request branches off a prefix others shared (the scheduler side's only memory of traffic)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

__all__ = ["MAX_TRACKED_CHUNKS", "ChunkSightings"]

#: chunks whose sightings ``store_threshold`` remembers (LRU; ~100 bytes each)
MAX_TRACKED_CHUNKS = 1 << 18


class ChunkSightings:
    """How many requests saw each chunk (by chunk hash), for ``store_threshold`` and to tell
    which prefixes earlier traffic shared, and whether its pages were ever sent to a backend;
    LRU-bounded."""

    def __init__(self, capacity: int = MAX_TRACKED_CHUNKS) -> None:
        self._counts: OrderedDict[bytes, list[int]] = OrderedDict()  # hash -> [count, stored]
        self._capacity = capacity

    def see(self, chunk_hashes: Iterable[bytes]) -> None:
        for h in chunk_hashes:
            entry = self._counts.setdefault(h, [0, 0])
            entry[0] += 1
            self._counts.move_to_end(h)
        while len(self._counts) > self._capacity:
            self._counts.popitem(last=False)

    def mark_stored(self, chunk_hash: bytes) -> None:
        entry = self._counts.get(chunk_hash)
        if entry is not None:
            entry[1] = 1

    def count(self, chunk_hash: bytes) -> int:
        return self._counts.get(chunk_hash, (0, 0))[0]

    def was_stored(self, chunk_hash: bytes) -> bool:
        return bool(self._counts.get(chunk_hash, (0, 0))[1])

    def shared_chunks(self, chunk_hashes: list[bytes], start: int = 0) -> int:
        """Length of the run of chunks from ``start`` that another request saw too (the request
        itself counts once)."""
        c = start
        while c < len(chunk_hashes) and self.count(chunk_hashes[c]) >= 2:
            c += 1
        return c
