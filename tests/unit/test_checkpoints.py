"""Checkpoint positions, stores in flight and per-request coverage (pure scheduler-side logic)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hybrid_offload.connector.scheduler.coverage import Coverage, coverage
from hybrid_offload.connector.scheduler.pending import PendingStores
from hybrid_offload.core.checkpoints import interval_stop, prefill_checkpoints


# ---- prefill checkpoints ---------------------------------------------------------------------
@pytest.mark.parametrize(
    ("prefill_end", "junction", "expected"),
    [
        (900, 0, [896]),  # the tail: the last chunk boundary strictly below the prompt's end
        (896, 0, [768]),  # at least one token is recomputed
        (897, 0, [896]),
        (128, 0, []),
        (129, 0, [128]),
        (0, 0, []),
        (3000, 1536, [1536, 2944]),
        (3000, 3000, [2944]),  # a junction at or past the end is no stop
        (3000, 1500, [2944]),  # not a chunk boundary: ignored
    ],
)
def test_prefill_checkpoints(prefill_end: int, junction: int, expected: list[int]) -> None:
    assert prefill_checkpoints(prefill_end, 128, junction) == expected


@pytest.mark.parametrize(
    ("start", "end", "last", "align", "expected"),
    [
        (0, 7392, 0, 1056, 7392),  # vLLM's block-aligned end: the state there, no extra step
        (0, 900, 0, 128, 900),  # not due yet (interval 1024)
        (1000, 2100, 1100, 128, 2100),  # not due at 2048 either (948 past the last state)
        (1000, 2100, 0, 128, 2048),  # due: the step ends on the last boundary inside it
        (2050, 2100, 0, 128, 2100),  # no boundary inside the step: left alone
        (0, 3000, 2500, 1, 3000),  # not due
    ],
)
def test_interval_states_are_taken_where_steps_end(
    start: int, end: int, last: int, align: int, expected: int
) -> None:
    assert interval_stop(start, end, last, 1024, align) == expected


@given(st.integers(0, 50_000), st.integers(1, 9000), st.integers(0, 50_000),
       st.sampled_from([16, 128, 544, 1056]), st.sampled_from([0, 512, 1024, 4096]))  # fmt: skip
def test_interval_stop_properties(start: int, length: int, last: int, align: int, interval: int) -> None:
    end = start + length
    stop = interval_stop(start, end, last, interval, align)
    assert start < stop <= end
    assert stop == end or (stop % align == 0 and end - stop < align and stop - last >= interval)


@pytest.mark.parametrize(
    ("prefill_end", "expected"),
    [
        (687, [512, 640]),  # KV events name every 256 tokens: a state at 512 too
        (600, [512]),  # the tail is nameable: listed once
        (513, [512]),
        (300, [256]),
        (256, [128]),  # nothing nameable below the end
    ],
)
def test_prefill_checkpoints_add_the_last_named_position(prefill_end: int, expected: list[int]) -> None:
    assert prefill_checkpoints(prefill_end, 128, 0, named=256) == expected


@given(st.integers(0, 20_000), st.sampled_from([16, 64, 128]), st.integers(0, 200))
def test_prefill_checkpoints_properties(end: int, chunk: int, junction_chunks: int) -> None:
    junction = junction_chunks * chunk
    stops = prefill_checkpoints(end, chunk, junction)
    assert stops == sorted(set(stops))
    assert all(0 < s < end and s % chunk == 0 for s in stops)
    if end > chunk:
        assert stops[-1] == (end - 1) // chunk * chunk  # a repeat of the prompt resumes there
    if 0 < junction < end:
        assert junction in stops



# ---- stores in flight ----------------------------------------------------------------------
def test_pending_waits_until_every_writer_reported() -> None:
    now = [0.0]
    pending = PendingStores(2.0, lambda: now[0])
    assert not pending.should_wait("r", ["a", "b"])  # nothing in flight
    pending.add("a", reports=2)  # e.g. two TP ranks write shards of it
    assert pending.should_wait("r", ["x", "a"])
    assert not pending.should_wait("r", ["x", "y"])
    pending.settle(["a"])
    assert pending.should_wait("r", ["a"])
    pending.settle(["a", "unknown"])
    assert not pending.should_wait("r", ["a"]) and len(pending) == 0


def test_pending_gives_up_per_request_and_per_key() -> None:
    now = [0.0]
    pending = PendingStores(2.0, lambda: now[0])
    pending.add("a", 1)
    assert pending.should_wait("r1", ["a"])
    now[0] = 1.5
    pending.add("b", 1)  # a newer store
    assert pending.should_wait("r1", ["a"]) and pending.should_wait("r2", ["b"])
    now[0] = 2.0  # r1 waited 2 s; the key "a" is forgotten too
    assert not pending.should_wait("r1", ["b"])
    assert pending.should_wait("r2", ["b"])
    now[0] = 3.6
    assert not pending.should_wait("r2", ["b"]) and len(pending) == 0
    pending.done_waiting("r1")
    pending.add("c", 1)
    assert pending.should_wait("r1", ["c"])  # a new wait starts after done_waiting


def test_pending_wait_zero_never_waits() -> None:
    pending = PendingStores(0.0, lambda: 0.0)
    pending.add("a", 1)
    assert not pending.should_wait("r", ["a"])


# ---- coverage ------------------------------------------------------------------------------
def test_coverage_attributes_the_gap() -> None:
    # served 1024; attention pages reach 1536 (no state there); the engine saw 2048 before
    cov = coverage(local=0, served_end=1024, attention_end=1536, seen_end=2048, backend_down=False)
    assert cov == Coverage(0, 1024, 2048, {"evicted": 512, "no_state": 512})
    # a backend could not be asked: the whole gap is put on it
    cov = coverage(0, 1024, 1536, 2048, backend_down=True)
    assert cov.lost == {"backend_down": 1024}
    # vLLM's own hit is not counted on either side
    cov = coverage(local=512, served_end=0, attention_end=1024, seen_end=0, backend_down=False)
    assert cov == Coverage(512, 0, 512, {"no_state": 512})
    assert coverage(0, 2048, 1024, 1024, False) == Coverage(0, 2048, 2048, {})
    # the chunks seen beyond every page were never stored (computed alongside, or below the
    # store threshold): not evicted
    cov = coverage(0, 1024, 1536, 2048, backend_down=False, gap_stored=False)
    assert cov.lost == {"not_stored": 512, "no_state": 512}


def test_coverage_with_served() -> None:
    cov = coverage(0, 1024, 1024, 2048, False).with_served(512)
    assert cov == Coverage(0, 512, 2048, {"evicted": 1536})
    assert coverage(0, 1024, 1024, 1024, False).with_served(2048) == Coverage(0, 2048, 2048, {})
    assert cov.as_dict() == {"local_tokens": 0, "served_tokens": 512, "reusable_tokens": 2048,
                             "lost_tokens": {"evicted": 1536}}
