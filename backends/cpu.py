"""In-process CPU memory pool: the fastest backend, private to one process.

Role: hold pages in this process's memory, bounded by ``capacity_bytes``, evicting the least
recently used page (by last put or get) to make room.

Contract beyond :mod:`hybrid_offload.backends.base`:

* **Visibility.** ``shared_index = False``: the pool lives in the worker process, so the
  scheduler process cannot see it. The connector mirrors the index from worker reports; this
  backend reports every key it evicts or deletes through :meth:`CpuBackend.take_evicted`.
  A key may be reported after it was put again (evict, then re-put before the next
  ``take_evicted``): the mirror then forgets a page that is stored, which only costs a hit,
  never a wrong load.
* **Ownership.** ``put_batch`` stores ``bytes(buf)`` (its own copy), taken before the lock;
  ``get_batch`` returns the stored immutable ``bytes`` object itself (no copy).
* **Threading / blocking.** One ``threading.Lock`` guards the pool and the counters; each
  batch call takes it once. Nothing blocks beyond that lock and memory copies.
* **Batches.** Items are applied in input order, so a later item of the same batch may evict
  an earlier one (it was stored: its answer stays True).
* **Listing.** ``scan`` lists a snapshot of the keys taken under the lock; ``mtime`` is None
  (the pool keeps an LRU order, not times).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar

from .base import Backend, BackendConfig, Buffer, PageInfo, check_prefix
from .lru_index import LruIndex

__all__ = ["CpuBackend"]


class CpuBackend(Backend):
    """LRU page pool in this process's memory (see the module docstring)."""

    type_name: ClassVar[str] = "cpu"
    shared_index: ClassVar[bool] = False
    hit_source: ClassVar[str] = "host"
    touch_refreshes: ClassVar[bool] = True
    option_defaults: ClassVar[dict[str, Any]] = {}

    def __init__(self, config: BackendConfig) -> None:
        super().__init__(config)
        self.validate_options(dict(config.options))
        self._lock = threading.Lock()
        self._pages: LruIndex[bytes] = LruIndex()  # LRU first, MRU last
        self._evicted: list[str] = []
        self._closed = False

    # -- helpers (call with the lock held) -------------------------------------------------

    def _make_room(self, size: int) -> None:
        """Evict least recently used pages until ``size`` more bytes fit."""
        while self._pages.used + size > self.capacity_bytes:
            victim = self._pages.pop_victim()
            if victim is None:
                return
            self._evicted.append(victim[0])
            self.stats.evictions += 1
            self.stats.evicted_bytes += victim[1].size

    # -- Backend API -----------------------------------------------------------------------

    def _put_batch(self, items: Sequence[tuple[str, Buffer]]) -> list[bool]:
        copies = [(key, bytes(buf)) for key, buf in items]  # copy outside the lock
        results: list[bool] = []
        with self._lock:
            self._check_open()
            for key, data in copies:
                if len(data) > self.capacity_bytes:
                    self.stats.put_refused += 1
                    results.append(False)
                    continue
                self._pages.pop(key)  # a re-put replaces, without counting as an eviction
                self._make_room(len(data))
                self._pages.put(key, len(data), data)
                self.stats.puts += 1
                self.stats.put_bytes += len(data)
                results.append(True)
        return results

    def _get_batch(self, keys: Sequence[str]) -> list[bytes | None]:
        results: list[bytes | None] = []
        with self._lock:
            self._check_open()
            for key in keys:
                entry = self._pages.get(key)
                if entry is not None:
                    self.stats.hits += 1
                    self.stats.get_bytes += entry.size
                results.append(None if entry is None else entry.value)
            self.stats.gets += len(keys)
        return results

    def _contains_batch(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is stored; does not refresh recency."""
        with self._lock:
            self._check_open()
            return self._pages.contains(keys)

    def _touch_batch(self, keys: Sequence[str]) -> None:
        with self._lock:
            self._check_open()
            self._pages.touch_all(keys)

    def _delete_batch(self, keys: Sequence[str]) -> int:
        deleted = 0
        with self._lock:
            self._check_open()
            for key in keys:
                if self._pages.pop(key) is not None:
                    self._evicted.append(key)
                    deleted += 1
        return deleted

    def _used_bytes(self) -> int:
        with self._lock:
            self._check_open()
            return self._pages.used

    def scan(self, prefix: str = "") -> Iterator[PageInfo]:
        """The pages stored when the scan starts (a snapshot of keys and sizes; no times)."""
        check_prefix(prefix)
        with self._lock:
            self._check_open()
            listed = [(key, entry.size) for key, entry in self._pages.items() if key.startswith(prefix)]
        for key, size in listed:
            yield PageInfo(key, size, None)

    def take_evicted(self) -> list[str]:
        """Keys evicted or deleted since the last call, oldest first."""
        with self._lock:
            self._check_open()
            evicted, self._evicted = self._evicted, []
        return evicted

    def close(self) -> None:
        """Drop all pages; idempotent, never blocks beyond the lock."""
        with self._lock:
            self._closed = True
            self._pages.clear()
            self._evicted = []
