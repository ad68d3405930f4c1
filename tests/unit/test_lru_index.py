"""The shared page index (backends/lru_index.py): capacity, recency, eviction and its seams."""

from __future__ import annotations

from collections.abc import Iterator

from hybrid_offload.backends.lru_index import Entry, EvictionPolicy, LruIndex


def keys_in_eviction_order(index: LruIndex[object]) -> list[str]:
    order = []
    while (entry := index.evict()) is not None:
        order.append(entry.key)
    return order


def test_capacity_bounds_used_bytes_and_put_evicts_oldest_first() -> None:
    index: LruIndex[str] = LruIndex(100)
    assert index.put("a", 40, "A") == []
    assert index.put("b", 40, "B") == []
    assert index.used == 80 and len(index) == 2
    evicted = index.put("c", 40, "C")
    assert evicted == [Entry("a", 40, "A")]
    assert index.used == 80 and "a" not in index and index.get("c") == Entry("c", 40, "C")
    assert index.put("d", 100, "D") == [Entry("b", 40, "B"), Entry("c", 40, "C")]
    assert index.used == 100 and list(index) == ["d"]


def test_a_page_larger_than_the_capacity_is_refused_and_changes_nothing() -> None:
    index: LruIndex[None] = LruIndex(100)
    index.put("a", 60, None)
    assert index.put("big", 101, None) is None
    assert index.put("a", 101, None) is None  # not even the key's old page goes
    assert index.sizes() == [("a", 60)] and index.used == 60
    assert index.put("exact", 100, None) == [Entry("a", 60, None)]


def test_re_put_replaces_without_evicting_and_refreshes() -> None:
    index: LruIndex[str] = LruIndex(100)
    index.put("a", 30, "old")
    index.put("b", 30, "B")
    assert index.put("a", 50, "new") == []  # the old "a" is replaced, not evicted
    assert index.used == 80 and index.get("a") == Entry("a", 50, "new")
    assert keys_in_eviction_order(index) == ["b", "a"]


def test_touch_makes_most_recent_and_get_does_not() -> None:
    index: LruIndex[None] = LruIndex(1000)
    for key in "abcd":
        index.put(key, 10, None)
    assert index.touch("b") == Entry("b", 10, None)
    assert index.touch("missing") is None
    index.get("a")
    assert keys_in_eviction_order(index) == ["a", "c", "d", "b"]
    assert index.used == 0


def test_make_room_evicts_in_order_until_it_fits() -> None:
    index: LruIndex[None] = LruIndex(100)
    for key in "abcde":
        index.put(key, 20, None)
    index.touch("a")
    assert [e.key for e in index.make_room(30)] == ["b", "c"]
    assert index.used == 60
    assert index.make_room(0) == []


def test_insert_and_remove_never_evict() -> None:
    index: LruIndex[None] = LruIndex(10)
    assert index.insert("a", 8, None) is None
    assert index.insert("b", 8, None) is None  # over capacity: the caller made room elsewhere
    assert index.used == 16
    assert index.insert("a", 3, None) == Entry("a", 8, None)
    assert index.remove("b") == Entry("b", 8, None) and index.remove("b") is None
    assert index.used == 3
    index.clear()
    assert index.used == 0 and len(index) == 0 and index.evict() is None


def test_eligible_skips_pinned_entries() -> None:
    pinned = {"a", "c"}
    index: LruIndex[None] = LruIndex(100)
    for key in "abcd":
        index.put(key, 25, None)

    def unpinned(entry: Entry[None]) -> bool:
        return entry.key not in pinned

    assert index.evict(unpinned) == Entry("b", 25, None)
    assert [e.key for e in index.make_room(60, unpinned)] == ["d"]  # then only pinned are left
    assert index.used == 50 and set(index) == {"a", "c"}
    assert index.evict(unpinned) is None


class FifoPolicy(EvictionPolicy):
    """First in, first out: use does not matter (a second policy through the same index)."""

    def __init__(self) -> None:
        self.arrivals: list[str] = []
        self.used_keys: list[str] = []

    def added(self, key: str) -> None:
        self.arrivals.append(key)

    def used(self, key: str) -> None:
        self.used_keys.append(key)

    def removed(self, key: str) -> None:
        self.arrivals.remove(key)

    def clear(self) -> None:
        del self.arrivals[:]

    def order(self) -> Iterator[str]:
        yield from self.arrivals


def test_a_second_policy_decides_the_victims() -> None:
    policy = FifoPolicy()
    index: LruIndex[None] = LruIndex(60, policy)
    for key in "abc":
        index.put(key, 20, None)
    index.touch("a")  # under LRU "b" would go first; FIFO still takes "a"
    assert policy.used_keys == ["a"]
    assert [e.key for e in index.make_room(20)] == ["a"]
    index.put("b", 20, None)  # a re-put is a new arrival
    assert [e.key for e in index.put("d", 60, None) or []] == ["c", "b"]
    assert policy.arrivals == ["d"]
    index.clear()
    assert policy.arrivals == []
