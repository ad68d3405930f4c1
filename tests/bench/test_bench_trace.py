"""`bench trace`: the trace loader, the replay model, and a quick run of the command."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from hybrid_offload.backends.retention import ResumePointPolicy
from hybrid_offload.tools.bench.trace_file import TraceError, TraceRequest, load_trace, scaled, session_ends
from hybrid_offload.tools.bench.trace_model import (
    Geometry,
    NextUsePolicy,
    Replay,
    Rules,
    Traffic,
    unlimited,
    uses_of,
)

QWEN = Geometry("qwen3_next_80b", 24576, 39518208)


def conversations(n: int, seed: int = 3) -> list[TraceRequest]:
    """``n`` chats of 1-4 turns interleaved: each turn repeats the last one's prompt (its full
    blocks) and adds 1-3 blocks; all share block 0 (a system prompt); lengths not on blocks."""
    rng = random.Random(seed)
    next_id, out, live = 1, [], []
    for t in range(n * 3):
        if live and rng.random() < 0.5:
            ids, turns = live.pop(rng.randrange(len(live)))
        else:
            ids, turns = [0], 0
        add = rng.randrange(1, 4)
        ids = [*ids, *range(next_id, next_id + add)]
        next_id += add
        length = (len(ids) - 1) * 512 + rng.randrange(1, 512)
        out.append(TraceRequest(t * 1000, length, 100, tuple(ids)))
        if turns < 3:
            live.append((ids[: length // 512], turns + 1))
    return out


def test_load_trace_names_the_bad_line(tmp_path: Path) -> None:
    good = {"timestamp": 0, "input_length": 1030, "output_length": 5, "hash_ids": [0, 1, 2]}
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(good) + "\n\n" + json.dumps(good) + "\n")
    assert [r.hash_ids for r in load_trace(path)] == [(0, 1, 2), (0, 1, 2)]
    for bad, message in [
        ("{not json", "t.jsonl:2: not JSON"),
        (json.dumps({**good, "input_length": -1}), "input_length must be an integer >= 0"),
        (json.dumps({**good, "hash_ids": [0, "x"]}), "hash_ids must be a list"),
        (json.dumps({**good, "input_length": 5000}), "3 hash_ids cannot name 5000 tokens"),
    ]:
        path.write_text(json.dumps(good) + "\n" + bad + "\n")
        with pytest.raises(TraceError, match=message):
            load_trace(path)


def test_a_next_turn_resumes_where_the_last_one_ended() -> None:
    turn1 = TraceRequest(0, 3 * 512 + 100, 10, (0, 1, 2, 3))
    turn2 = TraceRequest(1, 5 * 512 + 7, 10, (0, 1, 2, 4, 5, 6))  # shares turn 1's full blocks
    replay = unlimited(Traffic([turn1, turn2]), QWEN, Rules())
    assert replay.hit_chunks == [0, 3]  # the state at turn 1's tail, and all attention before it


def test_a_session_ends_where_no_later_request_extends_it() -> None:
    requests = [
        TraceRequest(0, 2 * 512 + 5, 1, (0, 1, 2)),  # turn 2 repeats its full blocks: continues
        TraceRequest(1, 3 * 512 + 5, 1, (9, 9, 9, 9)),  # nothing later starts with 9, 9, 9
        TraceRequest(2, 3 * 512 + 1, 1, (0, 1, 7, 8)),  # extends request 0; nothing extends it
        TraceRequest(3, 100, 1, (0,)),  # no full block
    ]
    assert session_ends(requests, 512) == [False, True, True, True]
    assert Traffic(requests).continues == [True, False, False, False]
    assert session_ends(scaled(requests, 32), 32) == [False, True, True, True]


def test_policies_order_as_the_bounds_say() -> None:
    traffic = Traffic(conversations(150))
    rules = Rules()
    base = unlimited(traffic, QWEN, rules)
    assert base.outcome.served_tokens > 0
    uses = uses_of(traffic, base.hit_chunks)
    capacity = traffic.working_set(QWEN) // 20
    served = {}
    for name, replay in {
        "lru": Replay(traffic, QWEN, capacity, rules),
        "resume": Replay(traffic, QWEN, capacity, rules, ResumePointPolicy(), hints="pages"),
        "sessions": Replay(traffic, QWEN, capacity, rules, ResumePointPolicy(), hints="sessions"),
        "belady": Replay(traffic, QWEN, capacity, rules, NextUsePolicy(uses), admit=uses.__contains__),
    }.items():
        served[name] = replay.run().served_tokens
    assert served["lru"] < base.outcome.served_tokens  # the tier is full
    assert abs(served["resume"] - served["lru"]) <= 0.01 * base.outcome.served_tokens
    assert served["sessions"] > served["lru"]
    assert served["belady"] >= max(served.values())


def test_a_hit_in_the_lower_tier_is_promoted_into_the_upper_one() -> None:
    """A cpu tier too small for two chats above a disk tier that holds both: the chat whose
    pages the cpu tier lost is served from disk once, then (promoted) from cpu."""
    n = 2 * 512 + 9
    chats = [(10, 11, 12), (20, 21, 22), (10, 11, 13), (10, 11, 14)]
    traffic = Traffic([TraceRequest(t, n, 10, ids) for t, ids in enumerate(chats)])
    cpu = 2 * QWEN.chunk_bytes(512) + QWEN.state_bytes + 1  # one chat's pages
    served_by = {}
    for promote in (False, True):
        replay = Replay(traffic, QWEN, cpu, Rules(), lower=[(10 * cpu, None)], promote=promote)
        replay.run()
        assert replay.hit_chunks == [0, 0, 2, 2]
        served_by[promote] = replay.outcome.served_by
    assert served_by[False] == [0, 2048]  # both hits from disk
    assert served_by[True] == [1024, 1024]  # the second from cpu


def test_the_command_writes_rows_and_plots(tmp_path: Path) -> None:
    from hybrid_offload.tools.cli.main import main

    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(
        json.dumps({"timestamp": r.timestamp_ms, "input_length": r.input_length, "output_length": 1,
                    "hash_ids": list(r.hash_ids)}) + "\n"
        for r in conversations(60)
    ))  # fmt: skip
    out = tmp_path / "results"
    assert main(["bench", "trace", "--trace", str(trace), "--models", "qwen3_next_80b", "--sizes", "2,50",
                 "--policies", "lru,resume,resume-sessions,belady", "--out", str(out)]) == 0  # fmt: skip
    doc = json.loads((out / "trace.json").read_text())
    rows = {(r["policy"], r["size_pct"]): r["served_pct"] for r in doc["rows"]}
    assert set(rows) == {(p, s) for p in ("lru", "resume", "resume-sessions", "belady") for s in (2.0, 50.0)}
    plain, promoted = [h for h in doc["hierarchy"] if h["disk_pct"] == 2.0]  # a cpu tier of 1 % above it
    assert not plain["promote"] and promoted["promote"]
    for row in (plain, promoted):
        assert row["served_pct"] >= rows[("resume", 2.0)] and 0 < row["cpu_share_pct"] <= 100
    assert all(0 <= v <= 100 for v in rows.values()) and rows[("belady", 50.0)] == pytest.approx(100, abs=5)
    assert doc["geometries"]["qwen3_next_80b"]["state_bytes"] == QWEN.state_bytes  # bf16, as a GPU keeps it
    assert (out / "trace-qwen3_next_80b.png").stat().st_size > 0
    assert not math.isnan(doc["machine"]["load_average_1m"])
