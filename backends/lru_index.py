"""One page index for the backends that keep theirs in memory: cpu, disk, lmcache, the cache peer.

:class:`LruIndex` maps keys to sizes (and an optional value: the cpu pool keeps the page bytes,
the peer its extent), counts the bytes held and keeps the pages in eviction order: the first is
the next victim. What an access does to that order is the :class:`EvictionPolicy`'s business:
:class:`Lru` (the default, and what the backends use) makes an accessed page the most recently
used, :class:`Fifo` leaves the order as put. Capacity stays with the backend (the disk backend
counts bytes across processes): it asks for victims until what it needs fits.

Not thread-safe: every backend holds its own lock around its index.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

V = TypeVar("V")


class EvictionPolicy(Protocol):
    """Decides the eviction order; the index evicts from the front of ``order``."""

    def on_access(self, order: OrderedDict[str, Any], key: str) -> None:
        """``key`` (present in ``order``) was read or touched."""


class Lru:
    """Least recently used first: an access moves the page to the back."""

    def on_access(self, order: OrderedDict[str, Any], key: str) -> None:
        order.move_to_end(key)


class Fifo:
    """First put, first evicted: accesses change nothing (a re-put still counts as new)."""

    def on_access(self, order: OrderedDict[str, Any], key: str) -> None:
        return


@dataclass
class Entry(Generic[V]):
    size: int
    value: V


class LruIndex(Generic[V]):
    """Key -> (size, value) in eviction order, and the bytes held (see the module docstring)."""

    def __init__(self, policy: EvictionPolicy | None = None) -> None:
        self._policy = policy or Lru()
        self._entries: OrderedDict[str, Entry[V]] = OrderedDict()
        self.used = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def put(self, key: str, size: int, value: V = None) -> None:  # type: ignore[assignment]
        """Add ``key`` as the newest page, replacing (not evicting) an entry of the same key."""
        self.pop(key)
        self._entries[key] = Entry(size, value)
        self.used += size

    def get(self, key: str, *, access: bool = True) -> Entry[V] | None:
        """``key``'s entry (None if absent); an access tells the policy unless ``access=False``."""
        entry = self._entries.get(key)
        if entry is not None and access:
            self._policy.on_access(self._entries, key)
        return entry

    def touch(self, key: str) -> bool:
        """An access without a read; False if ``key`` is absent."""
        return self.get(key) is not None

    def touch_all(self, keys: Iterable[str]) -> None:
        """:meth:`touch` each key, in order (absent keys are ignored)."""
        for key in keys:
            self.touch(key)

    def contains(self, keys: Iterable[str]) -> list[bool]:
        """Whether each key is held (not an access)."""
        return [key in self._entries for key in keys]

    def pop(self, key: str) -> Entry[V] | None:
        """Remove ``key``; its entry, or None if absent."""
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.used -= entry.size
        return entry

    def pop_victim(self, keep: Callable[[str, Entry[V]], bool] | None = None) -> tuple[str, Entry[V]] | None:
        """Remove and return the next victim, skipping pages ``keep`` says must stay (e.g.
        pinned by a reader); None when there is none."""
        for key, entry in self._entries.items():
            if keep is None or not keep(key, entry):
                self.pop(key)
                return key, entry
        return None

    def keys(self) -> list[str]:
        """The keys in eviction order (a copy)."""
        return list(self._entries)

    def items(self) -> Iterator[tuple[str, Entry[V]]]:
        """``(key, entry)`` in eviction order (a snapshot: the index may change meanwhile)."""
        return iter(list(self._entries.items()))

    def clear(self) -> None:
        self._entries.clear()
        self.used = 0
