"""In-process CPU memory pool: the fastest backend, private to one process.

Role: hold pages in this process's memory, bounded by ``capacity_bytes``, evicting the least
recently used page (by last put or get) to make room.

Contract beyond :mod:`hybrid_offload.backends.base`:

* **Visibility.** ``shared_index = False``: the pool lives in the worker process, so the
  scheduler process cannot see it. The connector mirrors the index from worker reports; this
  backend reports every key it evicts or deletes through ``take_evicted`` (:mod:`.local_index`).
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

from collections.abc import Iterator, Sequence
from typing import Any, ClassVar

from .base import BackendConfig, Buffer, PageInfo
from .local_index import LocalIndexBackend

__all__ = ["CpuBackend"]


class CpuBackend(LocalIndexBackend[bytes]):
    """LRU page pool in this process's memory (see the module docstring)."""

    type_name: ClassVar[str] = "cpu"
    hit_source: ClassVar[str] = "host"
    option_defaults: ClassVar[dict[str, Any]] = {}

    def __init__(self, config: BackendConfig) -> None:
        super().__init__(config)
        self.validate_options(dict(config.options))

    def _put_batch(self, items: Sequence[tuple[str, Buffer]]) -> list[bool]:
        copies = [(key, bytes(buf)) for key, buf in items]  # copy outside the lock
        results: list[bool] = []
        with self._lock:
            self._check_open()  # close() may have emptied the pool meanwhile
            for key, data in copies:
                evicted = self._pages.put(key, len(data), data)
                if evicted is None:
                    self.stats.put_refused += 1
                    results.append(False)
                    continue
                self._record_evictions(evicted)
                self.stats.puts += 1
                self.stats.put_bytes += len(data)
                results.append(True)
        return results

    def _get_batch(self, keys: Sequence[str]) -> list[bytes | None]:
        results: list[bytes | None] = []
        with self._lock:
            for key in keys:
                entry = self._pages.touch(key)
                if entry is not None:
                    self.stats.hits += 1
                    self.stats.get_bytes += entry.size
                results.append(None if entry is None else entry.value)
            self.stats.gets += len(keys)
        return results

    def _delete_batch(self, keys: Sequence[str]) -> int:
        with self._lock:
            return sum(self._forget(key) for key in keys)

    def _scan(self, prefix: str) -> Iterator[PageInfo]:
        """The pages stored when the scan starts (a snapshot of keys and sizes; no times)."""
        with self._lock:
            listed = [(key, size) for key, size in self._pages.sizes() if key.startswith(prefix)]
        for key, size in listed:
            yield PageInfo(key, size, None)

    def _close(self) -> None:
        """Drop all pages; never blocks beyond the lock."""
        with self._lock:
            self._clear_index()
