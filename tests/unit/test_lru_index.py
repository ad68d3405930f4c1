"""The page index the in-memory indexes of cpu, disk, lmcache and the cache peer share."""

from __future__ import annotations

from hybrid_offload.backends.lru_index import Fifo, LruIndex


def test_bytes_replacement_and_eviction_order() -> None:
    index: LruIndex[str] = LruIndex()
    index.put("a", 10, "A")
    index.put("b", 20)
    index.put("c", 5)
    assert (index.used, len(index), index.keys()) == (35, 3, ["a", "b", "c"])
    index.put("a", 7, "A2")  # a re-put replaces and is the newest
    assert (index.used, index.keys()) == (32, ["b", "c", "a"])
    entry = index.get("b")
    assert entry is not None and (entry.size, entry.value) == (20, None)
    assert index.keys() == ["c", "a", "b"]  # an access makes it the most recently used
    assert index.get("c", access=False) is not None and index.keys() == ["c", "a", "b"]
    assert index.touch("c") and not index.touch("zz") and index.keys() == ["a", "b", "c"]
    index.touch_all(["b", "zz", "a"])
    assert index.keys() == ["c", "b", "a"] and index.contains(["a", "zz"]) == [True, False]
    index.touch_all(["b", "c"])
    victim = index.pop_victim()
    assert victim is not None and victim[0] == "a" and victim[1].value == "A2"
    assert index.used == 25 and "a" not in index
    assert index.pop("zz") is None and index.pop("b") is not None and index.used == 5
    index.clear()
    assert (index.used, len(index), index.pop_victim()) == (0, 0, None)


def test_victims_skip_what_must_stay() -> None:
    index: LruIndex[int] = LruIndex()
    for key, pins in (("a", 1), ("b", 0), ("c", 2)):
        index.put(key, 1, pins)
    pinned = lambda key, entry: entry.value > 0  # noqa: E731
    victim = index.pop_victim(pinned)
    assert victim is not None and victim[0] == "b"
    assert index.pop_victim(pinned) is None and index.keys() == ["a", "c"]


def test_the_policy_decides_what_an_access_does() -> None:
    """The same index under FIFO: reads do not save a page from eviction."""
    lru, fifo = LruIndex(), LruIndex(Fifo())
    for index in (lru, fifo):
        for key in "abc":
            index.put(key, 1)
        index.get("a")
        index.touch("b")
    assert lru.pop_victim()[0] == "c"  # type: ignore[index]
    assert fifo.pop_victim()[0] == "a"  # type: ignore[index]
