"""The one index of stored pages that backends keeping their own bookkeeping share.

:class:`LruIndex` maps keys to a size and a value, counts the bytes used against a capacity,
keeps recency, and makes room by evicting the entries a pluggable :class:`EvictionPolicy`
names first (:class:`LruPolicy`, least recently used, by default). Used by the ``cpu`` pool
(value: the page bytes), ``disk`` and ``lmcache`` (no value) and the cache peer's pool
(value: the page's extent). Redis keeps its index on the server (:mod:`.redis.index`).

* **Sizes** are what the capacity counts (page bytes). ``used`` is their sum;
  :meth:`LruIndex.used_by_kind` splits it by what the policy says each key is
  (:meth:`EvictionPolicy.kind`: ``"state"`` or ``"attention"`` for hinted pages).
* **Recency.** :meth:`LruIndex.insert` and :meth:`LruIndex.put` make a key the most recent,
  :meth:`LruIndex.touch` refreshes one; :meth:`LruIndex.get` and listing do not.
* **Making room.** :meth:`LruIndex.make_room` evicts until ``used + nbytes <= capacity`` or no
  eligible entry is left; an ``eligible`` predicate skips entries that must stay (the peer's
  pinned pages). :meth:`LruIndex.put` refuses (None, nothing changes) a page larger than the
  capacity. Evicted and replaced entries are returned to the caller, who frees what they hold.
* **Threading.** Not thread-safe: each backend calls it under its own lock.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Generic, NamedTuple, TypeVar

__all__ = ["Entry", "EvictionPolicy", "LruIndex", "LruPolicy"]

V = TypeVar("V")


class Entry(NamedTuple, Generic[V]):
    """One indexed page: its key, its size in bytes, the caller's value."""

    key: str
    size: int
    value: V


class EvictionPolicy(ABC):
    """Which entries of one :class:`LruIndex` to evict first.

    Contract: the index reports every key that enters (:meth:`added`; only keys not held, so a
    replaced key is :meth:`removed` first), is used (:meth:`used`: a hit or a touch) or leaves
    (:meth:`removed`, after :meth:`evicting` when it leaves as a victim; :meth:`clear` for
    all). :meth:`order` yields each held key exactly once, the first to evict first; the index
    does not change while it iterates and starts a new iteration for each victim. A policy
    serves one index and is called under its lock.
    """

    @abstractmethod
    def added(self, key: str) -> None:
        """``key`` entered the index."""

    @abstractmethod
    def used(self, key: str) -> None:
        """``key`` was read or touched."""

    @abstractmethod
    def removed(self, key: str) -> None:
        """``key`` left the index (evicted, deleted or about to be replaced)."""

    def evicting(self, key: str) -> None:  # noqa: B027 (optional hook)
        """``key`` is about to leave as a victim (:meth:`removed` follows); a policy whose order
        ages with evictions hears it here."""

    def kind(self, key: str) -> str:
        """What the held ``key`` is, for :meth:`LruIndex.used_by_kind` ("" if unknown); the same
        from :meth:`added` until :meth:`removed`."""
        return ""

    @abstractmethod
    def clear(self) -> None:
        """Every key left the index."""

    @abstractmethod
    def order(self) -> Iterator[str]:
        """The held keys, the first to evict first."""


class LruPolicy(EvictionPolicy):
    """Least recently used first: by last add, read or touch."""

    def __init__(self) -> None:
        self._order: OrderedDict[str, None] = OrderedDict()  # LRU first, MRU last

    def added(self, key: str) -> None:
        self._order[key] = None

    def used(self, key: str) -> None:
        self._order.move_to_end(key)

    def removed(self, key: str) -> None:
        del self._order[key]

    def clear(self) -> None:
        self._order.clear()

    def order(self) -> Iterator[str]:
        return iter(self._order)


class LruIndex(Generic[V]):
    """Key -> (size, value) with used bytes, a capacity and an eviction policy (module
    docstring). ``capacity`` may be changed between calls."""

    def __init__(self, capacity: int, policy: EvictionPolicy | None = None) -> None:
        self.capacity = capacity
        self._policy = LruPolicy() if policy is None else policy
        self._sizes: dict[str, int] = {}
        self._values: dict[str, V] = {}
        self._used = 0
        self._by_kind: dict[str, int] = {}  # bytes per kind the policy names (not "")

    @property
    def used(self) -> int:
        """Sum of the sizes held."""
        return self._used

    def used_by_kind(self) -> dict[str, int]:
        """Bytes held per kind of page (:meth:`EvictionPolicy.kind`; "" for the rest)."""
        known = {k: v for k, v in self._by_kind.items() if v}
        return {**known, "": self._used - sum(known.values())}

    def __len__(self) -> int:
        return len(self._sizes)

    def __contains__(self, key: object) -> bool:
        return key in self._sizes

    def __iter__(self) -> Iterator[str]:
        """The held keys, in no particular order (change the index only after iterating)."""
        return iter(self._sizes)

    def get(self, key: str) -> Entry[V] | None:
        """The entry of ``key``, or None; recency unchanged."""
        size = self._sizes.get(key)
        return None if size is None else Entry(key, size, self._values[key])

    def touch(self, key: str) -> Entry[V] | None:
        """Make ``key`` most recently used (as the policy counts use); its entry, or None."""
        entry = self.get(key)
        if entry is not None:
            self._policy.used(key)
        return entry

    def items(self) -> list[tuple[str, V]]:
        """A snapshot of (key, value), in no particular order (one copy, C speed)."""
        return list(self._values.items())

    def sizes(self) -> list[tuple[str, int]]:
        """A snapshot of (key, size), in no particular order."""
        return list(self._sizes.items())

    def insert(self, key: str, size: int, value: V) -> Entry[V] | None:
        """Hold ``key`` as the most recent entry, replacing any held; never evicts (``used``
        may pass the capacity: callers make room first). The replaced entry, or None."""
        replaced = self.remove(key)
        self._sizes[key] = size
        self._values[key] = value
        self._used += size
        self._policy.added(key)
        self._count_kind(key, size)
        return replaced

    def _count_kind(self, key: str, delta: int) -> None:
        """``delta`` bytes of held ``key`` in the tally of its kind (a held key keeps its kind)."""
        kind = self._policy.kind(key)
        if kind:
            self._by_kind[kind] = self._by_kind.get(kind, 0) + delta

    def relocate(self, key: str, size: int, value: V) -> None:
        """Give the held ``key`` a new size and value, keeping its place in the eviction order."""
        self._used += size - self._sizes[key]
        self._count_kind(key, size - self._sizes[key])
        self._sizes[key] = size
        self._values[key] = value

    def ordered(self) -> list[str]:
        """The held keys, the first to evict first (a snapshot)."""
        return list(self._policy.order())

    def remove(self, key: str) -> Entry[V] | None:
        """Drop ``key``; its entry, or None if not held."""
        if key not in self._sizes:
            return None
        self._count_kind(key, -self._sizes[key])  # before the policy forgets the key
        size = self._sizes.pop(key)
        self._used -= size
        self._policy.removed(key)
        return Entry(key, size, self._values.pop(key))

    def clear(self) -> None:
        self._sizes.clear()
        self._values.clear()
        self._used = 0
        self._by_kind.clear()
        self._policy.clear()

    def evict(self, eligible: Callable[[Entry[V]], bool] | None = None) -> Entry[V] | None:
        """Remove the first entry in the policy's order that ``eligible`` accepts (any, without
        it); that entry, or None if there is none."""
        for key in self._policy.order():
            entry = Entry(key, self._sizes[key], self._values[key])
            if eligible is None or eligible(entry):
                break
        else:
            return None
        self._policy.evicting(key)
        self.remove(key)
        return entry

    def make_room(
        self, nbytes: int, eligible: Callable[[Entry[V]], bool] | None = None
    ) -> list[Entry[V]]:
        """Evict (see :meth:`evict`) until ``nbytes`` more fit in the capacity, or no eligible
        entry is left; the entries evicted, first first."""
        evicted: list[Entry[V]] = []
        while self._used + nbytes > self.capacity:
            entry = self.evict(eligible)
            if entry is None:
                break
            evicted.append(entry)
        return evicted

    def put(self, key: str, size: int, value: V) -> list[Entry[V]] | None:
        """Store ``key`` as the most recent entry, replacing its old entry (not an eviction)
        and evicting others for room; the entries evicted, or None when ``size`` exceeds the
        capacity (refused: nothing changes)."""
        if size > self.capacity:
            return None
        self.remove(key)
        evicted = self.make_room(size)
        self.insert(key, size, value)
        return evicted
