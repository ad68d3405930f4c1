"""Load and store policies, scenario by scenario: which backend serves which pages, and why.

Two backends hold different parts of one prompt (chunk = block = 8 tokens, prompt 44 tokens,
so at most 5 chunks = 40 tokens can load); the scheduler's choice is read from its LoadJob.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from scheduler_world import (
    ATTN,
    MAMBA,
    FakeRequest,
    World,
    cpu_config,
    make_spec,
    new_req,
    prompt,
    start_load,
    step,
)

from hybrid_offload.connector.metadata import OffloadWorkerMetadata
from hybrid_offload.connector.scheduler.policy import (
    BackendMatch,
    LoadCostModel,
    RangedPolicy,
    WeightedPolicy,
    make_policy,
)
from hybrid_offload.core.planner import HybridOffloadPlanner

TOKENS = prompt(44)
TABLES = ([1, 2, 3, 4, 5, 6], [0, 0, 0, 0, 9, 0])


def segments(job) -> list[tuple[str, list[tuple[int, int]]]]:
    return [(s.backend, [(p.group, p.chunk_index) for p in s.pages]) for s in job.segments]


def hold_prefix(w: World, name: str, chunks: range, state_at: int | None) -> None:
    w.hold(name, w.chunk_keys(TOKENS, chunks, (ATTN,)))
    if state_at is not None:
        w.hold(name, w.chunk_keys(TOKENS, range(state_at, state_at + 1), (MAMBA,)))


def two_tier(worlds, policy: str, weights: tuple[float, float] = (1.0, 0.3)) -> World:
    """cpu holds a 16-token prefix, disk (a second cpu-type tier) a 40-token one."""
    w = worlds(make_spec(8, 8), 8, (cpu_config("cpu", weights[0]), cpu_config("disk", weights[1])), policy)
    hold_prefix(w, "cpu", range(2), 1)
    hold_prefix(w, "disk", range(5), 4)
    return w


def test_weighted_prefers_the_higher_score_even_if_shorter(worlds) -> None:
    w = two_tier(worlds, "weighted")  # cpu 16 x 1.0 = 16 > disk 40 x 0.3 = 12
    job = start_load(w, FakeRequest("r", TOKENS), 0, TABLES)
    assert segments(job) == [("cpu", [(ATTN, 0), (ATTN, 1), (MAMBA, 1)])]
    assert job.fallbacks == ("cpu", "disk")


def test_ranged_loads_the_longest_prefix_with_early_chunks_from_the_heavier_tier(worlds) -> None:
    w = two_tier(worlds, "ranged")
    req = FakeRequest("r", TOKENS)
    assert w.sched.get_num_new_matched_tokens(req, 0) == (40, True)
    w.sched.update_state_after_alloc(req, TABLES, 40)
    assert w.sched.hit_sources("r") == {"host": 40}  # both tiers are cpu-type here
    job = w.sched.build_connector_meta(step()).loads[0]
    assert segments(job) == [
        ("cpu", [(ATTN, 0), (ATTN, 1)]),
        ("disk", [(ATTN, 2), (ATTN, 3), (ATTN, 4), (MAMBA, 4)]),
    ]
    counters = w.sched.stats.snapshot()["backends"]
    assert (counters["cpu"]["loaded_tokens"], counters["disk"]["loaded_tokens"]) == (16, 24)


def test_ranged_combines_tiers_that_hold_nothing_loadable_alone(worlds) -> None:
    w = worlds(make_spec(8, 8), 8, (cpu_config("a"), cpu_config("b")), "ranged")
    hold_prefix(w, "a", range(3), None)  # attention 0-2, no state
    w.hold("b", w.chunk_keys(TOKENS, range(3, 5), (ATTN,)) + w.chunk_keys(TOKENS, range(4, 5), (MAMBA,)))
    assert w.sched.get_num_new_matched_tokens(FakeRequest("weighted-would-miss", TOKENS), 0) == (40, True)
    weighted = worlds(make_spec(8, 8), 8, (cpu_config("a"), cpu_config("b")))
    hold_prefix(weighted, "a", range(3), None)
    assert weighted.sched.get_num_new_matched_tokens(FakeRequest("r", TOKENS), 0) == (0, False)


def test_ranged_with_a_local_hit_starts_after_it(worlds) -> None:
    w = two_tier(worlds, "ranged")
    job = start_load(w, FakeRequest("r", TOKENS), 16, TABLES)
    assert segments(job) == [("disk", [(ATTN, 2), (ATTN, 3), (ATTN, 4), (MAMBA, 4)])]


def lookups(w: World) -> dict[str, int]:
    return {name: c["lookups"] for name, c in w.sched.stats.snapshot()["backends"].items() if c["lookups"]}


@pytest.mark.parametrize(
    ("policy", "weights", "first_holds", "asked"),
    [
        ("weighted", (1.0, 1.0), range(5), {"a": 1}),  # a holds everything: b cannot win a tie
        ("weighted", (1.0, 0.3), range(5), {"a": 1}),
        ("weighted", (1.0, 2.0), range(5), {"a": 1, "b": 1}),  # b could score more
        ("weighted", (1.0, 1.0), range(4), {"a": 1, "b": 1}),  # a holds less than the prompt allows
        ("ranged", (1.0, 0.3), range(5), {"a": 1, "b": 1}),  # ranged reads every tier's presence
        ("adaptive", (1.0, 1.0), range(5), {"a": 1, "b": 1}),  # b not measured yet: it may be probed
    ],
)
def test_a_lookup_stops_asking_once_no_later_tier_can_change_the_choice(
    worlds, policy: str, weights: tuple[float, float], first_holds: range, asked: dict[str, int]
) -> None:
    w = worlds(make_spec(8, 8), 8, (cpu_config("a", weights[0]), cpu_config("b", weights[1])), policy)
    hold_prefix(w, "a", first_holds, first_holds[-1])
    hold_prefix(w, "b", range(5), 4)
    job = start_load(w, FakeRequest("r", TOKENS), 0, TABLES)
    assert lookups(w) == asked
    alone = worlds(make_spec(8, 8), 8, (cpu_config("a", weights[0]), cpu_config("b", weights[1])), policy)
    alone.sched.policy.settled = lambda *_: False  # type: ignore[method-assign]  # ask every tier
    hold_prefix(alone, "a", first_holds, first_holds[-1])
    hold_prefix(alone, "b", range(5), 4)
    assert segments(start_load(alone, FakeRequest("r", TOKENS), 0, TABLES)) == segments(job)


def test_settled_weighted_and_adaptive() -> None:
    planner = HybridOffloadPlanner(make_spec(8, 8), 8)
    full = BackendMatch("a", 1.0, 40, ())
    weighted = WeightedPolicy(planner)
    assert weighted.settled([full], [("b", 1.0)], 40)
    assert not weighted.settled([full], [("b", 1.5)], 40)
    assert not weighted.settled([BackendMatch("a", 1.0, 32, ())], [("b", 0.1)], 40)
    assert weighted.settled([BackendMatch("a", 0.5, 32, ()), full], [("c", 1.0)], 40)
    assert not RangedPolicy(planner).settled([full], [("b", 0.1)], 40)
    adaptive = make_policy("adaptive", planner)
    assert not adaptive.settled([full], [("b", 0.1)], 40)  # b never measured
    adaptive.observe("b", 1 << 20, 0.01, True)
    adaptive.observe("a", 1 << 20, 0.01, True)
    assert adaptive.settled([full], [("b", 1.0)], 40)


def test_adaptive_moves_traffic_away_from_a_slow_tier_and_probes_it_later(worlds) -> None:
    now = [0.0]
    w = worlds(make_spec(8, 8), 8, (cpu_config("slow", 1.0), cpu_config("fast", 0.8)), "adaptive")
    w.sched.policy.costs.clock = lambda: now[0]
    for name in ("slow", "fast"):
        hold_prefix(w, name, range(5), 4)

    def chosen(req_id: str) -> str:
        return start_load(w, FakeRequest(req_id, TOKENS), 0, TABLES).segments[0].backend

    def report(name: str, seconds: float) -> None:
        samples = {name: [(1 << 20, seconds, True)]}
        w.sched.update_connector_output(OffloadWorkerMetadata(load_samples=samples), None, None)

    assert chosen("r1") == "slow"  # nothing measured yet: configured weights
    report("slow", 0.5)
    assert chosen("r2") == "fast"  # not measured yet: probed
    report("fast", 0.005)
    assert chosen("r2b") == "fast"  # 100x faster: 0.8 > 1.0 x 0.01
    now[0] += 31.0  # measurements older than forget_s: trusted again, probed
    assert chosen("r3") == "slow"


def test_adaptive_forget_s_is_the_measurements_lifetime(worlds) -> None:
    now = [0.0]
    w = worlds(make_spec(8, 8), 8, (cpu_config("slow", 1.0), cpu_config("fast", 0.8)), "adaptive")
    w.sched.policy = make_policy("adaptive", w.planner, adaptive_forget_s=600.0)
    w.sched.policy.costs.clock = lambda: now[0]
    for name in ("slow", "fast"):
        hold_prefix(w, name, range(5), 4)
    for name, seconds in (("slow", 0.5), ("fast", 0.005)):
        samples = {name: [(1 << 20, seconds, True)]}
        w.sched.update_connector_output(OffloadWorkerMetadata(load_samples=samples), None, None)
    now[0] += 599.0
    assert start_load(w, FakeRequest("r", TOKENS), 0, TABLES).segments[0].backend == "fast"
    now[0] += 2.0
    assert start_load(w, FakeRequest("r2", TOKENS), 0, TABLES).segments[0].backend == "slow"


def test_adaptive_failures_count_as_zero_speed() -> None:
    costs = LoadCostModel(alpha=0.5, clock=lambda: 0.0)
    costs.observe("a", 1000, 0.001, True)
    costs.observe("b", 1000, 0.001, True)
    costs.observe("b", 0, 0.2, False)
    assert costs.relative_speed("a") == 1.0
    assert costs.relative_speed("b") == pytest.approx(0.5)
    assert costs.relative_speed("never-measured") == 1.0


def test_policies_need_more_than_the_local_hit(worlds) -> None:
    w = worlds(make_spec(8, 8), 8)
    planner = w.planner
    full = tuple(tuple([True] * 5) for _ in range(2))
    match = BackendMatch("a", 1.0, 16, full)
    assert WeightedPolicy(planner).choose([match], 16, 44) is None
    absent = replace(match, presence=tuple(tuple([False] * 5) for _ in range(2)))
    assert RangedPolicy(planner).choose([absent], 0, 44) is None


# ---- store policies ------------------------------------------------------------------------
def stores_by_backend(w: World, req_id: str, tokens: list[int], computed: int, scheduled: int) -> dict:
    meta = w.sched.build_connector_meta(
        step(
            new=[new_req(req_id, ([1, 2, 3, 4, 5, 6], [0, 7, 0, 8, 0, 9]), computed)],
            scheduled={req_id: scheduled},
        )
    )
    out: dict[str, int] = {}
    for job in meta.stores:
        for name in job.backends:
            out[name] = out.get(name, 0) + 1
    return out


def test_store_threshold_and_read_only(worlds) -> None:
    backends = (
        cpu_config("always"),
        cpu_config("second-sight", store_threshold=2),
        cpu_config("ro", read_only=True),
    )
    w = worlds(make_spec(8, 8), 8, backends, pending_wait_s=0)
    tokens = prompt(20)  # 2 chunks: 2 attention pages + the state at 16
    for i, expected in enumerate(({"always": 3}, {"always": 3, "second-sight": 3})):
        req = FakeRequest(f"r{i}", tokens)
        assert w.sched.get_num_new_matched_tokens(req, 0) == (0, False)
        assert stores_by_backend(w, f"r{i}", tokens, 0, 16) == expected
        w.sched.request_finished(req)


def test_output_chunks_are_stored_only_where_store_output(worlds) -> None:
    w = worlds(make_spec(8, 8), 8, (cpu_config("prompt", store_output=False), cpu_config("all")))
    req = FakeRequest("r", prompt(12))
    w.sched.get_num_new_matched_tokens(req, 0)
    assert stores_by_backend(w, "r", req.prompt_token_ids, 0, 12) == {"prompt": 1, "all": 1}  # chunk 0
    req.output_token_ids.extend([5, 6, 7, 8])  # tokens 12..15 known; 13..15 not computed yet
    meta = w.sched.build_connector_meta(step(cached=[("r", None, 12)], scheduled={"r": 1}))
    assert meta.stores == []
    meta = w.sched.build_connector_meta(step(cached=[("r", None, 15)], scheduled={"r": 1}))
    stored = [(j.page.group, j.page.chunk_index, j.backends, j.hold) for j in meta.stores]
    # 16 tokens: chunk 1, and its state held until the request ends
    assert stored == [(ATTN, 1, ("all",), False), (MAMBA, 1, (), True)]
    hashes = w.planner.chunk_hashes(req.all_token_ids)
    assert meta.stores[0].page.chunk_hash == hashes[1]
    w.sched.request_finished(req)
    meta = w.sched.build_connector_meta(step())
    assert [(c.page.group, c.page.chunk_index, c.backends) for c in meta.commits] == [(MAMBA, 1, ("all",))]


def test_preempted_request_resumes_from_offloaded_prompt_and_output(worlds) -> None:
    w = worlds(make_spec(8, 8), 8)
    req = FakeRequest("r", prompt(12))
    keys = w.keys(req.prompt_token_ids + list(range(50, 62)))
    w.hold("cpu", [keys[ATTN][c] for c in range(2)] + [keys[MAMBA][1]])
    assert w.sched.get_num_new_matched_tokens(req, 0) == (0, False)  # no state at 8 tokens
    req.output_token_ids.extend(range(50, 62))  # decoded 12 tokens (their pages stored), then:
    w.sched.build_connector_meta(step(preempted={"r"}))
    assert w.sched.get_num_new_matched_tokens(req, 0) == (16, True)  # beyond the 12-token prompt


def test_reset_cache_stops_matching_pages_stored_before(worlds) -> None:
    """After vLLM resets external caches (e.g. a weight update), old pages never load again."""
    w = worlds(make_spec(8, 8), 8)
    hold_prefix(w, "cpu", range(5), 4)
    assert w.sched.get_num_new_matched_tokens(FakeRequest("before", TOKENS), 0) == (40, True)
    w.sched.reset_cache()
    assert w.sched.get_num_new_matched_tokens(FakeRequest("after", TOKENS), 0) == (0, False)
