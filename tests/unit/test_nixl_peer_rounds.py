"""The nixl_peer client's bookkeeping of what moves where: staging rounds and direct regions."""

from __future__ import annotations

import itertools
import random

from hybrid_offload.backends.nixl_peer import protocol as p
from hybrid_offload.backends.nixl_peer.rounds import PAGE_GAP, Piece, direct_regions, plan_rounds

HELLO = p.HelloReply("peer", b"", 0, 0, 0)


def test_adjacent_and_nearby_spans_share_a_region() -> None:
    spans = [(1000, 100), (1100, 50), (1150 + PAGE_GAP - 1, 10)]
    assert direct_regions(spans, 8) == [(1000, 150 + PAGE_GAP - 1 + 10)]


def test_spans_a_page_apart_or_more_stay_apart_in_address_order() -> None:
    spans = [(50_000, 10), (1000, 100), (1100 + PAGE_GAP, 10)]
    assert direct_regions(spans, 8) == [(1000, 100), (1100 + PAGE_GAP, 10), (50_000, 10)]


def test_overlapping_and_contained_spans_merge() -> None:
    assert direct_regions([(0, 100), (10, 20), (50, 100)], 1) == [(0, 150)]


def test_more_regions_than_allowed_is_none() -> None:
    spans = [(i * 2 * PAGE_GAP, 1) for i in range(9)]
    assert direct_regions(spans, 8) is None
    assert direct_regions(spans, 9) is not None
    assert direct_regions([], 0) == []


def test_regions_cover_every_span_and_nothing_more_than_page_gaps() -> None:
    rng = random.Random(3)
    for _ in range(200):
        spans = [(rng.randrange(0, 200_000), rng.randrange(1, 9000)) for _ in range(rng.randrange(1, 30))]
        regions = direct_regions(spans, 64)
        assert regions is not None
        for start, length in spans:
            assert any(a <= start and start + length <= a + n for a, n in regions)
        for (a, n), (b, _) in itertools.pairwise(regions):
            assert b - (a + n) >= PAGE_GAP
        covered = {x for a, n in regions for x in range(a, a + n)}
        touched = {x for s, n in spans for x in range(s, s + n)}
        gaps = sorted(covered - touched)
        assert all(any(0 <= x - (s + n) < PAGE_GAP for s, n in spans) for x in gaps[:50])


def test_rounds_fill_staging_exactly_and_split_large_pages() -> None:
    views = [memoryview(bytearray(n)) for n in (700, 300, 2500, 10)]
    pieces = [Piece(i, 0, HELLO, 10_000 * i, v) for i, v in enumerate(views)]
    rounds = plan_rounds(pieces, 1000)
    assert [sum(x.view.nbytes for x in r) for r in rounds] == [1000, 1000, 1000, 510]
    for r in rounds:
        assert [x.local for x in r] == [sum(y.view.nbytes for y in r[:k]) for k in range(len(r))]
    parts = [x for r in rounds for x in r if x.pos == 2]
    assert [(x.remote, x.view.nbytes) for x in parts] == [(20_000, 1000), (21_000, 1000), (22_000, 500)]
