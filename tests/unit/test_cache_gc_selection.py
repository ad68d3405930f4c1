"""``hybrid-offload cache gc``'s choice of pages (``select_for_gc``) and ages (``human_age``) at a
given ``now``: no cache, no clock (the CLI tests check the same against real caches)."""

from __future__ import annotations

from hybrid_offload.backends import PageInfo
from hybrid_offload.tools.cli.cache import human_age, select_for_gc

NOW = 1_000_000.0


def info(key: str, idle_s: float | None, size: int = 100) -> PageInfo:
    return PageInfo(key, size, None if idle_s is None else NOW - idle_s)


def keys(infos: list[PageInfo]) -> list[str]:
    return [i.key for i in infos]


def test_older_than_selects_pages_idle_for_longer_only() -> None:
    infos = [info("old", 8 * 86400), info("edge", 7 * 86400), info("new", 1), info("unknown", None)]
    assert keys(select_for_gc(infos, NOW, 7 * 86400, None)) == ["old"]
    assert keys(select_for_gc(infos, NOW + 1, 7 * 86400, None)) == ["old", "edge"]  # a second later


def test_max_bytes_evicts_least_recently_used_first_unknown_ages_oldest() -> None:
    infos = [info("a", 10), info("b", 30), info("unknown", None), info("c", 20)]
    assert keys(select_for_gc(infos, NOW, None, 250)) == ["unknown", "b"]
    assert keys(select_for_gc(infos, NOW, None, 400)) == []
    assert keys(select_for_gc(infos, NOW, None, 0)) == ["unknown", "b", "c", "a"]


def test_age_then_size_and_everything_without_either() -> None:
    infos = [info("old", 100), info("a", 10), info("b", 30)]
    assert keys(select_for_gc(infos, NOW, 60, 100)) == ["old", "b"]
    assert keys(select_for_gc(infos, NOW, None, None)) == ["old", "a", "b"]


def test_human_age_units() -> None:
    ages = [None, -1, 0, 119, 120, 7199, 7200, 172799, 172800]
    assert [human_age(a) for a in ages] == ["-", "0s", "0s", "119s", "2m", "119m", "2h", "47h", "2d"]
