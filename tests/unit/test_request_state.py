"""A request's load phase: every transition in one table, driven by named events."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from hybrid_offload.connector.scheduler.request_state import LoadEvent, LoadPhase, RequestState

A, D, S, F, X = (LoadEvent.ADMITTED, LoadEvent.DROPPED, LoadEvent.SENT, LoadEvent.FINISHED,
                 LoadEvent.FAILED)


def state() -> RequestState:
    request: Any = SimpleNamespace(request_id="r", all_token_ids=[])
    return RequestState(request, prompt_len=0, seed=b"", chunk_hashes=[], keys=[])


@pytest.mark.parametrize(("events", "phases"), [
    ((A, S, F), [LoadPhase.PENDING, LoadPhase.LOADING, LoadPhase.IDLE]),  # a load
    ((A, S, F, A), [LoadPhase.PENDING, LoadPhase.LOADING, LoadPhase.IDLE, LoadPhase.PENDING]),
    ((A, D, S), [LoadPhase.PENDING, LoadPhase.IDLE, LoadPhase.IDLE]),  # served elsewhere
    ((S, F, D), [LoadPhase.IDLE] * 3),  # nothing planned: nothing moves
    ((A, S, A, D), [LoadPhase.PENDING] + [LoadPhase.LOADING] * 3),  # in flight stays in flight
    ((A, S, F, X), [LoadPhase.PENDING, LoadPhase.LOADING, LoadPhase.IDLE, LoadPhase.FAILED]),
    ((A, S, X, A, S, F), [LoadPhase.PENDING, LoadPhase.LOADING] + [LoadPhase.FAILED] * 4),
])
def test_load_phases(events: tuple[LoadEvent, ...], phases: list[LoadPhase]) -> None:
    s = state()
    assert s.load_phase is LoadPhase.IDLE and not s.loading
    assert [s.on_load(e) for e in events] == phases
    assert s.loading == (phases[-1] is LoadPhase.LOADING)
