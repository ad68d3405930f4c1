"""tp_shards: unit shares, shard counts, who writes and reads which shard, and round trips of
whole tensors through every (writer TP, reader TP) pair. vLLM's own sharding is checked against
real tensors in tests/e2e/test_tp_portable_pages_e2e.py."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybrid_offload.core.tp_shards import (
    Component,
    ShardLayoutError,
    TensorSplit,
    held_units,
    read_plan,
    shard_count,
    shards_read,
    shards_written,
    transfers,
)


def mamba2(heads: int, groups: int, head_dim: int = 4, state: int = 3) -> tuple[TensorSplit, ...]:
    conv = TensorSplit(1, (Component("x", heads, head_dim), Component("B", groups, state),
                           Component("C", groups, state)))
    return conv, TensorSplit(0, (Component("heads", heads, 1),))


def test_held_units_shares_and_replicas() -> None:
    assert [held_units(8, 4, r) for r in range(4)] == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert [held_units(2, 4, r) for r in range(4)] == [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]
    assert [held_units(1, 2, r) for r in range(2)] == [range(0, 1)] * 2
    with pytest.raises(ShardLayoutError, match="evenly"):
        held_units(6, 4, 0)
    with pytest.raises(ShardLayoutError, match="replicate"):
        held_units(3, 4, 0)
    with pytest.raises(ShardLayoutError, match="does not exist"):
        held_units(8, 2, 2)


@pytest.mark.parametrize(("splits", "cap", "want"), [
    ((TensorSplit(2, (Component("kv", 2, 1),)),), 8, 2),  # 2 KV heads: 2 shards, never replicas
    ((TensorSplit(2, (Component("kv", 32, 1),)),), 8, 8),
    (mamba2(8, 1), 8, 8),  # the single group rides along in every shard
    (mamba2(8, 2), 4, 4),
    (mamba2(6, 1), 8, 2),  # 6 heads: shares of 8 or 4 do not divide
    (mamba2(8, 1), 1, 1),
    ((TensorSplit(1, (Component("q", 2, 4), Component("k", 2, 4), Component("v", 4, 4))),), 8, 4),
])
def test_shard_count(splits: tuple[TensorSplit, ...], cap: int, want: int) -> None:
    assert shard_count(splits, cap) == want


def test_every_shard_written_once_and_replicas_do_not_write_twice() -> None:
    kv = (TensorSplit(2, (Component("kv", 2, 1),)),)
    assert [shards_written(kv, 2, 4, r) for r in range(4)] == [[0], [], [1], []]
    assert [shards_read(kv, 2, 4, r) for r in range(4)] == [[0], [0], [1], [1]]
    splits = mamba2(8, 1)
    assert [shards_written(splits, 8, 2, r) for r in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert shards_read(splits, 8, 1, 0) == list(range(8))


def test_a_shard_spanning_ranks_has_no_writer() -> None:
    with pytest.raises(ShardLayoutError, match="multiple of the TP size"):
        shards_written((TensorSplit(2, (Component("kv", 8, 1),)),), 2, 4, 0)


def test_transfers_are_runs_of_units() -> None:
    conv, _ = mamba2(8, 1)
    # shard 1 of 4 (heads 2-3, group 0) into rank 0 of 2 (heads 0-3, group 0)
    runs = transfers(conv, (4, 1), (2, 0))
    assert [(t.component, t.a_start, t.b_start, t.length) for t in runs] == [
        (0, 0, 8, 8), (1, 8, 16, 3), (2, 11, 19, 3)]
    plan = read_plan(conv, 4, [0, 1], 2, 0)
    assert [t.component for t in plan[1]] == [0]  # the replicated group came from shard 0


def _take(full: np.ndarray, split: TensorSplit, parts: int, index: int) -> np.ndarray:
    """Part ``index`` of ``parts`` of ``full`` by the unit rule (concatenated components)."""
    pieces, at = [], 0
    for c in split.components:
        held = held_units(c.units, parts, index)
        lo, hi = at + held.start * c.unit_size, at + held.stop * c.unit_size
        pieces.append(np.take(full, range(lo, hi), axis=split.axis))
        at += c.units * c.unit_size
    return np.concatenate(pieces, axis=split.axis)


@st.composite
def layouts(draw: st.DrawFn) -> tuple[tuple[TensorSplit, ...], int, int, int]:
    heads = draw(st.sampled_from([1, 2, 4, 8, 16]))
    groups = draw(st.sampled_from([g for g in (1, 2, 4, 8) if heads % g == 0]))
    splits = mamba2(heads, groups, draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    shards = shard_count(splits, draw(st.sampled_from([1, 2, 4, 8])))
    valid = [t for t in (1, 2, 4, 8) if heads % t == 0 and (groups % t == 0 or groups == 1)]
    return splits, shards, draw(st.sampled_from(valid)), draw(st.sampled_from(valid))


@settings(max_examples=200, deadline=None)
@given(layouts())
def test_round_trip_between_any_two_tp_sizes(layout: tuple[tuple[TensorSplit, ...], int, int, int]) -> None:
    splits, shards, t1, t2 = layout
    fulls = [np.random.default_rng(i).integers(0, 1 << 30, (3, s.extent(1, 0))) if s.axis == 1
             else np.random.default_rng(i).integers(0, 1 << 30, (s.extent(1, 0), 2))
             for i, s in enumerate(splits)]
    try:
        writers = [shards_written(splits, shards, t1, r) for r in range(t1)]
    except ShardLayoutError:
        assert shards < t1  # only a shard count below the TP size can span ranks
        return
    assert sorted(p for w in writers for p in w) == list(range(shards))
    stored: dict[tuple[int, int], np.ndarray] = {}
    for r, mine in enumerate(writers):
        for i, (split, full) in enumerate(zip(splits, fulls, strict=True)):
            rank = _take(full, split, t1, r)
            for p in mine:
                page = np.full_like(_take(full, split, shards, p), -1)
                for run in transfers(split, (shards, p), (t1, r)):
                    dst = [slice(None)] * 2
                    dst[split.axis] = slice(run.a_start, run.a_start + run.length)
                    src = [slice(None)] * 2
                    src[split.axis] = slice(run.b_start, run.b_start + run.length)
                    page[tuple(dst)] = rank[tuple(src)]
                assert (page >= 0).all()
                stored[(p, i)] = page
    for r in range(t2):
        chosen = shards_read(splits, shards, t2, r)
        for i, (split, full) in enumerate(zip(splits, fulls, strict=True)):
            want = _take(full, split, t2, r)
            got = np.full_like(want, -1)
            for p, runs in read_plan(split, shards, chosen, t2, r).items():
                for run in runs:
                    dst = [slice(None)] * 2
                    dst[split.axis] = slice(run.b_start, run.b_start + run.length)
                    src = [slice(None)] * 2
                    src[split.axis] = slice(run.a_start, run.a_start + run.length)
                    got[tuple(dst)] = stored[(p, i)][tuple(src)]
            assert np.array_equal(got, want)
