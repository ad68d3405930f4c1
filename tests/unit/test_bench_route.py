"""`bench route`'s pure parts: the users' traffic, routing-mode selection, result aggregation."""

from __future__ import annotations

import argparse
import itertools
import math

import pytest

from hybrid_offload.router import CacheIndex, Cleared, Stored, block_hashes
from hybrid_offload.testing.services import Metrics
from hybrid_offload.tools.bench.route import shape_from
from hybrid_offload.tools.bench.route_report import (
    add_counts,
    chunk_tokens_from_log,
    counters_of,
    hash_block_size_from_log,
    metric_delta,
    summarize_mode,
)
from hybrid_offload.tools.bench.route_traffic import (
    MODES,
    QUICK_SHAPE,
    Picker,
    TrafficShape,
    make_users,
    sticky_engine,
)

ENGINES = ["e0", "e1", "e2"]


def stored(tokens: list[int], block: int, medium: str = "GPU", locality: str | None = None) -> list[Stored]:
    """vLLM's events for ``tokens`` held by one medium: attention blocks (group 0) and a state
    (group 1) at the last full block."""
    chain = [int.from_bytes(h, "big") & ((1 << 64) - 1) for h in block_hashes(tokens, block)]
    full = len(chain) * block
    attention = Stored(tuple(chain), None, tuple(tokens[:full]), block, medium, 0, "full_attention", None,
                       locality, None)
    state = Stored((chain[-1],), chain[-2] if len(chain) > 1 else None, tuple(tokens[full - block : full]),
                   block, medium, 1, "mamba", None, locality, None)
    return [attention, state]  # fmt: skip


def drive(users: list, reply: int = 5) -> dict[str, list[tuple[int, ...]]]:
    """Every user's prompts, answering each turn with ``max_tokens`` copies of ``reply``."""
    prompts: dict[str, list[tuple[int, ...]]] = {}
    for user in users:
        wave = next(user.gen)
        while True:
            (req,) = wave
            prompts.setdefault(user.name, []).append(req.prompt)
            try:
                wave = user.gen.send([[reply] * req.max_tokens])
            except StopIteration:
                break
    return prompts


def test_users_grow_their_own_history_and_agents_share_a_system_prompt() -> None:
    shape = TrafficShape(chat_users=2, agent_users=2, turns=3, reply=4)
    users = make_users(shape, seed=3)
    assert [u.name for u in users] == ["chat0", "agent0", "chat1", "agent1"]
    prompts = drive(users)
    for turns in prompts.values():
        assert len(turns) == 3
        for before, after in itertools.pairwise(turns):
            # the next turn = the previous prompt + the reply + a new message
            assert after[: len(before) + 4] == before + (5,) * 4
            assert len(after) > len(before) + 4
    a0, a1 = prompts["agent0"][0], prompts["agent1"][0]
    shared = next(i for i, (x, y) in enumerate(zip(a0, a1, strict=False)) if x != y)
    assert shape.system[0] <= shared  # the system prompt, then each agent's own task
    assert prompts["chat0"][0][:50] != prompts["chat1"][0][:50]
    # seeded: the same users again
    assert drive(make_users(shape, seed=3)) == prompts
    assert drive(make_users(shape, seed=4)) != prompts


def test_max_prompt_bounds_every_prompt() -> None:
    shape = QUICK_SHAPE
    longest = max(len(p) for turns in drive(make_users(shape, 1), reply=1).values() for p in turns)
    assert longest <= shape.max_prompt()


def test_round_robin_cycles_and_sticky_keeps_a_user_on_one_engine() -> None:
    rr = Picker("round_robin", ENGINES)
    assert [rr.pick("u", [1]) for _ in range(5)] == ["e0", "e1", "e2", "e0", "e1"]
    sticky = Picker("sticky", ENGINES)
    for user in ("chat0", "agent1", "x"):
        assert {sticky.pick(user, [1, 2]) for _ in range(4)} == {sticky_engine(user, ENGINES)}
    assert rr.route_s == sticky.route_s == []


def test_index_mode_routes_by_the_real_index_with_requests_in_flight_as_ties() -> None:
    ticks = iter(range(100))
    index = CacheIndex(hash_block_size=4)
    picker = Picker("index", ENGINES, index, clock=lambda: float(next(ticks)))
    prompt = list(range(10, 23))  # 13 tokens: 3 blocks of 4 and a tail
    picker.started("e0")
    picker.started("e0")
    picker.started("e2")
    assert picker.pick("u", prompt) == "e1"  # nothing cached anywhere: the idlest
    index.apply("e2", stored(prompt, 4))
    assert index.restorable("e2", prompt) == {"GPU": 12}
    assert picker.pick("u", prompt) == "e2"  # its GPU cache wins over its load
    # a shared tier every engine published: a tie again, broken by load
    for engine in ENGINES:
        index.apply(engine, stored(prompt[:8], 4, "redis", "REMOTE"))
    index.apply("e2", [Cleared()])
    assert index.restorable("e0", prompt) == {"redis": 8}
    picker.finished("e2")
    assert picker.pick("u", prompt) == "e1"  # e1 and e2 idle: the first of them
    assert picker.route_s == [1.0, 1.0, 1.0]


def test_unknown_mode_and_index_mode_without_index_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown routing mode"):
        Picker("random", ENGINES)
    with pytest.raises(ValueError, match="needs an index"):
        Picker("index", ENGINES)
    assert set(MODES) == {"round_robin", "index", "sticky"}


def _metrics(prompt: float, local: float, external: float) -> Metrics:
    return Metrics(
        f"vllm:prompt_tokens_total{{engine=\"0\"}} {prompt}\n"
        f'vllm:prompt_tokens_by_source_total{{source="local_cache_hit"}} {local}\n'
        f'vllm:prompt_tokens_by_source_total{{source="external_kv_transfer"}} {external}\n'
        f'vllm:prompt_tokens_by_source_total{{source="local_compute"}} {prompt - local - external}\n'
        "vllm:time_to_first_token_seconds_sum 1.5\nvllm:time_to_first_token_seconds_count 3\n"
    )


def test_metric_deltas_are_summed_over_engines() -> None:
    deltas = [
        metric_delta(_metrics(100, 10, 0), _metrics(1100, 210, 300)),
        metric_delta(_metrics(0, 0, 0), _metrics(500, 0, 100)),
    ]
    total = add_counts(deltas)
    assert total["prompt_tokens"] == 1500
    assert total["local_cache_hit"] == 200
    assert total["external_kv_transfer"] == 400
    assert total["local_compute"] == 900
    assert total["server_ttft_count"] == 0


def test_summarize_mode_shares_percentiles_and_errors() -> None:
    records = [
        {"engine": "e0", "prompt_tokens": 1000, "cached_tokens": 0, "reusable": 0, "ttft_s": 0.10},
        {"engine": "e1", "prompt_tokens": 1200, "cached_tokens": 768, "reusable": 1024, "ttft_s": 0.02,
         "route_us": 50.0, "predicted": 768},
        {"engine": "e1", "prompt_tokens": 1800, "cached_tokens": 1024, "reusable": 1536, "ttft_s": 0.04,
         "route_us": 70.0, "predicted": 1280},
        {"engine": "e2", "prompt_tokens": 900, "cached_tokens": None, "reusable": 0, "ttft_s": math.nan,
         "error": "HTTP 500: boom"},
    ]  # fmt: skip
    metrics = {"prompt_tokens": 4000.0, "local_cache_hit": 1000.0, "external_kv_transfer": 792.0}
    events = {"events": 120.0, "gaps": 1.0, "resyncs": 1.0}
    row = summarize_mode("index", records, [50e-6, 70e-6], metrics, events, wall_s=12.0)
    assert row["requests"] == 4 and row["errors"] == 1 and row["first_error"] == "HTTP 500: boom"
    assert row["prompt_tokens"] == 4000 and row["cached_tokens"] == 1792
    assert row["cached_pct"] == 44.8
    assert row["reusable_pct"] == 64.0
    assert row["cached_of_reusable_pct"] == 70.0
    assert row["gpu_pct"] == 25.0 and row["connector_pct"] == 19.8
    assert row["ttft_p50_ms"] == 40.0 and row["ttft_mean_ms"] == pytest.approx(53.3, abs=0.1)
    assert row["ttft_p90_ms"] == pytest.approx(88.0)
    assert row["route_calls"] == 2 and row["route_mean_us"] == 60.0 and row["route_p99_us"] == 69.8
    assert row["events_per_s"] == 10.0 and row["gaps"] == 1 and row["resyncs"] == 1
    assert row["per_engine"] == "1/2/1"
    assert row["predicted_tokens"] == 2048 and row["predicted_exact"] == 1 and row["predicted_over"] == 1


def test_summarize_mode_without_route_calls_or_requests() -> None:
    row = summarize_mode("round_robin", [], [], {}, {}, wall_s=0.0)
    assert row["requests"] == 0 and row["cached_pct"] == 0.0 and row["route_mean_us"] is None
    assert math.isnan(row["ttft_p50_ms"]) and row["events_per_s"] == 0.0


def test_counters_of_reads_dicts_dataclasses_and_objects() -> None:
    from dataclasses import dataclass

    @dataclass
    class Counters:
        events: int = 3
        gaps: int = 1
        endpoint: str = "tcp://x"

    class WithAttr:
        counters = {"events": 2, "resyncs": 1, "alive": True}

    class WithMethod:
        def stats(self) -> Counters:
            return Counters()

    assert counters_of(Counters()) == {"events": 3, "gaps": 1}
    assert counters_of(WithAttr()) == {"events": 2, "resyncs": 1}
    assert counters_of(WithMethod()) == {"events": 3, "gaps": 1}


def test_hash_block_size_from_the_server_log() -> None:
    log = "INFO [kv_cache_utils.py:853] kv cache group sizes (256, 256)\nkv lcm block sizes 256"
    assert hash_block_size_from_log(log) == 256
    assert hash_block_size_from_log("kv cache group sizes (64, 640, 640)") == 64
    assert hash_block_size_from_log("nothing here") is None


def test_quick_and_sized_shapes_from_flags() -> None:
    args = argparse.Namespace(quick=True, chat_users=None, agent_users=4, turns=None, reply=None)
    shape = shape_from(args)
    assert shape.agent_users == 4 and shape.turns == QUICK_SHAPE.turns
    full = shape_from(argparse.Namespace(quick=False, chat_users=1, agent_users=None, turns=5, reply=32))
    assert (full.chat_users, full.turns, full.reply) == (1, 5, 32)
    assert full.agent_users == TrafficShape().agent_users


def test_connector_chunk_from_the_server_log() -> None:
    log = (
        "(EngineCore pid=7) INFO [facade.py:161] hybrid-offload scheduler (TP rank 0 of 1, PP rank 0 of 1): "
        "fingerprint=8cee, chunk_tokens=128, layer parts=(0, 2)"
    )
    assert chunk_tokens_from_log(log) == 128
    assert chunk_tokens_from_log("no connector") is None
