"""Backends whose page index lives in this process (``cpu``, ``lmcache``): what they share.

Contract beyond :mod:`hybrid_offload.backends.base`, for subclasses of
:class:`LocalIndexBackend`:

* **Index.** ``self._pages`` (an :class:`~.lru_index.LruIndex`, capacity ``capacity_bytes``)
  is the truth about what is stored: ``contains_batch`` and ``used_bytes`` answer from it
  without I/O, ``touch_batch`` refreshes its LRU order, in order.
* **Visibility.** ``shared_index = False``: no other process sees the index, so the connector
  mirrors it from :meth:`LocalIndexBackend.take_evicted`, which reports, oldest first, every key
  that left the index (evicted, deleted, or dropped by the subclass through :meth:`_forget`).
* **Threading.** ``self._lock`` guards the index, the evicted keys and the counters; subclasses
  take it for every use of them.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import ClassVar, Generic, TypeVar

from .base import Backend, BackendConfig
from .lru_index import Entry, LruIndex

__all__ = ["LocalIndexBackend"]

V = TypeVar("V")


class LocalIndexBackend(Backend, Generic[V]):
    """A backend with its page index in this process (see the module docstring)."""

    shared_index: ClassVar[bool] = False
    touch_refreshes: ClassVar[bool] = True

    def __init__(self, config: BackendConfig) -> None:
        super().__init__(config)
        self._lock = threading.Lock()
        self._pages: LruIndex[V] = LruIndex(config.capacity_bytes)
        self._evicted: list[str] = []

    # -- for subclasses (the lock held) ------------------------------------------------------

    def _record_evictions(self, victims: Sequence[Entry[V]]) -> None:
        """Count pages evicted to make room and report their keys."""
        for victim in victims:
            self._evicted.append(victim.key)
            self.stats.evictions += 1
            self.stats.evicted_bytes += victim.size

    def _forget(self, key: str) -> bool:
        """Drop ``key`` from the index and report it; whether it was there."""
        if self._pages.remove(key) is None:
            return False
        self._evicted.append(key)
        return True

    # -- Backend API ---------------------------------------------------------------------

    def _contains_batch(self, keys: Sequence[str]) -> list[bool]:
        """From the index, without I/O; does not refresh recency."""
        with self._lock:
            return [key in self._pages for key in keys]

    def _touch_batch(self, keys: Sequence[str]) -> None:
        """Refresh the index's LRU order, in order (no I/O)."""
        with self._lock:
            for key in keys:
                self._pages.touch(key)

    def _used_bytes(self) -> int:
        with self._lock:
            return self._pages.used

    def take_evicted(self) -> list[str]:
        """Keys that left the index since the last call, oldest first."""
        with self._lock:
            self._check_open()
            evicted, self._evicted = self._evicted, []
        return evicted

    def _clear_index(self) -> None:
        """Forget every page without reporting them (``close()``; the lock held)."""
        self._pages.clear()
        self._evicted = []
