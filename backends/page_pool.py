"""A page index over one pool of memory and its allocator (pure bookkeeping: no memory, no I/O).

Used by the cache peer (``nixl_peer/server.py``, its pool registered with NIXL) and by the cpu
tier (``cpu.py``, its arena pinned for the GPU).

* :class:`ExtentAllocator` hands out 64-byte aligned extents of the pool from free extents
  kept by size class and by both ends: an allocation looks at a bounded number of candidates,
  a free coalesces with its neighbours in O(1).
* **Bounded work under the lock** (the server holds one lock for the index): an ALLOC or a
  COMMIT spends at most ``WORK_PER_MESSAGE + WORK_PER_KEY x keys`` :class:`Work` steps
  (candidate extents, evictions, pinned pages skipped); past that its remaining keys are
  refused (not stored), and the room made so far stays made, so a later message goes on from
  there. Every other message costs O(its keys).
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

import heapq
import itertools
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from .lru_index import Entry, EvictionPolicy, LruIndex

__all__ = [
    "ALIGN",
    "WORK_PER_KEY",
    "WORK_PER_MESSAGE",
    "Extent",
    "ExtentAllocator",
    "NotOwnedError",
    "OutOfWorkError",
    "PageIndex",
    "PendingLimitError",
    "PoolStats",
    "Work",
    "scan_pages",
]

ALIGN = 64
#: the work (:class:`Work` steps) one ALLOC or COMMIT may do under the lock: this, plus per key
WORK_PER_MESSAGE = 4096
WORK_PER_KEY = 16


def _align(n: int) -> int:
    return (n + ALIGN - 1) & ~(ALIGN - 1)


@dataclass(eq=False)
class Extent:
    """A piece of the pool; ``size`` is the aligned bytes held (0 for an empty page)."""

    offset: int
    size: int
    pins: int = 0
    dead: bool = False  # no longer indexed: free it once unpinned


class OutOfWorkError(Exception):
    """A message used up its :class:`Work` budget: the rest of it is refused, not served."""


class Work:
    """What one message may spend under the server lock: ``steps`` candidate extents looked
    at, pages evicted and pinned pages skipped, together. Each spends one step."""

    def __init__(self, steps: int) -> None:
        self.left = steps

    def spend(self, steps: int = 1) -> None:
        """Raises :class:`OutOfWorkError` once the budget is gone."""
        if self.left < steps:
            self.left = 0
            raise OutOfWorkError
        self.left -= steps


#: candidates looked at in an extent's own size class before taking one from a larger class
_CLASS_PROBES = 8


class ExtentAllocator:
    """Free extents of ``[0, size)`` by size class (a power of two) and by both ends, so an
    allocation looks at a bounded number of candidates, and a free coalesces with its
    neighbours in O(1), however fragmented the pool is."""

    def __init__(self, size: int) -> None:
        self.size = size - size % ALIGN
        self._by_start: dict[int, int] = {}  # free extent start -> length
        self._by_end: dict[int, int] = {}  # free extent end -> start
        self._classes: list[dict[int, None]] = [{} for _ in range(max(1, self.size.bit_length()))]
        self._allocated: dict[int, int] = {}  # extent start -> length, of extents handed out
        self.free_bytes = 0
        if self.size:
            self._add(0, self.size)
            self.free_bytes = self.size

    def _add(self, start: int, length: int) -> None:
        self._by_start[start] = length
        self._by_end[start + length] = start
        self._classes[length.bit_length() - 1][start] = None

    def _remove(self, start: int) -> int:
        length = self._by_start.pop(start)
        del self._by_end[start + length]
        del self._classes[length.bit_length() - 1][start]
        return length

    def alloc(self, nbytes: int, work: Work | None = None) -> Extent | None:
        """An extent of at least ``nbytes`` (aligned), or None if no free extent is large
        enough. Looks at most ``_CLASS_PROBES`` extents of the request's size class, then takes
        one from the smallest larger class; each candidate spends a step of ``work``."""
        need = _align(nbytes)
        if need == 0:
            return Extent(0, 0)
        cls = need.bit_length() - 1
        if cls >= len(self._classes):
            return None
        found = None
        for i, start in enumerate(self._classes[cls]):
            if work is not None:
                work.spend()
            if self._by_start[start] >= need:
                found = start
                break
            if i + 1 >= _CLASS_PROBES:
                break
        if found is None:
            for bucket in self._classes[cls + 1 :]:
                if bucket:
                    if work is not None:
                        work.spend()
                    found = next(iter(bucket))
                    break
        if found is None:
            return None
        length = self._remove(found)
        if length > need:
            self._add(found + need, length - need)
        self.free_bytes -= need
        self._allocated[found] = need
        return Extent(found, need)

    def alloc_run(self, size: int, count: int) -> list[Extent] | None:
        """``count`` extents of ``size`` (aligned) side by side, from one free extent; None (and
        nothing allocated) if no free extent holds them all. Each is freed on its own."""
        whole = self.alloc(size * count)
        if whole is None:
            return None
        del self._allocated[whole.offset]
        extents = [Extent(whole.offset + i * size, size) for i in range(count)]
        for extent in extents:
            self._allocated[extent.offset] = size
        return extents

    def free(self, extent: Extent) -> None:
        if extent.size == 0:
            return
        start, length = extent.offset, extent.size
        end = start + length
        if self._allocated.get(start) != length:
            raise RuntimeError(f"double free of pool extent at {start}")
        del self._allocated[start]
        self.free_bytes += length
        if end in self._by_start:  # merge with the following free extent
            length += self._remove(end)
        if start in self._by_end:  # merge with the preceding free extent
            prev = self._by_end[start]
            length += self._remove(prev)
            start = prev
        self._add(start, length)

    @property
    def free_extents(self) -> int:
        return len(self._by_start)


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
    #: of ``used``, the bytes of recurrent-state pages (as the policy tells them)
    state: int = 0


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
        reserve_limit: int | None = None,
        report_removals: bool = False,
        policy: EvictionPolicy | None = None,
    ) -> None:
        """``reserve_limit``: reserved bytes beyond which ALLOC refuses instead of evicting
        committed pages (default: the pool's slack above ``capacity``, at least 1/8 of it);
        ``report_removals``: keep the keys that leave the index (evicted, deleted; not replaced)
        in :attr:`removed`, oldest first, for whoever mirrors the index; ``policy``: which
        committed pages to evict first (least recently used by default)."""
        self.allocator = ExtentAllocator(pool_size)
        size = self.allocator.size
        self.reserve_limit = max(size - capacity, size // 8) if reserve_limit is None else reserve_limit
        self.removed: list[str] = []
        self._report = report_removals
        self.max_pending = max_pending
        self.lease_timeout_s = lease_timeout_s
        self.alloc_timeout_s = alloc_timeout_s
        self._clock = clock
        self._pages: LruIndex[_Page] = LruIndex(capacity, policy)  # bounds committed page bytes
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

    def _physical_alloc(self, size: int, reservation: _Reservation, work: Work) -> Extent | None:
        """A free extent; else evict LRU (unpinned) pages for it, but only while all
        reservations stay within :attr:`reserve_limit` (see the module docstring). Raises
        :class:`OutOfWorkError` when ``work`` runs out (nothing is half done)."""

        def unpinned(entry: Entry[_Page]) -> bool:
            work.spend()
            return entry.value.extent.pins == 0

        while True:
            extent = self.allocator.alloc(size, work)
            if extent is not None:
                return extent
            if self._reserved + _align(size) > self.reserve_limit:
                return None
            evicted = self._pages.evict(unpinned)
            if evicted is None:
                return None
            self._retire(evicted.value.extent)
            self._removed(evicted.key)
            reservation.evictions += 1
            reservation.evicted_bytes += evicted.value.size

    # -- reads ------------------------------------------------------------------------------

    def lookup(self, keys: list[str]) -> list[bool]:
        return [key in self._pages for key in keys]

    def touch(self, keys: list[str]) -> None:
        """Make each present page the most recently used, in order (no pin, no lease)."""
        for key in keys:
            self._pages.touch(key)

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
        work = Work(WORK_PER_MESSAGE + WORK_PER_KEY * len(keys))
        run = self._run_of(sizes)
        for key, size in zip(keys, sizes, strict=True):
            extent = next(run, None)
            if extent is None and size <= self.capacity and work.left:
                try:
                    extent = self._physical_alloc(size, res, work)
                except OutOfWorkError:
                    extent = None
            res.items.append((key, size, extent))
            offsets.append(None if extent is None else extent.offset)
            if extent is not None:
                self._reserved += extent.size
        alloc_id = next(self._ids)
        self._allocs[alloc_id] = res
        self._open_allocs[owner] += 1
        return alloc_id, offsets

    def _run_of(self, sizes: list[int]) -> Iterator[Extent]:
        """Extents side by side for the longest prefix of ``sizes`` that are all the same and
        fit the pool's free space and the reserve limit in one free extent, without evicting
        (one allocation for many pages: fewer steps, and pages a reader copies in one go)."""
        n = 0
        while n < len(sizes) and sizes[n] == sizes[0] and sizes[0] <= self.capacity:
            n += 1
        need = _align(sizes[0]) if n else 0
        if n < 2 or not need or self._reserved + n * need > self.reserve_limit:
            return iter(())
        extents = self.allocator.alloc_run(need, n)
        return iter(extents or ())

    def commit(
        self, alloc_id: int, success: list[bool], owner: object = None, outcomes: list[bool] | None = None,
        order: Sequence[int] | None = None,
    ) -> tuple[int, int, int] | None:  # fmt: skip
        """Publish the successful items in order (``order``: in that order of their indices,
        the last one most recent); ``(committed, evictions, evicted_bytes)``,
        or None if ``alloc_id`` is unknown (expired, already committed) or, when ``owner`` is
        given, another owner's (which stays as it is). ``outcomes`` gets, per item (in the
        items' order), whether it was published."""
        res = self._allocs.get(alloc_id)
        if res is None or (owner is not None and res.owner is not owner):
            return None
        del self._allocs[alloc_id]
        _uncount(self._open_allocs, res.owner)
        committed, evictions, evicted_bytes = 0, res.evictions, res.evicted_bytes
        now = self._clock()
        work = Work(WORK_PER_MESSAGE + WORK_PER_KEY * len(res.items))
        flags = list(success) + [False] * (len(res.items) - len(success))
        published = [False] * len(res.items)
        for i in order if order is not None else range(len(res.items)):
            key, size, extent = res.items[i]
            if extent is None:
                continue
            self._reserved -= extent.size
            if not flags[i]:
                self.allocator.free(extent)
                continue
            self._drop(key)  # replacing an older version is not an eviction
            while self._pages.used + size > self.capacity and work.left:  # pinned too: freed on release
                work.left -= 1
                evicted = self._pages.evict()
                if evicted is None:
                    break
                self._retire(evicted.value.extent)
                self._removed(evicted.key)
                evictions += 1
                evicted_bytes += evicted.size
            if self._pages.used + size > self.capacity:  # out of work: not stored, room made so far kept
                self.allocator.free(extent)
                continue
            self._pages.insert(key, size, _Page(size, extent, now))
            published[i] = True
            committed += 1
        if outcomes is not None:
            outcomes.extend(published)
        return committed, evictions, evicted_bytes

    def abort(self, alloc_id: int) -> bool:
        return self.commit(alloc_id, []) is not None

    def delete(self, keys: list[str]) -> int:
        dropped = [key for key in keys if self._drop(key)]
        for key in dropped:
            self._removed(key)
        return len(dropped)

    def _removed(self, key: str) -> None:
        if self._report:
            self.removed.append(key)

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
        state = self._pages.used_by_kind().get("state", 0)
        return PoolStats(self._pages.used, self._reserved, self.allocator.free_bytes, len(self._pages), state)

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
