"""End to end: a production trace scaled down through vLLM's default engine serves what the
simulator of ``bench trace`` predicts, with every token as without the cache.

The first 200 requests of the Mooncake conversation trace (``tests/data``), 32 tokens a hash
id, go one by one through an engine whose cpu tier holds 15 % of their working set, so it
evicts (~2,400 pages); vLLM's own prefix cache is reset before each request. The same replay
through :class:`~hybrid_offload.tools.bench.trace_model.Replay` (our keys, lookup, checkpoint
rules and the tier's ResumePointPolicy) must serve within 5 points of the engine; a float32
engine without the connector must generate the same tokens. Then again with every request's
session hint (``kv_transfer_params``: ``"ends"`` where no later request extends it), against the
simulator with the same hints: the hint reaches the tier through vLLM's request path.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hybrid_offload.tools.bench.trace_engine import engine_replay

pytestmark = pytest.mark.e2e

TRACE = Path(__file__).parent.parent / "data" / "mooncake_conversation_head300.jsonl"


def test_the_scaled_trace_serves_what_the_simulator_predicts(model_dir) -> None:
    result = engine_replay(model_dir("falcon_h1"), TRACE, requests=200, block=32, size_pct=15.0)
    assert result["identical_tokens"] is True
    assert 20 < result["engine_served_pct"] < 95  # the tier is full and still serves
    assert abs(result["engine_served_pct"] - result["sim_served_pct"]) <= 5, result["requests_differing"]


def test_session_hints_through_the_engine_serve_what_the_simulator_predicts(model_dir) -> None:
    model = model_dir("falcon_h1")
    plain = engine_replay(model, TRACE, requests=200, block=32, size_pct=5.0, baseline=False)
    hinted = engine_replay(model, TRACE, requests=200, block=32, size_pct=5.0, baseline=False, sessions=True)
    assert abs(hinted["engine_served_pct"] - hinted["sim_served_pct"]) <= 5, hinted["requests_differing"]
    assert hinted["engine_served_pct"] > plain["engine_served_pct"]  # ended sessions make room
