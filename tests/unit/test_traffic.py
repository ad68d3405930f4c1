"""Seeded traffic and the reusable-prefix definition the coverage numbers are measured against."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from hybrid_offload.tools.bench.traffic import (
    SIZES,
    WORKLOADS,
    PrefixIndex,
    Request,
    WorkloadSpec,
    make_workload,
    reusable_tokens,
    run_workload,
)
from hybrid_offload.tools.bench.workloads_report import coverage, identical


def replay(spec: WorkloadSpec, reply: int = 7) -> list[list[Request]]:
    waves: list[list[Request]] = []

    def serve(wave: list[Request]) -> list[list[int]]:
        waves.append(wave)
        return [[reply + i] * r.max_tokens for i, r in enumerate(wave)]

    run_workload(spec, serve)
    return waves


@pytest.mark.parametrize("name", [w for w in WORKLOADS if w != "trace"])  # trace: its own test
def test_workloads_are_seeded_and_unaligned(name: str) -> None:
    spec = WorkloadSpec(name, seed=3, size=SIZES["small"][name])
    a, b = replay(spec), replay(spec)
    assert a == b and a != replay(WorkloadSpec(name, seed=4, size=SIZES["small"][name]))
    lengths = {len(r.prompt) for wave in a for r in wave}
    assert any(n % 128 for n in lengths) and len(lengths) > 1


def test_a_trace_replays_in_order_one_request_a_wave(tmp_path: Path) -> None:
    """Equal hash ids give equal tokens (fixed per id in every process), lengths scaled."""
    rows = [{"timestamp": 0, "input_length": 1100, "output_length": 3, "hash_ids": [0, 1, 2]},
            {"timestamp": 5, "input_length": 1600, "output_length": 3, "hash_ids": [0, 1, 3, 4]}]  # fmt: skip
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    waves = replay(WorkloadSpec("trace", size={"path": str(path), "requests": 2, "block": 16, "reply": 2}))
    assert [len(w) for w in waves] == [1, 1]
    first, second = waves[0][0].prompt, waves[1][0].prompt
    assert (len(first), len(second)) == (round(1100 * 16 / 512), 1600 * 16 // 512)
    assert first[:32] == second[:32] and first[32:34] != second[32:34]  # ids 0, 1 shared; 2 vs 3


def test_chat_turns_carry_the_replies() -> None:
    waves = replay(WorkloadSpec("chat", size={"conversations": 2, "turns": 3, "first": (10, 20),
                                              "message": (5, 9), "reply": 4}))
    assert [len(w) for w in waves] == [2, 2, 2]
    for earlier, later in itertools.pairwise(waves):
        for i, (before, after) in enumerate(zip(earlier, later, strict=True)):
            reply = [7 + i] * 4
            assert after.prompt[: len(before.prompt) + 4] == before.prompt + tuple(reply)


def test_reusable_is_the_shared_prefix_floored_and_below_the_length() -> None:
    chunk = 4
    a = list(range(100, 130))  # 30 tokens
    waves = [
        [(a, [1, 2, 3])],
        [(a[:13] + [9] * 10, [])],  # shares 13 -> 12
        [([*a, 1, 2, 3, 4, 5], [])],  # shares a + its output (33) -> 32
        [(a[:8], [])],  # shares all 8, but 1 token must be computed -> 4
        [(list(range(500, 520)), [])],
    ]
    assert reusable_tokens(waves, chunk) == [[0], [12], [32], [4], [0]]
    # a restart: everything the engine before it ran counts as earlier traffic
    assert reusable_tokens([[(a, [])]], chunk, earlier=[a]) == [[28]]
    # requests of one wave do not count for each other
    assert reusable_tokens([[(a, []), (a, [])]], chunk) == [[0, 0]]
    index = PrefixIndex(chunk)
    index.add(a)
    assert index.reusable([]) == 0 and index.reusable(a[:5]) == 4


def test_coverage_and_identity_of_runs() -> None:
    row = {"label": "x", "ttft_s": 0.1, "report": {"lost_tokens": {"no_state": 8}}}
    a = list(range(100, 140))
    run = [[{**row, "prompt": a, "output": [1], "cached": 0}],
           [{**row, "prompt": a + [5] * 9, "output": [2], "cached": 24}]]
    cov = coverage(run, 8)
    assert (cov["reusable"], cov["served"], cov["ratio"]) == (40, 24, 0.6)
    assert cov["lost_reported"] == {"no_state": 16}
    assert identical(run, run) and not identical(run, [run[0], [{**run[1][0], "output": [3]}]])


def test_unknown_workload_is_named() -> None:
    with pytest.raises(ValueError, match="unknown workload 'chats'"):
        make_workload(WorkloadSpec("chats"))
