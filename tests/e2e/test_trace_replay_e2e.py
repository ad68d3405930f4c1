"""End to end: a production trace scaled down through vLLM's default engine serves what the
simulator of ``bench trace`` predicts, with every token as without the cache.

The first 200 requests of the Mooncake conversation trace (``tests/data``), 32 tokens a hash
id, go one by one through an engine whose cpu tier holds 15 % of their working set, so it
evicts (~2,400 pages); vLLM's own prefix cache is reset before each request. The same replay
through :class:`~hybrid_offload.tools.bench.trace_model.Replay` (our keys, lookup, checkpoint
rules and the tier's ResumePointPolicy) must serve within 5 points of the engine; a float32
engine without the connector must generate the same tokens. Then again with every request's
session hint (``kv_transfer_params``: ``"ends"`` where no later request extends it), against the
simulator with the same hints: the hint reaches the tier through vLLM's request path, and the
hinted engine serves more than the plain one.

Shared engines (both tests run on one xdist worker): the page-size probe of
:func:`~hybrid_offload.tools.bench.trace_engine.engine_geometry` runs once for both replays
(:func:`geometry_probed_once`: the same model, dtype and connector settings, so the same
pages); the plain replay (:func:`plain`: its cache engine and the engine without the connector)
serves both tests; the hinted replay's cache engine is the second test's own.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hybrid_offload.tools.bench import trace_engine
from hybrid_offload.tools.bench.trace_engine import engine_replay

pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("trace-replay")]  # one engine run shared

TRACE = Path(__file__).parent.parent / "data" / "mooncake_conversation_head300.jsonl"


@pytest.fixture(scope="module")
def geometry_probed_once() -> Iterator[None]:
    """While the module runs, ``engine_geometry`` measures each (model, dtype, connector) once:
    the plain and the hinted replay probe the same engine, whose pages have the same sizes."""
    measured: dict[str, Any] = {}
    probe = trace_engine.engine_geometry

    def once(model: Path, dtype: str, connector: dict[str, Any]) -> Any:
        key = json.dumps([str(model), dtype, connector], sort_keys=True)
        if key not in measured:
            measured[key] = probe(model, dtype, connector)
        return measured[key]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(trace_engine, "engine_geometry", once)
        yield


@pytest.fixture(scope="module")
def plain(model_dir, geometry_probed_once: None) -> dict[str, Any]:
    """The replay at 15 %, with the tokens of an engine without the cache."""
    return engine_replay(model_dir("falcon_h1"), TRACE, requests=200, block=32, size_pct=15.0)


def test_the_scaled_trace_serves_what_the_simulator_predicts(plain: dict[str, Any]) -> None:
    assert plain["identical_tokens"] is True
    assert 20 < plain["engine_served_pct"] < 95  # the tier is full and still serves
    assert abs(plain["engine_served_pct"] - plain["sim_served_pct"]) <= 5, plain["requests_differing"]


def test_session_hints_through_the_engine_serve_what_the_simulator_predicts(
    plain: dict[str, Any], model_dir, geometry_probed_once: None
) -> None:
    hinted = engine_replay(model_dir("falcon_h1"), TRACE, requests=200, block=32, size_pct=15.0,
                           baseline=False, sessions=True)  # fmt: skip
    assert abs(hinted["engine_served_pct"] - hinted["sim_served_pct"]) <= 5, hinted["requests_differing"]
    assert hinted["engine_served_pct"] > plain["engine_served_pct"]  # ended sessions make room
