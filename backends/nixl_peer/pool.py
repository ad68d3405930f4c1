"""The cache peer's page index and pool allocator (pure bookkeeping: no sockets, no NIXL).

* :class:`ExtentAllocator` hands out 64-byte aligned extents of the pool, first fit over a
  sorted list of free extents, coalescing neighbours on free.
* :class:`PageIndex` maps keys to extents with LRU order (by last commit or GET; an
  :class:`~hybrid_offload.backends.lru_index.LruIndex`), bounded by ``capacity`` counted in
  page bytes (not aligned extent bytes). The pool is sized with slack
  above the capacity, so logical LRU decides evictions; only when a physical allocation still
  fails are more LRU pages evicted.
* Two-phase store: :meth:`PageIndex.alloc` reserves extents (invisible to readers),
  :meth:`PageIndex.commit` makes them visible atomically (replacing older versions, evicting LRU
  pages to stay within capacity). Reservations never committed expire. Reserving does not make
  room by evicting committed pages beyond :attr:`PageIndex.reserve_limit` bytes reserved in
  all (the pool's slack above capacity, at least 1/8 of it): past that, ALLOC refuses the page
  (uncommitted reservations cannot empty the pool; commits evict, by LRU, to stay in capacity).
* Ownership: every lease and reservation belongs to the owner (connection) that made it; a
  RELEASE or COMMIT by another owner is refused (:class:`NotOwnedError`), and each owner holds
  at most ``max_pending`` open leases and ``max_pending`` open reservations
  (:class:`PendingLimitError`).
* Reads: :meth:`PageIndex.get` pins the extents under a lease; an extent replaced, evicted or
  deleted while pinned is freed only when its last lease is released or expires.
* Listing: each page keeps the clock time of its last commit or GET; :func:`scan_pages` picks
  a key-ordered slice of a :meth:`PageIndex.pages_snapshot` without the lock.

Not thread-safe by itself: the server calls it under one lock.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from ..lru_index import Entry, LruIndex

__all__ = [
    "ALIGN",
    "Extent",
    "ExtentAllocator",
    "NotOwnedError",
    "PageIndex",
    "PendingLimitError",
    "PoolStats",
    "scan_pages",
]

ALIGN = 64


def _align(n: int) -> int:
    return (n + ALIGN - 1) & ~(ALIGN - 1)


@dataclass(eq=False)
class Extent:
    """A piece of the pool; ``size`` is the aligned bytes held (0 for an empty page)."""

    offset: int
    size: int
    pins: int = 0
    dead: bool = False  # no longer indexed: free it once unpinned


class ExtentAllocator:
    """First-fit allocator over ``[0, size)`` with coalescing of free neighbours."""

    def __init__(self, size: int) -> None:
        self.size = size - size % ALIGN
        self._starts: list[int] = [0] if self.size else []  # sorted free extent offsets
        self._lengths: dict[int, int] = {0: self.size} if self.size else {}
        self.free_bytes = self.size

    def alloc(self, nbytes: int) -> Extent | None:
        """An extent of at least ``nbytes`` (aligned), or None if no free extent is large enough."""
        need = _align(nbytes)
        if need == 0:
            return Extent(0, 0)
        for i, start in enumerate(self._starts):
            length = self._lengths[start]
            if length < need:
                continue
            del self._lengths[start]
            if length == need:
                del self._starts[i]
            else:
                self._starts[i] = start + need
                self._lengths[start + need] = length - need
            self.free_bytes -= need
            return Extent(start, need)
        return None

    def free(self, extent: Extent) -> None:
        if extent.size == 0:
            return
        start, length = extent.offset, extent.size
        i = bisect.bisect_left(self._starts, start)
        if i < len(self._starts) and self._starts[i] < start + length:
            raise RuntimeError(f"double free of pool extent at {start}")
        self.free_bytes += length
        # merge with the following free extent
        if i < len(self._starts) and self._starts[i] == start + length:
            length += self._lengths.pop(self._starts[i])
            del self._starts[i]
        # merge with the preceding free extent
        if i > 0:
            prev = self._starts[i - 1]
            if prev + self._lengths[prev] == start:
                self._lengths[prev] += length
                return
            if prev + self._lengths[prev] > start:
                raise RuntimeError(f"double free of pool extent at {start}")
        self._starts.insert(i, start)
        self._lengths[start] = length

    @property
    def free_extents(self) -> int:
        return len(self._starts)


@dataclass
class _Page:
    size: int
    extent: Extent
    used_at: float = 0.0  # clock time of the last commit or GET


@dataclass
class _Reservation:
    owner: object
    deadline: float
    items: list[tuple[str, int, Extent | None]]
    evictions: int = 0
    evicted_bytes: int = 0


@dataclass
class _Lease:
    owner: object
    deadline: float
    extents: list[Extent] = field(default_factory=list)


class NotOwnedError(LookupError):
    """A lease or reservation id used by an owner that did not make it."""


class PendingLimitError(RuntimeError):
    """The owner already holds ``max_pending`` open leases (or reservations)."""


@dataclass(frozen=True)
class PoolStats:
    used: int
    reserved: int
    free: int
    pages: int


class PageIndex:
    """Key -> extent index with LRU, leases and reservations (see the module docstring)."""

    def __init__(
        self,
        capacity: int,
        pool_size: int,
        *,
        lease_timeout_s: float = 30.0,
        alloc_timeout_s: float = 30.0,
        max_pending: int = 64,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.allocator = ExtentAllocator(pool_size)
        size = self.allocator.size
        #: reserved bytes beyond which ALLOC refuses instead of evicting committed pages
        self.reserve_limit = max(size - capacity, size // 8)
        self.max_pending = max_pending
        self.lease_timeout_s = lease_timeout_s
        self.alloc_timeout_s = alloc_timeout_s
        self._clock = clock
        self._pages: LruIndex[_Page] = LruIndex(capacity)  # bounds committed page bytes
        self._reserved = 0
        self._leases: dict[int, _Lease] = {}
        self._allocs: dict[int, _Reservation] = {}
        self._open_leases: Counter[object] = Counter()  # owner -> open leases
        self._open_allocs: Counter[object] = Counter()  # owner -> open reservations
        self._ids = itertools.count(1)

    @property
    def capacity(self) -> int:
        return self._pages.capacity

    # -- helpers ----------------------------------------------------------------------------

    def _retire(self, extent: Extent) -> None:
        """The extent left the index: free it now, or when its last pin goes."""
        if extent.pins > 0:
            extent.dead = True
        else:
            self.allocator.free(extent)

    def _unpin(self, extent: Extent) -> None:
        extent.pins -= 1
        if extent.pins == 0 and extent.dead:
            self.allocator.free(extent)

    def _drop(self, key: str) -> bool:
        """Unindex ``key``'s page (its extent retired); whether it was indexed."""
        entry = self._pages.remove(key)
        if entry is not None:
            self._retire(entry.value.extent)
        return entry is not None

    def _physical_alloc(self, size: int, reservation: _Reservation) -> Extent | None:
        """A free extent; else evict LRU (unpinned) pages for it, but only while all
        reservations stay within :attr:`reserve_limit` (see the module docstring)."""
        while True:
            extent = self.allocator.alloc(size)
            if extent is not None:
                return extent
            if self._reserved + _align(size) > self.reserve_limit:
                return None
            evicted = self._pages.evict(_unpinned)
            if evicted is None:
                return None
            self._retire(evicted.value.extent)
            reservation.evictions += 1
            reservation.evicted_bytes += evicted.size

    # -- reads ------------------------------------------------------------------------------

    def lookup(self, keys: list[str]) -> list[bool]:
        return [key in self._pages for key in keys]

    def get(self, keys: list[str], owner: object) -> tuple[int, list[tuple[int, int] | None]]:
        """Pin and refresh each present page; ``(lease_id, [(offset, length) | None])``.
        Raises PendingLimitError when ``owner`` already holds ``max_pending`` leases."""
        if self._open_leases[owner] >= self.max_pending:
            raise PendingLimitError(f"{self.max_pending} open leases on this connection: release some")
        now = self._clock()
        lease = _Lease(owner, now + self.lease_timeout_s)
        out: list[tuple[int, int] | None] = []
        for key in keys:
            entry = self._pages.touch(key)
            if entry is None:
                out.append(None)
                continue
            page = entry.value
            page.used_at = now
            page.extent.pins += 1
            lease.extents.append(page.extent)
            out.append((page.extent.offset, page.size))
        lease_id = 0
        if lease.extents:
            lease_id = next(self._ids)
            self._leases[lease_id] = lease
            self._open_leases[owner] += 1
        return lease_id, out

    def release(self, lease_id: int, owner: object = None) -> bool:
        """Unpin a lease; False if unknown (expired). NotOwnedError if ``owner`` (None: any)
        did not make it."""
        lease = self._leases.get(lease_id)
        if lease is None:
            return False
        if owner is not None and lease.owner is not owner:
            raise NotOwnedError(f"lease {lease_id} belongs to another connection")
        del self._leases[lease_id]
        _uncount(self._open_leases, lease.owner)
        for extent in lease.extents:
            self._unpin(extent)
        return True

    # -- two-phase store --------------------------------------------------------------------

    def alloc(self, keys: list[str], sizes: list[int], owner: object) -> tuple[int, list[int | None]]:
        """Reserve an extent per key; ``(alloc_id, [offset | None (refused)])``.
        Raises PendingLimitError when ``owner`` already holds ``max_pending`` reservations."""
        if self._open_allocs[owner] >= self.max_pending:
            raise PendingLimitError(
                f"{self.max_pending} open reservations on this connection: commit some first"
            )
        res = _Reservation(owner, self._clock() + self.alloc_timeout_s, [])
        offsets: list[int | None] = []
        for key, size in zip(keys, sizes, strict=True):
            extent = self._physical_alloc(size, res) if size <= self.capacity else None
            res.items.append((key, size, extent))
            offsets.append(None if extent is None else extent.offset)
            if extent is not None:
                self._reserved += extent.size
        alloc_id = next(self._ids)
        self._allocs[alloc_id] = res
        self._open_allocs[owner] += 1
        return alloc_id, offsets

    def commit(
        self, alloc_id: int, success: list[bool], owner: object = None
    ) -> tuple[int, int, int] | None:
        """Publish the successful items in order; ``(committed, evictions, evicted_bytes)``,
        or None if ``alloc_id`` is unknown (expired, already committed) or, when ``owner`` is
        given, another owner's (which stays as it is)."""
        res = self._allocs.get(alloc_id)
        if res is None or (owner is not None and res.owner is not owner):
            return None
        del self._allocs[alloc_id]
        _uncount(self._open_allocs, res.owner)
        committed, evictions, evicted_bytes = 0, res.evictions, res.evicted_bytes
        now = self._clock()
        flags = list(success) + [False] * (len(res.items) - len(success))
        for (key, size, extent), ok in zip(res.items, flags, strict=False):
            if extent is None:
                continue
            self._reserved -= extent.size
            if not ok:
                self.allocator.free(extent)
                continue
            self._drop(key)  # replacing an older version is not an eviction
            for evicted in self._pages.make_room(size):  # pinned pages too: freed on release
                self._retire(evicted.value.extent)
                evictions += 1
                evicted_bytes += evicted.size
            self._pages.insert(key, size, _Page(size, extent, now))
            committed += 1
        return committed, evictions, evicted_bytes

    def abort(self, alloc_id: int) -> bool:
        return self.commit(alloc_id, []) is not None

    def delete(self, keys: list[str]) -> int:
        return sum(self._drop(key) for key in keys)

    # -- expiry -----------------------------------------------------------------------------

    def expire(self, now: float | None = None) -> tuple[int, int]:
        """Drop leases and reservations past their deadline; ``(leases, allocs)`` dropped."""
        now = self._clock() if now is None else now
        leases = [i for i, lease in self._leases.items() if lease.deadline <= now]
        allocs = [i for i, res in self._allocs.items() if res.deadline <= now]
        for lease_id in leases:
            self.release(lease_id)
        for alloc_id in allocs:
            self.abort(alloc_id)
        return len(leases), len(allocs)

    def drop_owner(self, owner: object) -> None:
        """A client connection closed: release its leases and abort its reservations."""
        for lease_id in [i for i, lease in self._leases.items() if lease.owner is owner]:
            self.release(lease_id)
        for alloc_id in [i for i, res in self._allocs.items() if res.owner is owner]:
            self.abort(alloc_id)

    def stats(self) -> PoolStats:
        return PoolStats(self._pages.used, self._reserved, self.allocator.free_bytes, len(self._pages))

    # -- listing ----------------------------------------------------------------------------

    def now(self) -> float:
        """The index's clock (the one page use times are taken from)."""
        return self._clock()

    def pages_snapshot(self) -> list[tuple[str, _Page]]:
        """The visible pages now, for :func:`scan_pages`: one C-speed copy of the index, so the
        caller's lock is held only for that (sizes never change; use times are plain floats)."""
        return self._pages.items()

    def scan(self, prefix: str, after: str, limit: int) -> tuple[list[tuple[str, int, float]], bool]:
        """:func:`scan_pages` over the pages now."""
        return scan_pages(self.pages_snapshot(), prefix, after, limit, self._clock())


def _unpinned(entry: Entry[_Page]) -> bool:
    return entry.value.extent.pins == 0


def _uncount(counter: Counter[object], owner: object) -> None:
    counter[owner] -= 1
    if counter[owner] <= 0:
        del counter[owner]


def scan_pages(
    snapshot: list[tuple[str, _Page]], prefix: str, after: str, limit: int, now: float
) -> tuple[list[tuple[str, int, float]], bool]:
    """The first ``limit`` pages in key order with keys starting with ``prefix`` and sorting
    after ``after``: ``(key, size, seconds since last use)``; and whether more match.

    O(pages) per call (a bounded heap, no full sort): listing n pages ``limit`` at a time costs
    n / limit passes over the snapshot.
    """
    matches = (item for item in snapshot if item[0] > after and item[0].startswith(prefix))
    first = heapq.nsmallest(max(0, limit) + 1, matches, key=lambda item: item[0])
    entries = [(key, page.size, max(0.0, now - page.used_at)) for key, page in first[:limit]]
    return entries, len(first) > limit
