"""In-process CPU memory tier: pages in one preallocated arena, the fastest backend, private to
one process.

Role: hold pages in this process's memory, bounded by ``capacity_bytes``, evicting the least
recently used resume point (:class:`~.retention.ResumePointPolicy`; a page without hints: by last
put or get) to make room; lend them in place, so that a GPU engine
copies a load straight out of the tier and a store straight into it.

Contract beyond :mod:`hybrid_offload.backends.base`:

* **Memory.** One anonymous mapping (``arena``) of ``capacity_bytes`` plus
  :func:`arena_slack`, reserved when the backend is made and reused for its life: pages are
  64-byte aligned extents of it (:mod:`.page_pool`). The operating system provides its pages
  on first use; a GPU worker page-locks the whole arena once (``DeviceTransfers.pin``) so that
  copies to and from the device run at the link's speed. Capacity counts page bytes, as every
  backend does; the slack absorbs alignment and fragmentation (when a page still finds no
  room, more pages are evicted).
* **In place** (``in_place = True``). ``lease_batch`` lends read-only views of the arena; a
  leased page's extent is not reused until the lease is released (the page itself may be
  evicted, replaced or deleted meanwhile: its key then misses, its bytes stay). ``reserve_batch``
  hands out extents that readers cannot see until committed. Leases and reservations never
  expire: the connector releases every one it takes.
* **Visibility.** ``shared_index = False``: the arena lives in the worker process, so the
  scheduler process cannot see it. The connector mirrors the index from worker reports; this
  backend reports every key it evicts or deletes through ``take_evicted``. A key may be
  reported after it was put again (evict, then re-put before the next ``take_evicted``): the
  mirror then forgets a page that is stored, which only costs a hit, never a wrong load.
* **Ownership.** ``put_batch`` copies the caller's bytes into the arena (numpy, without the
  GIL); ``get_batch`` returns copies, ``get_into`` copies into the caller's buffers.
* **Threading / blocking.** One ``threading.Lock`` guards the index and the counters; copies
  run outside it. Nothing blocks beyond that lock and memory copies.
* **Batches.** Items are applied in input order, so a later item of the same batch may evict
  an earlier one (it was stored: its answer stays True).
* **Listing.** ``scan`` lists a snapshot of the keys taken under the lock; ``mtime`` is None
  (the pool keeps an LRU order, not times).
"""

from __future__ import annotations

import mmap
import sys
import threading
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar

import numpy as np

from .base import Backend, BackendConfig, Buffer, PageInfo, PageLease, PageReservation
from .page_pool import PageIndex
from .retention import ResumePointPolicy, Retention

__all__ = ["CpuBackend", "arena_slack"]

#: Linux's MAP_NORESERVE (Python's mmap module does not name it): the arena's address space is
#: not charged against the overcommit limit until pages are used
_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform.startswith("linux") else 0)


def arena_slack(capacity: int) -> int:
    """Bytes the arena holds beyond ``capacity``: 1/32 of it, at least 1 MiB."""
    return max(capacity // 32, 1 << 20)


def _copy(dst: memoryview, src: Buffer) -> None:
    """``dst[:] = src`` with numpy, which releases the GIL for the copy."""
    np.copyto(np.frombuffer(dst, dtype=np.uint8), np.frombuffer(src, dtype=np.uint8))


class CpuBackend(Backend):
    """LRU page arena in this process's memory (see the module docstring)."""

    type_name: ClassVar[str] = "cpu"
    hit_source: ClassVar[str] = "host"
    option_defaults: ClassVar[dict[str, Any]] = {}
    shared_index: ClassVar[bool] = False
    touch_refreshes: ClassVar[bool] = True
    in_place: ClassVar[bool] = True

    def __init__(self, config: BackendConfig) -> None:
        super().__init__(config)
        self.validate_options(dict(config.options))
        size = config.capacity_bytes + arena_slack(config.capacity_bytes)
        self._map = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _NORESERVE)
        #: the pages' memory (writable): leases and reservations are views of it
        self.arena = memoryview(self._map)
        self._lock = threading.Lock()
        self._retention = ResumePointPolicy(lambda: self._index.capacity)
        self._index = PageIndex(config.capacity_bytes, size, max_pending=1 << 40, reserve_limit=size,
                                report_removals=True, policy=self._retention)  # fmt: skip

    # -- in place ----------------------------------------------------------------------------

    def _lease_batch(self, keys: Sequence[str]) -> PageLease:
        with self._lock:
            self._check_open()
            lease_id, found = self._index.get(list(keys), self)
            hits = [f for f in found if f is not None]
            self.stats.gets += len(keys)
            self.stats.hits += len(hits)
            self.stats.get_bytes += sum(size for _, size in hits)
        views: list[memoryview | None] = []
        for f in found:
            views.append(None if f is None else self.arena[f[0] : f[0] + f[1]].toreadonly())

        def release() -> None:
            with self._lock:
                self._index.release(lease_id)

        return PageLease(views, [None if f is None else f[0] for f in found], self.arena,
                         release if lease_id else None)  # fmt: skip

    def _reserve_batch(self, keys: Sequence[str], sizes: Sequence[int]) -> PageReservation:
        with self._lock:
            self._check_open()
            alloc_id, offsets = self._index.alloc(list(keys), list(sizes), self)
            self.stats.put_refused += offsets.count(None)  # too large, or no room
        views = [None if at is None else self.arena[at : at + n]
                 for at, n in zip(offsets, sizes, strict=True)]  # fmt: skip

        def commit(ok: list[bool], order: list[int] | None) -> list[bool]:
            return self._commit(alloc_id, ok, sizes, order)

        return PageReservation(views, commit, offsets, self.arena)

    def _commit(
        self, alloc_id: int, ok: list[bool], sizes: Sequence[int], order: list[int] | None
    ) -> list[bool]:
        outcomes: list[bool] = []
        with self._lock:
            if self._closed:
                return [False] * len(ok)
            result = self._index.commit(alloc_id, ok, outcomes=outcomes, order=order)
            _, evictions, evicted_bytes = result or (0, 0, 0)
            self.stats.puts += sum(outcomes)
            self.stats.put_bytes += sum(n for n, out in zip(sizes, outcomes, strict=True) if out)
            self.stats.put_refused += sum(o and not out for o, out in zip(ok, outcomes, strict=True))
            self.stats.evictions += evictions
            self.stats.evicted_bytes += evicted_bytes
        return outcomes

    # -- the copying calls ---------------------------------------------------------------------

    def _put_batch(self, items: Sequence[tuple[str, Buffer]]) -> list[bool]:
        results: list[bool] = []
        for start in range(0, len(items), 256):  # reservations stay a bounded part of the arena
            part = items[start : start + 256]
            sizes = [memoryview(buf).nbytes for _, buf in part]
            reservation = self.reserve_batch([k for k, _ in part], sizes)
            for view, (_, buf) in zip(reservation.views, part, strict=True):
                if view is not None:
                    _copy(view, memoryview(buf).cast("B"))
            results.extend(reservation.commit())
        return results

    def _get_batch(self, keys: Sequence[str]) -> list[bytes | None]:
        lease = self._lease_batch(keys)
        try:
            return [None if v is None else bytes(v) for v in lease.views]
        finally:
            lease.release()

    def _get_into(self, keys: Sequence[str], buffers: Sequence[memoryview]) -> list[int | None]:
        lease = self._lease_batch(keys)
        try:
            sizes: list[int | None] = []
            for view, buf in zip(lease.views, buffers, strict=True):
                out = memoryview(buf).cast("B")
                if view is None or view.nbytes > out.nbytes:
                    sizes.append(None)
                    continue
                _copy(out[: view.nbytes], view)
                sizes.append(view.nbytes)
            return sizes
        finally:
            lease.release()

    # -- the index -------------------------------------------------------------------------

    def _contains_batch(self, keys: Sequence[str]) -> list[bool]:
        """From the index, without I/O; does not refresh recency."""
        with self._lock:
            return self._index.lookup(list(keys))

    def _touch_batch(self, keys: Sequence[str]) -> None:
        with self._lock:
            self._index.touch(list(keys))

    def _describe_batch(self, hints: Sequence[tuple[str, Retention]]) -> None:
        with self._lock:
            self._retention.describe_batch(hints)

    def _delete_batch(self, keys: Sequence[str]) -> int:
        with self._lock:
            return self._index.delete(list(keys))

    def _used_bytes(self) -> int:
        with self._lock:
            return self._index.stats().used

    def _state_bytes(self) -> int | None:
        with self._lock:
            return self._index.stats().state

    def take_evicted(self) -> list[str]:
        """Keys that left the index since the last call, oldest first."""
        with self._lock:
            self._check_open()
            removed, self._index.removed = self._index.removed, []
        return removed

    def _scan(self, prefix: str) -> Iterator[PageInfo]:
        """The pages stored when the scan starts (a snapshot of keys and sizes; no times)."""
        with self._lock:
            pages = self._index.pages_snapshot()
        for key, size in [(key, page.size) for key, page in pages if key.startswith(prefix)]:
            yield PageInfo(key, size, None)

    def _close(self) -> None:
        """Forget all pages; the arena's memory goes when the last view of it does."""
        with self._lock:
            self._index = PageIndex(0, 0)
