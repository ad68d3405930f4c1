"""OffloadScheduler scenarios with fake vLLM requests/scheduler outputs and real backends.

The fakes follow vLLM 0.32 (hybrid align mode): ``block_ids[group]`` is a request's block
table per KV cache group, the Mamba state after N tokens lives at block index (N - 1) // bs of
the Mamba table (the block covering token N - 1, also inside a block), id 0 is the null block,
and async loads go get_num_new_matched_tokens -> update_state_after_alloc ->
build_connector_meta (LoadJob) -> update_connector_output. Prefill steps end where the
connector's ``prefill_stop`` says (vLLM's split, patched by ``engine/patches/prefill_stops``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from scheduler_world import (
    ATTN,
    MAMBA,
    FakeRequest,
    World,
    cpu_config,
    flaky_disk,
    make_spec,
    new_req,
    prompt,
    start_load,
    step,
    tier,
)

from hybrid_offload.backends import BackendConfig
from hybrid_offload.connector.config import Tier
from hybrid_offload.connector.metadata import (
    ClearRange,
    CommitJob,
    LoadJob,
    LoadSegment,
    OffloadMetadata,
    OffloadWorkerMetadata,
    PageJob,
    StoreJob,
    TouchJob,
)
from hybrid_offload.core.layer_parts import LayerGrid
from hybrid_offload.core.planner import whole_model_layers
from hybrid_offload.core.spec import make_model_spec


# ---- builders -----------------------------------------------------------------------------
def disk_config(tmp_path: Path, name: str = "disk", weight: float = 1.0) -> Tier:
    disk = BackendConfig("disk", name, 1 << 30, options={"path": str(tmp_path / name)})
    return tier(disk, load_weight=weight)


def bare(jobs: list[Any]) -> list[Any]:
    """Store or commit jobs without their retention hints (checked where a test is about them)."""
    return [dataclasses.replace(j, retention=None) for j in jobs]


def store_summary(meta: OffloadMetadata) -> list[tuple[int, int, tuple[int, ...], int]]:
    """(group, chunk, block_ids, first_token) of every StoreJob (not holds), in emitted order."""
    return [
        (s.page.group, s.page.chunk_index, s.page.block_ids, s.page.first_token)
        for s in meta.stores if not s.hold
    ]


def hold_summary(meta: OffloadMetadata) -> list[tuple[int, int, tuple[int, ...], int]]:
    """(group, chunk, block_ids, first_token) of every held copy, in emitted order."""
    return [
        (s.page.group, s.page.chunk_index, s.page.block_ids, s.page.first_token)
        for s in meta.stores if s.hold
    ]


def commit_summary(meta: OffloadMetadata) -> list[tuple[str, int, int]]:
    """(request, group, chunk) of every commit, in emitted order."""
    return [(c.req_id, c.page.group, c.page.chunk_index) for c in meta.commits]


def run_prefill(
    w: World, req: FakeRequest, tables: tuple[list[int], ...], budget: int
) -> list[OffloadMetadata]:
    """Schedule ``req``'s whole prompt in steps of at most ``budget`` tokens, shortened to the
    connector's checkpoints as vLLM's patched split does; the metadata of every step."""
    metas, computed, n = [], 0, len(req.prompt_token_ids)
    while computed < n:
        end = w.sched.prefill_stop(req.request_id, computed, min(n, computed + budget))
        if computed == 0:
            meta = w.sched.build_connector_meta(step(new=[new_req(req.request_id, tables, 0)],
                                                     scheduled={req.request_id: end}))
        else:
            meta = w.sched.build_connector_meta(step(cached=[(req.request_id, None, computed)],
                                                     scheduled={req.request_id: end - computed}))
        metas.append(meta)
        computed = end
    return metas


def attn_page(
    w: World, tokens: list[int], c: int, blocks: tuple[int, ...], first: int = 0, skip: int = 0
) -> PageJob:
    hashes = w.planner.chunk_hashes(tokens)
    return PageJob(w.planner.page_key(hashes[c], ATTN), ATTN, c, hashes[c], blocks, first, skip)


def mamba_page(w: World, tokens: list[int], c: int, blocks: tuple[int, ...]) -> PageJob:
    hashes = w.planner.chunk_hashes(tokens)
    return PageJob(w.planner.page_key(hashes[c], MAMBA), MAMBA, c, hashes[c], blocks)



# ---- store planning -------------------------------------------------------------------------
def test_stores_follow_chunk_completion_and_checkpoints(worlds) -> None:
    """Prompt of 3.5 chunks (28 tokens, chunk = block = 8): the prefill stops at the tail
    checkpoint 24 (its state is stored), then the rest; decoding holds states and output
    chunks, and the request's end commits the last ones."""
    w = worlds(make_spec(8, 8), 8)
    tokens = prompt(28)
    req = FakeRequest("r1", tokens)
    assert w.sched.get_num_new_matched_tokens(req, 0) == (0, False)
    w.sched.update_state_after_alloc(req, ([10], [20]), 0)
    assert w.sched.prefill_stop("r1", 0, 28) == 24
    assert w.sched.prefill_stop("r1", 24, 28) == 28
    assert w.sched.prefill_stop("r1", 0, 16) == 16

    tables = ([10, 11, 12, 13], [0, 0, 22, 23])
    meta = w.sched.build_connector_meta(step(new=[new_req("r1", tables, 0)], scheduled={"r1": 24}))
    assert not meta.loads and not meta.idle
    assert w.sched.build_connector_meta(step()).idle  # nothing scheduled: the worker may wait
    assert bare(meta.stores) == [
        StoreJob(attn_page(w, tokens, 0, (10,)), ("cpu",), "r1"),
        StoreJob(attn_page(w, tokens, 1, (11,)), ("cpu",), "r1"),
        StoreJob(attn_page(w, tokens, 2, (12,)), ("cpu",), "r1"),
        StoreJob(mamba_page(w, tokens, 2, (22,)), ("cpu",), "r1"),  # state at 24: index 2
    ]
    # what the tiers are told: a chain of chunks, the state needing its chunk's attention
    hints = [j.retention for j in meta.stores]
    units = ["a" + j.page.key for j in meta.stores[:3]]
    assert [h.unit for h in hints[:3]] == units and [h.parent for h in hints[:3]] == ["", *units[:2]]
    assert hints[3].state and hints[3].parent == units[2] and hints[3].unit == "s" + meta.stores[3].page.key
    assert all(h.weight == 1.0 and h.request_bytes > 0 for h in hints)
    # 24 -> 28: no chunk completes, 28 is not a chunk boundary
    meta = w.sched.build_connector_meta(step(cached=[("r1", None, 24)], scheduled={"r1": 4}))
    assert meta.stores == []

    # decoding: the step ending on 32 completes chunk 3 and holds the state there; its last
    # input token is known (sync scheduling), so the chunk is stored and the state held
    req.output_token_ids = [1, 2, 3, 4]
    for computed in (28, 29, 30):
        meta = w.sched.build_connector_meta(step(cached=[("r1", None, computed)], scheduled={"r1": 1}))
        assert meta.stores == []
    meta = w.sched.build_connector_meta(step(cached=[("r1", None, 31)], scheduled={"r1": 1}))
    out = tokens + req.output_token_ids
    assert bare(meta.stores) == [
        StoreJob(attn_page(w, out, 3, (13,)), ("cpu",), "r1"),
        StoreJob(PageJob("", MAMBA, 3, b"", (23,)), (), "r1", hold=True),
    ]
    # the end commits the held state under its key, and releases the request's copies
    assert w.sched.request_finished(req) == (False, {"hybrid_offload": {
        "local_tokens": 0, "served_tokens": 0, "reusable_tokens": 0, "lost_tokens": {}}})
    meta = w.sched.build_connector_meta(step())
    assert bare(meta.commits) == [CommitJob("r1", mamba_page(w, out, 3, (23,)), ("cpu",))]
    committed = meta.commits[0].retention
    assert committed.state and committed.parent == "a" + attn_page(w, out, 3, (13,)).key
    assert meta.releases == ["r1"]


@pytest.mark.parametrize(("session", "weight"), [("ends", 0.0), ("continues", 1.0), ("maybe", 1.0), (7, 1.0)])
def test_the_applications_session_hint_weighs_the_pages_it_stores(worlds, session: Any, weight: float,
                                                                  caplog: Any) -> None:  # fmt: skip
    """``kv_transfer_params["hybrid_offload"]["session"]``: a session that ends releases its
    pages first in the tiers; a value not understood is ignored with a warning, never fails."""
    w = worlds(make_spec(8, 8), 8)
    req = FakeRequest("r1", prompt(28), kv_transfer_params={"hybrid_offload": {"session": session}})
    assert w.sched.get_num_new_matched_tokens(req, 0) == (0, False)
    w.sched.update_state_after_alloc(req, ([10], [20]), 0)
    tables = ([10, 11, 12, 13], [0, 0, 22, 23])
    meta = w.sched.build_connector_meta(step(new=[new_req("r1", tables, 0)], scheduled={"r1": 24}))
    assert len(meta.stores) == 4 and {j.retention.weight for j in meta.stores} == {weight}
    assert ("ignored" in caplog.text) == (session in ("maybe", 7))


def test_async_scheduling_holds_output_chunks_until_their_tokens_are_known(worlds) -> None:
    """Under async scheduling a step's last input token is sampled after it is planned: the
    completed chunk is copied and held, and committed once the token is known."""
    w = worlds(make_spec(8, 8), 8)
    tokens = prompt(20)
    req = FakeRequest("r1", tokens)
    w.sched.get_num_new_matched_tokens(req, 0)
    tables = ([10, 11, 12], [0, 21, 22])
    run_prefill(w, req, tables, 64)
    req.output_token_ids = [1, 2, 3]  # position 23's token (the 4th output) is not sampled yet
    meta = w.sched.build_connector_meta(step(cached=[("r1", None, 23)], scheduled={"r1": 1}))
    assert hold_summary(meta) == [(ATTN, 2, (12,), 0), (MAMBA, 2, (22,), 0)]
    assert store_summary(meta) == []
    req.output_token_ids = [1, 2, 3, 4]
    meta = w.sched.build_connector_meta(step(cached=[("r1", None, 24)], scheduled={"r1": 1}))
    assert commit_summary(meta) == [("r1", ATTN, 2)]
    assert meta.commits[0].page == attn_page(w, tokens + req.output_token_ids, 2, (12,))
    w.sched.request_finished(req)
    assert commit_summary(w.sched.build_connector_meta(step())) == [("r1", MAMBA, 2)]


def test_preemption_commits_what_the_worker_holds(worlds) -> None:
    w = worlds(make_spec(8, 8), 8)
    req = FakeRequest("r1", prompt(12), output_token_ids=[5, 6, 7, 8])
    w.sched.get_num_new_matched_tokens(req, 0)
    run_prefill(w, req, ([10, 11], [20, 21]), 64)
    meta = w.sched.build_connector_meta(step(cached=[("r1", None, 15)], scheduled={"r1": 1}))
    assert hold_summary(meta) == [(MAMBA, 1, (21,), 0)]
    meta = w.sched.build_connector_meta(step(preempted={"r1"}))
    assert commit_summary(meta) == [("r1", MAMBA, 1)] and meta.releases == ["r1"]
    assert meta.preempted == ["r1"]


def test_a_request_that_stored_touches_its_chain_deepest_first(worlds, tmp_path: Path) -> None:
    """At its end a request that stored pages refreshes its chain (every attention chunk, found
    or stored, and the states it stored or loaded), deepest chunk first and per chunk the state
    before the attention, in the writable backends whose LRU refreshes; a request that stored
    nothing touches nothing."""
    ro = tier(BackendConfig("disk", "ro", 1 << 30, options={"path": str(tmp_path / "ro")}), read_only=True)
    w = worlds(make_spec(8, 8), 8, backends=(cpu_config(), disk_config(tmp_path), ro))
    tokens = prompt(24)
    req = FakeRequest("r1", tokens)
    w.sched.get_num_new_matched_tokens(req, 0)
    for meta in run_prefill(w, req, ([10, 11, 12], [20, 21, 22]), 64):
        w.complete(meta)
    w.sched.request_finished(req)
    meta = w.sched.build_connector_meta(step())
    keys = w.keys(tokens)
    # states where it stored them: its tail checkpoint (16) and its last decoding state (24)
    chain = tuple((keys[g][c], g) for c in (2, 1, 0) for g in ((MAMBA, ATTN) if c else (ATTN,)))
    assert meta.touches == [TouchJob(chain, ("cpu", "disk"))]
    w.complete(meta)

    # the next turn extends the prompt: it loads 24 tokens (the state r1 held at 24), stores the
    # rest, and touches its chain with the state it loaded but not r1's state at 16
    longer = prompt(40)
    r2 = FakeRequest("r2", longer)
    tables = ([30, 31, 32, 33, 34], [0, 0, 42, 43, 44])
    assert start_load(w, r2, 0, tables).req_id == "r2"
    w.sched.update_connector_output(None, {"r2"}, None)
    assert w.sched.prefill_stop("r2", 24, 40) == 32
    w.complete(w.sched.build_connector_meta(step(new=[new_req("r2", tables, 24)], scheduled={"r2": 8})))
    w.complete(w.sched.build_connector_meta(step(cached=[("r2", None, 32)], scheduled={"r2": 8})))
    w.sched.request_finished(r2)
    keys = w.keys(longer)
    states = {4, 3, 2}  # held at 40 and committed; its tail checkpoint 32; loaded at 24
    groups = {c: (MAMBA, ATTN) if c in states else (ATTN,) for c in range(5)}
    chain = tuple((keys[g][c], g) for c in (4, 3, 2, 1, 0) for g in groups[c])
    assert w.sched.build_connector_meta(step()).touches == [TouchJob(chain, ("cpu", "disk"))]

    # a request that stored nothing (its chunks are below the store threshold) touches nothing
    w = worlds(make_spec(8, 8), 8, backends=(tier(BackendConfig("cpu", "cpu", 1 << 30), store_threshold=2),))
    req = FakeRequest("r2", tokens)
    w.sched.get_num_new_matched_tokens(req, 0)
    assert all(store_summary(m) == [] for m in run_prefill(w, req, ([10, 11, 12], [20, 21, 22]), 64))
    w.sched.request_finished(req)
    meta = w.sched.build_connector_meta(step())
    assert meta.releases == ["r2"] and meta.touches == []


def test_coverage_tells_chunks_never_stored_from_evicted_ones(worlds) -> None:
    """Two requests saw a prompt that is below the store threshold (3): the third finds nothing
    stored, and its lost tokens are ``not_stored``; once stored and gone, ``evicted``."""
    w = worlds(make_spec(8, 8), 8, backends=(tier(BackendConfig("cpu", "cpu", 1 << 30), store_threshold=3),))
    tokens = prompt(24)

    def run(req_id: str) -> dict[str, Any]:
        req = FakeRequest(req_id, tokens)
        assert w.sched.get_num_new_matched_tokens(req, 0) == (0, False)
        for meta in run_prefill(w, req, ([10, 11, 12], [20, 21, 22]), 64):
            w.complete(meta)
        report = w.sched.request_finished(req)[1]
        w.complete(w.sched.build_connector_meta(step()))
        assert report is not None
        return report["hybrid_offload"]

    assert run("r1")["lost_tokens"] == {}
    assert run("r2")["lost_tokens"] == {"not_stored": 16}  # r1 saw it, nothing stored
    assert run("r3")["lost_tokens"] == {"not_stored": 16}  # r3 is the third: it stores
    w.sched.update_connector_output(  # everything r3 stored is evicted
        OffloadWorkerMetadata(evicted={"cpu": w.pieces(w.chunk_keys(tokens, range(3)))}), None, None
    )
    assert run("r4")["lost_tokens"] == {"evicted": 16}


def test_checkpoint_interval_and_junction_stops(worlds) -> None:
    w = worlds(make_spec(8, 8), 8, checkpoint_interval=16)
    tokens = prompt(60)
    w.sched.get_num_new_matched_tokens(FakeRequest("r1", tokens), 0)
    stops, start = [], 0
    while start < 60:
        start = w.sched.prefill_stop("r1", start, 60)
        stops.append(start)
    assert stops == [56, 60]  # the tail (59 // 8 * 8), the prompt end: states every 16 cost no stop
    stops, start = [], 0
    while start < 60:  # vLLM ends steps every 20 tokens: one that ends mid-chunk past a due state
        start = w.sched.prefill_stop("r1", start, min(60, start + 20))  # ends on the chunk before
        stops.append(start)
    assert stops == [16, 32, 48, 56, 60]
    assert w.sched.prefill_stop("r1", 0, 40, align=16) == 32  # vLLM ends its steps on 16s: so do we
    # a sibling sharing 40 tokens: attention pages reach 40, no state there -> junction at 40
    w.hold("cpu", w.chunk_keys(tokens, range(5), (ATTN,)))
    sibling = FakeRequest("r2", tokens[:40] + prompt(30, offset=500))
    assert w.sched.get_num_new_matched_tokens(sibling, 0) == (0, False)
    assert w.sched.prefill_stop("r2", 32, 70) == 40
    assert w.sched.prefill_stop("r2", 0, 70) == 40  # no stop for the interval before it


def test_a_lookup_waits_for_stores_of_its_prefix(worlds) -> None:
    w = worlds(make_spec(8, 8), 8, pending_wait_s=2.0)
    tokens = prompt(28)
    first = FakeRequest("r1", tokens)
    w.sched.get_num_new_matched_tokens(first, 0)
    metas = run_prefill(w, first, ([10, 11, 12, 13], [0, 0, 22, 23]), 64)
    again = FakeRequest("r2", tokens)
    assert w.sched.get_num_new_matched_tokens(again, 0) == (None, False)  # stores in flight
    w.clock[0] = 1.0
    assert w.sched.get_num_new_matched_tokens(again, 0) == (None, False)
    for meta in metas:
        w.complete(meta)
    assert w.sched.get_num_new_matched_tokens(again, 0) == (24, True)
    # stores never reported: the lookup goes on after the wait
    other = FakeRequest("r3", prompt(28, offset=100))
    w.sched.get_num_new_matched_tokens(other, 0)
    run_prefill(w, other, ([1, 2, 3, 4], [0, 0, 7, 8]), 64)
    late = FakeRequest("r4", prompt(28, offset=100))
    assert w.sched.get_num_new_matched_tokens(late, 0) == (None, False)
    w.clock[0] = 3.5
    assert w.sched.get_num_new_matched_tokens(late, 0) == (0, False)


def test_mamba_state_stored_only_at_checkpoints(worlds) -> None:
    """Steps vLLM ends elsewhere (its token budget) store no state; checkpoints do."""
    w = worlds(make_spec(8, 8), 8, checkpoint_interval=16)
    tokens = prompt(28)
    req = FakeRequest("r1", tokens)
    w.sched.get_num_new_matched_tokens(req, 0)
    summaries = [
        store_summary(
            w.sched.build_connector_meta(step(new=[new_req("r1", ([10], [20]), 0)], scheduled={"r1": 8}))
        ),
        store_summary(
            w.sched.build_connector_meta(step(cached=[("r1", ([11], [21]), 8)], scheduled={"r1": 8}))
        ),
        store_summary(
            w.sched.build_connector_meta(step(cached=[("r1", ([12, 13], [22, 23]), 16)], scheduled={"r1": 8}))
        ),
    ]
    assert summaries == [
        [(ATTN, 0, (10,), 0)],  # 8: vLLM's stop, not a checkpoint
        [(ATTN, 1, (11,), 0), (MAMBA, 1, (21,), 0)],  # 16: the interval
        [(ATTN, 2, (12,), 0), (MAMBA, 2, (22,), 0)],  # 24: the tail
    ]


def test_prompt_ending_on_a_boundary_holds_its_last_state(worlds) -> None:
    """The state at the prompt's end is not a checkpoint (a repeat resumes one chunk earlier)
    but the start of the reply: it is held like a decoding state."""
    w = worlds(make_spec(8, 8), 8)
    tokens = prompt(32)
    req = FakeRequest("r1", tokens)
    w.sched.get_num_new_matched_tokens(req, 0)
    tables = ([10, 11, 12, 13], [0, 0, 22, 23])  # align mode: earlier Mamba blocks may be null
    metas = run_prefill(w, req, tables, 64)
    assert [store_summary(m) for m in metas] == [
        [(ATTN, 0, (10,), 0), (ATTN, 1, (11,), 0), (ATTN, 2, (12,), 0), (MAMBA, 2, (22,), 0)],
        [(ATTN, 3, (13,), 0)],
    ]
    assert hold_summary(metas[1]) == [(MAMBA, 3, (23,), 0)]


def test_mamba_state_in_a_null_block_is_not_stored(worlds) -> None:
    w = worlds(make_spec(8, 8), 8)
    w.sched.get_num_new_matched_tokens(FakeRequest("r1", prompt(20)), 0)
    meta = w.sched.build_connector_meta(
        step(new=[new_req("r1", ([10, 11], [21, 0]), 0)], scheduled={"r1": 16})
    )
    assert store_summary(meta) == [(ATTN, 0, (10,), 0), (ATTN, 1, (11,), 0)]


def test_split_blocks_chunk_smaller_than_block(worlds) -> None:
    """chunk 4 < block 8: two chunks per attention block; a state anywhere on a chunk boundary,
    in the block covering the token before it."""
    w = worlds(make_spec(8, 8), 4)
    tokens = prompt(22)
    w.sched.get_num_new_matched_tokens(FakeRequest("r1", tokens), 0)
    s1 = w.sched.build_connector_meta(step(new=[new_req("r1", ([10], [20]), 0)], scheduled={"r1": 4}))
    assert w.sched.prefill_stop("r1", 4, 22) == 20
    s2 = w.sched.build_connector_meta(step(cached=[("r1", ([11, 12], [21, 22]), 4)], scheduled={"r1": 16}))
    s3 = w.sched.build_connector_meta(step(cached=[("r1", None, 20)], scheduled={"r1": 2}))
    assert store_summary(s1) == [(ATTN, 0, (10,), 0)]  # 4 is not a checkpoint
    assert store_summary(s2) == [
        (ATTN, 1, (10,), 4),
        (ATTN, 2, (11,), 0),
        (ATTN, 3, (11,), 4),
        (ATTN, 4, (12,), 0),
        (MAMBA, 4, (22,), 0),  # state after 20 tokens: block index 19 // 8 = 2
    ]
    assert store_summary(s3) == []  # tokens 20..21 are not a full chunk


def test_partial_local_hit_still_stores_the_partly_local_chunk(worlds) -> None:
    """chunk 8 > attention block 4: vLLM's local hit of 4 tokens covers half of chunk 0."""
    w = worlds(make_spec(4, 8), 8)
    tokens = prompt(20)
    req = FakeRequest("r1", tokens)
    assert w.sched.get_num_new_matched_tokens(req, 4) == (0, False)
    tables = ([30, 31, 32, 33], [40, 41])
    meta = w.sched.build_connector_meta(step(new=[new_req("r1", tables, 4)], scheduled={"r1": 12}))
    assert store_summary(meta) == [
        (ATTN, 0, (30, 31), 0),  # the whole chunk, local half included
        (ATTN, 1, (32, 33), 0),
        (MAMBA, 1, (41,), 0),
    ]


def test_no_backends_plans_nothing(worlds) -> None:
    w = worlds(make_spec(8, 8), 8, backends=())
    req = FakeRequest("r1", prompt(24))
    assert w.sched.get_num_new_matched_tokens(req, 0) == (0, False)
    meta = w.sched.build_connector_meta(
        step(new=[new_req("r1", ([1, 2, 3], [4, 5, 6]), 0)], scheduled={"r1": 24})
    )
    assert meta.stores == [] and meta.loads == []


def test_store_targets_skip_backends_known_to_hold_the_page(worlds, tmp_path: Path) -> None:
    w = worlds(make_spec(8, 8), 8, backends=(cpu_config(), disk_config(tmp_path)))
    tokens = prompt(28)
    w.hold("disk", w.chunk_keys(tokens, range(2), (ATTN,)))  # attention only: nothing loadable
    req = FakeRequest("r1", tokens)
    assert w.sched.get_num_new_matched_tokens(req, 0) == (0, False)
    meta = w.sched.build_connector_meta(
        step(new=[new_req("r1", ([1, 2, 3], [4, 5, 6]), 0)], scheduled={"r1": 24})
    )
    targets = {(s.page.group, s.page.chunk_index): s.backends for s in meta.stores}
    assert targets == {
        (ATTN, 0): ("cpu",),
        (ATTN, 1): ("cpu",),
        (ATTN, 2): ("cpu", "disk"),
        (MAMBA, 2): ("cpu", "disk"),
    }


# ---- lookup and backend selection -----------------------------------------------------------
def test_best_backend_by_weighted_matched_tokens(worlds, tmp_path: Path) -> None:
    spec = make_spec(8, 8)
    tokens = prompt(44)

    def load_backend(cpu_weight: float, disk_weight: float) -> tuple[int, str]:
        w = worlds(
            spec, 8, backends=(cpu_config(weight=cpu_weight), disk_config(tmp_path, weight=disk_weight))
        )
        w.hold("cpu", w.chunk_keys(tokens, range(4)))  # N = 32
        w.hold("disk", w.chunk_keys(tokens, range(2)))  # N = 16
        req = FakeRequest(f"r-{cpu_weight}-{disk_weight}", tokens)
        n, _ = w.sched.get_num_new_matched_tokens(req, 0)
        job = start_load(w, FakeRequest(req.request_id + "b", tokens), 0, ([1] * 5, [2] * 5))
        return n, job.segments[0].backend

    assert load_backend(1.0, 1.0) == (32, "cpu")
    assert load_backend(1.0, 2.5) == (16, "disk")  # 16 x 2.5 = 40 > 32
    assert load_backend(1.0, 2.0) == (32, "cpu")  # 16 x 2 = 32: tie -> the earlier backend


def test_ties_go_to_the_earlier_backend(worlds, tmp_path: Path) -> None:
    tokens = prompt(30)
    for order in (("cpu", "disk"), ("disk", "cpu")):
        configs = {"cpu": cpu_config(), "disk": disk_config(tmp_path / "-".join(order))}
        w = worlds(make_spec(8, 8), 8, backends=tuple(configs[n] for n in order))
        for name in order:
            w.hold(name, w.chunk_keys(tokens, range(3)))
        req = FakeRequest("r1", tokens)
        assert start_load(w, req, 0, ([1] * 4, [2] * 4)).segments[0].backend == order[0]


def test_matched_tokens_stay_below_the_prompt_and_exclude_local_hits(worlds) -> None:
    w = worlds(make_spec(8, 8), 8)
    tokens = prompt(48)
    w.hold("cpu", w.chunk_keys(tokens, range(6)))
    cases = {32: 24, 33: 32, 40: 32, 41: 40, 48: 40}  # prompt length -> loadable N
    for length, n in cases.items():
        req = FakeRequest(f"len{length}", tokens[:length])
        assert w.sched.get_num_new_matched_tokens(req, 0) == (n, True), length
        assert n < length
    # vLLM already holds 16 tokens (aligned) or 12 tokens (not aligned): count what is new.
    assert w.sched.get_num_new_matched_tokens(FakeRequest("local16", tokens[:41]), 16) == (24, True)
    assert w.sched.get_num_new_matched_tokens(FakeRequest("local12", tokens[:41]), 12) == (28, True)
    assert w.sched.get_num_new_matched_tokens(FakeRequest("local40", tokens[:41]), 40) == (0, False)


def test_a_pp_scheduler_serves_once_every_stages_layers_are_known_and_needs_every_part(worlds) -> None:
    """PP=2 with the attention layer on stage 0 and the Mamba layer on stage 1: the scheduler
    sees stage 0's layers only; until the stages' handshake arrives requests skip the cache,
    then a set is present only with the parts of both stages."""
    whole = make_spec(8, 8)
    groups = tuple(dataclasses.replace(g, layer_names=g.layer_names if g.index == ATTN else ())
                   for g in whole.groups)  # fmt: skip
    spec = make_model_spec(groups, {"name": "fake-hybrid"}, max_model_len=4096, num_blocks=64,
                           grid=LayerGrid(2, (0, 1, 2)), pp_size=2)  # fmt: skip
    w = worlds(spec, 8)
    tokens = prompt(48)
    assert w.sched.get_num_new_matched_tokens(FakeRequest("early", tokens), 0) == (0, False)
    assert w.sched.stats.counters.requests == 0  # not keyed: nothing looked up, nothing stored
    names = [g.layer_names for g in whole.groups]
    stages = {0: (names[ATTN], ()), 1: ((), names[MAMBA])}
    w.planner.set_model_layers(whole_model_layers(spec, stages), list(stages.values()))
    keys = w.keys(tokens)
    pieces = {g: [w.planner.piece_keys(keys[g][c], g) for c in range(5)] for g in (ATTN, MAMBA)}
    assert all(len(p) == 1 for g in pieces for p in pieces[g])  # one part each (its stage), one shard
    w.hold("cpu", [p[0] for p in pieces[ATTN]])
    assert w.sched.get_num_new_matched_tokens(FakeRequest("attention only", tokens), 0) == (0, False)
    w.hold("cpu", pieces[MAMBA][4])
    assert w.sched.get_num_new_matched_tokens(FakeRequest("both stages", tokens), 0) == (40, True)
    assert [w.planner.writers(g) for g in (ATTN, MAMBA)] == [1, 1]  # one stage each


def test_mamba_state_is_required_at_the_boundary(worlds) -> None:
    w = worlds(make_spec(8, 8), 8)
    tokens = prompt(40)
    w.hold("cpu", w.chunk_keys(tokens, range(4), (ATTN,)))
    assert w.sched.get_num_new_matched_tokens(FakeRequest("a", tokens), 0) == (0, False)
    w.hold("cpu", w.chunk_keys(tokens, range(1, 2), (MAMBA,)))
    assert w.sched.get_num_new_matched_tokens(FakeRequest("b", tokens), 0) == (16, True)


def test_cpu_backend_is_seen_only_through_the_mirror(worlds) -> None:
    w = worlds(make_spec(8, 8), 8)
    tokens = prompt(40)
    keys = w.keys(tokens)
    assert w.sched.get_num_new_matched_tokens(FakeRequest("a", tokens), 0) == (0, False)

    # the scheduler never opens the cpu pool: only a worker report makes pages visible
    assert w.sched.views[0].shared is False
    w.hold("cpu", w.chunk_keys(tokens, range(4)))
    assert w.sched.get_num_new_matched_tokens(FakeRequest("b", tokens), 0) == (32, True)

    evicted = OffloadWorkerMetadata(evicted={"cpu": w.pieces([keys[MAMBA][3]])})
    w.sched.update_connector_output(evicted, None, None)
    assert w.sched.get_num_new_matched_tokens(FakeRequest("c", tokens), 0) == (24, True)
    evicted = OffloadWorkerMetadata(evicted={"cpu": w.pieces([keys[ATTN][1]])})
    w.sched.update_connector_output(evicted, None, None)
    assert w.sched.get_num_new_matched_tokens(FakeRequest("d", tokens), 0) == (8, True)
    # reports for other backend names do not touch this mirror; None / other objects are ignored
    w.sched.update_connector_output(OffloadWorkerMetadata(stored={"other": [keys[ATTN][1]]}), None, None)
    w.sched.update_connector_output(None, None, None)
    assert w.sched.get_num_new_matched_tokens(FakeRequest("e", tokens), 0) == (8, True)


def test_mirror_forgets_a_page_stored_and_evicted_within_one_report(worlds) -> None:
    """The cpu pool may put and then evict a key between two reports; the mirror must not keep it
    (a phantom page would send vLLM into a load that fails). cpu.py: a mirror may only forget a
    page that is stored, never remember one that is not."""
    w = worlds(make_spec(8, 8), 8)
    tokens = prompt(40)
    keys = w.keys(tokens)
    stored = w.chunk_keys(tokens, range(4))
    report = OffloadWorkerMetadata(stored={"cpu": stored}, evicted={"cpu": [keys[ATTN][0]]})
    w.sched.update_connector_output(report, None, None)
    assert w.sched.get_num_new_matched_tokens(FakeRequest("a", tokens), 0) == (0, False)


def test_scope_separates_lora_and_cache_salt(worlds) -> None:
    w = worlds(make_spec(8, 8), 8)
    tokens = prompt(40)
    w.hold("cpu", w.chunk_keys(tokens, range(4)))
    assert w.sched.get_num_new_matched_tokens(FakeRequest("salted", tokens, cache_salt="s"), 0) == (0, False)
    lora = SimpleNamespace(lora_name="adapter", lora_int_id=1)
    assert w.sched.get_num_new_matched_tokens(FakeRequest("lora", tokens, lora_request=lora), 0) == (0, False)
    assert w.sched.get_num_new_matched_tokens(FakeRequest("plain", tokens), 0) == (32, True)


def test_an_image_keys_its_chunk_and_every_later_one(worlds) -> None:
    """The same tokens with an image in chunk 2 (its placeholder ids are the same for any image
    of its size) match the stored text-only pages up to the image's chunk only."""
    import torch
    from vllm.multimodal.inputs import (
        MultiModalBatchedField,
        MultiModalFeatureSpec,
        MultiModalFieldElem,
        MultiModalKwargsItem,
        PlaceholderRange,
    )

    w = worlds(make_spec(8, 8), 8)
    tokens = prompt(40)
    w.hold("cpu", w.chunk_keys(tokens, range(4)))
    values = MultiModalFieldElem(torch.ones(4, 6), MultiModalBatchedField())
    pixels = MultiModalKwargsItem({"pixel_values": values})
    image = MultiModalFeatureSpec(pixels, "image", "img", PlaceholderRange(20, 4))
    req = FakeRequest("img", tokens, mm_features=[image])
    assert w.sched.get_num_new_matched_tokens(req, 0) == (16, True)


def test_a_prompt_given_as_embeddings_hits_only_the_same_embeddings(worlds) -> None:
    """vLLM holds 0 for every position of a prompt given as embeddings: its pages are keyed by
    the embeddings, so another prompt of as many embeddings misses and the same one hits."""
    import torch

    w = worlds(make_spec(8, 8), 8)
    zeros = [0] * 40
    w.hold("cpu", w.chunk_keys(zeros, range(4)))  # a prompt of 40 token ids 0: not these
    embeds = torch.randn(40, 16, generator=torch.Generator().manual_seed(0))
    first = FakeRequest("e1", zeros, prompt_embeds=embeds)
    assert w.sched.get_num_new_matched_tokens(first, 0) == (0, False)
    w.sched.update_state_after_alloc(first, ([1] * 5, [2] * 5), 0)
    for meta in run_prefill(w, first, ([1] * 5, [2] * 5), 64):
        w.complete(meta)
    w.sched.request_finished(first)
    w.complete(w.sched.build_connector_meta(step()))
    again = FakeRequest("e2", zeros, prompt_embeds=embeds.clone())
    assert w.sched.get_num_new_matched_tokens(again, 0) == (32, True)
    other = embeds.clone()
    other[20] += 1  # in chunk 2 (of 8 tokens)
    assert w.sched.get_num_new_matched_tokens(FakeRequest("e3", zeros, prompt_embeds=other), 0)[0] < 16
    hashes = {r: w.sched._requests[r].chunk_hashes for r in ("e2", "e3")}
    same = [a == b for a, b in zip(hashes["e2"], hashes["e3"], strict=True)]
    assert same == [True, True, False, False, False]


def test_unnamed_multimodal_requests_are_ignored(worlds) -> None:
    w = worlds(make_spec(8, 8), 8)
    tokens = prompt(40)
    w.hold("cpu", w.chunk_keys(tokens, range(4)))
    req = FakeRequest("r1", tokens, mm_features=[object()])
    assert w.sched.get_num_new_matched_tokens(req, 0) == (0, False)
    w.sched.update_state_after_alloc(req, ([1] * 5, [2] * 5), 0)
    meta = w.sched.build_connector_meta(
        step(new=[new_req("r1", ([1] * 5, [2] * 5), 0)], scheduled={"r1": 40})
    )
    assert meta.loads == [] and meta.stores == []
    assert w.sched.request_finished(req) == (False, None)


# ---- load jobs ------------------------------------------------------------------------------
def test_load_job_pages_for_an_unaligned_start(worlds) -> None:
    """chunk 8 > attention block 4, local hit 4 tokens: chunk 0 loads with skip_tokens 4."""
    w = worlds(make_spec(4, 8), 8)
    tokens = prompt(40)
    w.hold("cpu", w.chunk_keys(tokens, range(4)))
    req = FakeRequest("r1", tokens)
    assert w.sched.get_num_new_matched_tokens(req, 4) == (28, True)
    attn_table = [10, 11, 12, 13, 14, 15, 16, 17]
    mamba_table = [0, 0, 0, 33, 0, 34]  # non-null blocks from index 32 / 8 - 1 = 3 on: 33, 34
    w.sched.update_state_after_alloc(req, (attn_table, mamba_table), 28)
    meta = w.sched.build_connector_meta(step())
    assert meta.loads == [
        LoadJob(
            "r1",
            (
                LoadSegment(
                    "cpu",
                    (
                        attn_page(w, tokens, 0, (10, 11), 0, 4),
                        attn_page(w, tokens, 1, (12, 13)),
                        attn_page(w, tokens, 2, (14, 15)),
                        attn_page(w, tokens, 3, (16, 17)),
                        mamba_page(w, tokens, 3, (33, 34)),
                    ),
                ),
            ),
            ("cpu",),
        )
    ]
    assert w.sched.build_connector_meta(step()).loads == []  # one LoadJob per load


def test_pages_loaded_from_a_slower_tier_are_promoted_into_the_cpu_tier(worlds, tmp_path: Path) -> None:
    """cpu (weight 1) holds chunks 0-1, disk (0.75) chunks 0-3: the load reads from disk and
    promotes what cpu lacks (with its retention) into cpu only."""
    w = worlds(make_spec(8, 8), 8, backends=(cpu_config(), disk_config(tmp_path, weight=0.75)))
    tokens = prompt(40)
    w.hold("cpu", w.chunk_keys(tokens, range(2)))
    w.hold("disk", w.chunk_keys(tokens, range(4)))
    job = start_load(w, FakeRequest("r1", tokens), 0, (list(range(10, 15)), [0, 0, 0, 33, 0]))
    assert {s.backend for s in job.segments} == {"disk"}
    keys = w.keys(tokens)
    assert [(p.key, p.group, p.backends) for p in job.promotions] == [
        (keys[ATTN][2], ATTN, ("cpu",)), (keys[ATTN][3], ATTN, ("cpu",)), (keys[MAMBA][3], MAMBA, ("cpu",))
    ]  # fmt: skip
    hints = {p.key: p.retention for p in job.promotions}
    assert hints[keys[MAMBA][3]].state and hints[keys[MAMBA][3]].parent == "a" + keys[ATTN][3]
    assert hints[keys[ATTN][3]].parent == "a" + keys[ATTN][2]
    assert hints[keys[ATTN][2]].request_bytes > 0  # what it loads counts: a huge load is a scan


@pytest.mark.parametrize(
    "cpu_policy", [{"read_only": True}, {"weight": 0.25}], ids=["cpu read-only", "cpu slower than disk"]
)
def test_no_promotion_into_a_read_only_or_slower_tier(worlds, tmp_path: Path, cpu_policy: dict) -> None:
    w = worlds(make_spec(8, 8), 8, backends=(cpu_config(**cpu_policy), disk_config(tmp_path, weight=0.5)))
    tokens = prompt(40)
    w.hold("disk", w.chunk_keys(tokens, range(4)))
    job = start_load(w, FakeRequest("r1", tokens), 0, (list(range(10, 15)), [0, 0, 0, 33, 0]))
    assert {s.backend for s in job.segments} == {"disk"}
    assert job.promotions == ()


def test_load_job_for_split_blocks_and_aligned_start(worlds) -> None:
    """chunk 4 < block 8 with a local hit of 8 tokens: chunks 2..6, two per block; the load
    ends inside block 13, whose rest is zeroed."""
    w = worlds(make_spec(8, 8), 4)
    tokens = prompt(30)
    w.hold("cpu", w.chunk_keys(tokens, range(7)))
    req = FakeRequest("r1", tokens)
    assert w.sched.get_num_new_matched_tokens(req, 8) == (20, True)  # 28: inside a Mamba block
    job = start_load(w, req, 8, ([10, 11, 12, 13], [0, 0, 0, 23]))
    assert job.pages == (
        attn_page(w, tokens, 2, (11,), 0),
        attn_page(w, tokens, 3, (11,), 4),
        attn_page(w, tokens, 4, (12,), 0),
        attn_page(w, tokens, 5, (12,), 4),
        attn_page(w, tokens, 6, (13,), 0),
        mamba_page(w, tokens, 6, (23,)),
    )
    assert job.clears == (ClearRange(ATTN, 13, 4, 4),)


def test_stores_resume_after_the_loaded_prefix(worlds) -> None:
    w = worlds(make_spec(8, 8), 8)
    tokens = prompt(40)
    w.hold("cpu", w.chunk_keys(tokens, range(4)))
    req = FakeRequest("r1", tokens)
    tables = ([10, 11, 12, 13, 14], [0, 0, 0, 23, 24])
    start_load(w, req, 0, tables)
    # while loading, vLLM does not schedule it; once finished_recving is seen it comes back as new
    w.sched.update_connector_output(None, {"r1"}, None)
    meta = w.sched.build_connector_meta(step(new=[new_req("r1", tables, 32)], scheduled={"r1": 8}))
    assert store_summary(meta) == [(ATTN, 4, (14,), 0)]
    assert hold_summary(meta) == [(MAMBA, 4, (24,), 0)]  # the prompt's end, the reply's start


def test_failed_load_is_not_retried_and_recompute_stores_from_chunk_zero(worlds) -> None:
    w = worlds(make_spec(8, 8), 8)
    tokens = prompt(40)
    w.hold("cpu", w.chunk_keys(tokens, range(4)))
    req = FakeRequest("r1", tokens)
    tables = ([10, 11, 12, 13, 14], [20, 21, 22, 23, 24])
    start_load(w, req, 0, tables)
    w.sched.update_connector_output(None, {"r1"}, {"r1"})
    assert w.sched.stats.snapshot()["failed_loads"] == 1
    # vLLM resets num_computed_tokens to 0 and asks again: no second load of the same pages
    assert w.sched.get_num_new_matched_tokens(req, 0) == (0, False)
    assert w.sched.get_num_new_matched_tokens(req, 0) == (0, False)
    w.sched.update_state_after_alloc(req, tables, 0)
    meta = w.sched.build_connector_meta(step(new=[new_req("r1", tables, 0)], scheduled={"r1": 32}))
    assert meta.loads == []
    assert store_summary(meta) == [
        (ATTN, 0, (10,), 0),
        (ATTN, 1, (11,), 0),
        (ATTN, 2, (12,), 0),
        (ATTN, 3, (13,), 0),
        (MAMBA, 3, (23,), 0),
    ]
    assert all(s.backends == ("cpu",) for s in meta.stores)  # also the pages the mirror "had"


def test_request_finished_holds_blocks_only_while_a_load_is_in_flight(worlds) -> None:
    w = worlds(make_spec(8, 8), 8)
    tokens = prompt(40)
    w.hold("cpu", w.chunk_keys(tokens, range(4)))
    tables = ([10, 11, 12, 13, 14], [20, 21, 22, 23, 24])

    aborted = FakeRequest("aborted", tokens)
    start_load(w, aborted, 0, tables)
    assert w.sched.request_finished(aborted)[0] is True  # load still writing into its blocks
    w.sched.update_connector_output(None, {"aborted"}, None)  # state already gone: no error

    done = FakeRequest("done", tokens)
    start_load(w, done, 0, tables)
    w.sched.update_connector_output(None, {"done"}, None)
    assert w.sched.request_finished(done)[0] is False

    failed = FakeRequest("failed", tokens)
    start_load(w, failed, 0, tables)
    w.sched.update_connector_output(None, {"failed"}, {"failed"})
    assert w.sched.request_finished(failed)[0] is False

    assert w.sched.request_finished(FakeRequest("never-loaded", tokens)) == (False, None)


def test_alloc_without_external_tokens_plans_no_load(worlds) -> None:
    w = worlds(make_spec(8, 8), 8)
    tokens = prompt(40)
    w.hold("cpu", w.chunk_keys(tokens, range(4)))
    req = FakeRequest("r1", tokens)
    assert w.sched.get_num_new_matched_tokens(req, 0) == (32, True)
    w.sched.update_state_after_alloc(req, ([], []), 0)  # vLLM could not allocate: retried later
    assert w.sched.build_connector_meta(step()).loads == []
    assert w.sched.request_finished(req)[0] is False


def test_disk_lookup_sees_pages_written_by_another_process(worlds, tmp_path: Path) -> None:
    w = worlds(make_spec(8, 8), 8, backends=(disk_config(tmp_path),))
    tokens = prompt(40)
    assert w.sched.get_num_new_matched_tokens(FakeRequest("a", tokens), 0) == (0, False)
    w.hold("disk", w.chunk_keys(tokens, range(3)))  # a separate DiskBackend instance writes
    assert w.sched.get_num_new_matched_tokens(FakeRequest("b", tokens), 0) == (24, True)


def test_unavailable_shared_backend_is_skipped_while_down_then_used_again(worlds, tmp_path: Path) -> None:
    flaky = tier(flaky_disk(tmp_path / "r"), retry_after_s=1.0, retry_after_max_s=8.0,
                 load_weight=2.0)  # asked even when cpu holds all
    w = worlds(make_spec(8, 8), 8, backends=(cpu_config(), flaky))
    clock = w.clock  # the scheduler's clock drives the backoff
    view, faulty = w.sched.views[1], w.faulty("redis")
    tokens = prompt(28)
    w.hold("redis", w.chunk_keys(tokens, range(3)))
    lookups = faulty.calls.get("contains_batch", 0)
    faulty.fail("contains_batch", times=None)
    assert w.sched.get_num_new_matched_tokens(FakeRequest("r1", tokens), 0) == (0, False)
    assert view.health.is_down and faulty.calls["contains_batch"] == lookups + 1
    assert w.sched.stats.snapshot()["backends"]["redis"]["unavailable"] == 1
    assert w.sched.get_num_new_matched_tokens(FakeRequest("r2", tokens), 0) == (0, False)
    assert faulty.calls["contains_batch"] == lookups + 1  # skipped while backing off
    meta = w.sched.build_connector_meta(
        step(new=[new_req("r2", ([1, 2, 3], [4, 5, 6]), 0)], scheduled={"r2": 24})
    )
    assert meta.stores and all(s.backends == ("cpu",) for s in meta.stores if not s.hold)
    w.complete(meta)

    faulty.heal()
    clock[0] = 1.0  # the wait is over: the next lookup probes and finds the pages
    assert w.sched.get_num_new_matched_tokens(FakeRequest("r3", tokens), 0) == (24, True)
    assert not view.health.is_down and view.health.recoveries == 1


def test_a_lookup_that_raises_unexpectedly_is_a_miss_not_the_engines_end(worlds, tmp_path: Path,
                                                                          caplog) -> None:  # fmt: skip
    """A backend raising what no backend should (a bug, not a BackendError) in a lookup: a miss
    with no load planned, logged and counted (``lookup_errors``); vLLM's scheduler would
    otherwise end EngineCore. The next lookup finds the pages."""
    w = worlds(make_spec(8, 8), 8, backends=(tier(flaky_disk(tmp_path / "r")),))
    tokens = prompt(28)
    w.hold("redis", w.chunk_keys(tokens, range(3)))
    w.faulty("redis").fail("contains_batch", times=2, error=RuntimeError("a bug in a backend"))
    req = FakeRequest("r1", tokens)
    assert w.sched.get_num_new_matched_tokens(req, 0) == (0, False)
    assert w.sched.get_num_new_matched_tokens(FakeRequest("r1b", tokens), 0) == (0, False)
    errors = [r for r in caplog.records if r.levelname == "ERROR"]  # the first only: no flood
    assert len(errors) == 1 and "lookup of r1 failed" in errors[0].getMessage() and errors[0].exc_info
    assert w.sched.stats.snapshot()["lookup_errors"] == 2
    assert w.sched.load_score("r1") == 0.0
    assert w.sched.get_num_new_matched_tokens(FakeRequest("r2", tokens), 0) == (24, True)  # it passed
    w.sched.update_state_after_alloc(req, ([1, 2, 3, 4], [5, 6, 7, 8]), 0)
    meta = w.sched.build_connector_meta(step(new=[new_req("r1", ([1, 2, 3, 4], [5, 6, 7, 8]), 0)],
                                             scheduled={"r1": 28}))  # fmt: skip
    assert not meta.loads and meta.stores  # r1 recomputes and stores


def test_a_lookup_that_fails_after_choosing_a_load_plans_none(worlds, monkeypatch) -> None:
    w = worlds(make_spec(8, 8), 8)
    tokens = prompt(28)
    w.hold("cpu", w.chunk_keys(tokens, range(3)))

    def broken(*args: Any) -> None:
        raise KeyError("a bug of ours")

    monkeypatch.setattr(w.sched, "_plan_checkpoints", broken)  # runs once the load is chosen
    assert w.sched.get_num_new_matched_tokens(FakeRequest("r1", tokens), 0) == (0, False)
    assert w.sched.load_score("r1") == 0.0 and w.sched.stats.snapshot()["lookup_errors"] == 1


def test_lookups_are_counted_and_timed(worlds) -> None:
    ticks = iter([10.0, 10.25, 20.0, 20.5])  # each lookup reads the timer twice
    w = worlds(make_spec(8, 8), 8, timer=lambda: next(ticks))
    req = FakeRequest("r1", prompt(28))
    assert w.sched.get_num_new_matched_tokens(req, 0) == (0, False)  # keys the request, misses
    assert w.sched.get_num_new_matched_tokens(req, 0) == (0, False)
    counters = w.sched.stats.snapshot()
    assert counters["lookup_calls"] == 2 and counters["lookup_seconds"] == 0.75
