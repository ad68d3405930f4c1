"""Foreign child connectors (``kv_connector_extra_config.connectors``) without an engine: the
children (:class:`ForeignConnectors`), source selection and the messages of a composition (the
connector class itself: ``test_composite_connector.py``).

Children are real connector classes loaded by module path through vLLM's factory
(``tests/foreign_connectors.py``), built on a minimal vllm_config / kv_cache_config stand-in.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from composition_world import (
    REQ,
    SCHED,
    WORKER,
    FakeNative,
    build,
    child,
    hooks,
    kv_cache_config,
    recorder,
    vllm_config,
)
from foreign_connectors import RecordingMetadata, RecordingWorkerMetadata
from scheduler_world import FakeRequest, World, cpu_config, make_spec, prompt

from hybrid_offload.connector.children import (
    NO_MATCH,
    PENDING,
    ChildMatch,
    ForeignConnectors,
    HybridMetadata,
    HybridWorkerMetadata,
    choose_source,
)
from hybrid_offload.connector.config import ROOT, ConfigError, parse_child_connectors, parse_offload_config
from hybrid_offload.connector.metadata import OffloadMetadata, OffloadWorkerMetadata


# ---- building -----------------------------------------------------------------------------
def test_children_get_their_own_kv_transfer_config_and_the_parents_role() -> None:
    fc = build(child("a", hit_tokens=5), child("b", 2.0))
    a, b = recorder(fc, 0), recorder(fc, 1)
    assert a._kv_transfer_config.kv_connector_extra_config == {"hit_tokens": 5}
    assert b._kv_transfer_config.kv_connector == "RecordingConnector"
    assert a._kv_transfer_config.kv_role == "kv_both"
    assert a._kv_transfer_config is not b._kv_transfer_config
    assert fc.describe() == [("a", "RecordingConnector", 1.0), ("b", "RecordingConnector", 2.0)]


def test_non_hma_child_is_rejected_for_a_hybrid_model_naming_the_child() -> None:
    with pytest.raises(ConfigError) as info:
        build(child("fine"), child("old", hma=False), groups=2)
    message = str(info.value)
    assert f"{ROOT}.connectors[1]" in message and "'old'" in message
    assert "NonHmaRecordingConnector" in message and "HMA" in message and "2 KV cache groups" in message


def test_non_hma_child_is_fine_with_one_kv_cache_group() -> None:
    fc = build(child("old", hma=False), groups=1)
    assert fc.request_finished_all_groups(REQ, ([3, 4],)) == (False, None)
    assert hooks(recorder(fc, 0), "request_finished") == [("r1",)]


@pytest.mark.parametrize(
    ("entry", "words"),
    [
        ({"kv_connector": "Nope", "kv_role": "kv_both"}, ("Unsupported connector type", "Nope")),
        ({"kv_connector": "X", "kv_connector_module_path": "no_such_module_xyz"}, ("no_such_module_xyz",)),
        ({"kv_connector": "Missing", "kv_connector_module_path": "foreign_connectors"}, ("Missing",)),
        ({"kv_connector": "RecordingConnector", "kv_role": "kv_sideways"}, ("kv_sideways",)),
        ({"kv_connector": "RecordingConnector", "bogus_key": 1}, ("bogus_key",)),
    ],
)
def test_unloadable_child_names_the_child(entry: dict[str, Any], words: tuple[str, ...]) -> None:
    configs = parse_child_connectors([entry], f"{ROOT}.connectors")
    with pytest.raises(ConfigError) as info:
        ForeignConnectors(configs, vllm_config(), SCHED, kv_cache_config())
    message = str(info.value)
    assert f"{ROOT}.connectors[0]" in message
    for word in words:
        assert word in message, (word, message)


# ---- selection ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("children", "expected"),
    [
        # (hit tokens, weight) per child -> (index, tokens, score)
        ([(100, 1.0), (80, 2.0)], (1, 80, 160.0)),  # higher score wins over more tokens
        ([(100, 1.0), (50, 2.0)], (0, 100, 100.0)),  # tie -> the earlier child
        ([(0, 9.0), (10, 1.0)], (1, 10, 10.0)),  # no tokens never wins, whatever the weight
        ([(30, 1.0), (60, 0.5), (31, 1.0)], (2, 31, 31.0)),
    ],
)
def test_match_picks_the_best_weighted_score(
    children: list[tuple[int, float]], expected: tuple[int, int, float]
) -> None:
    fc = build(*(child(f"c{i}", w, hit_tokens=n) for i, (n, w) in enumerate(children)))
    best = fc.match(REQ, 16)
    assert (best.index, best.tokens, best.score) == expected and best.is_async
    for i in range(len(children)):
        assert hooks(recorder(fc, i), "get_num_new_matched_tokens") == [("r1", 16)]


def test_match_without_hits_and_with_a_pending_child() -> None:
    assert build(child("a"), child("b")).match(REQ, 0) == NO_MATCH
    assert build(child("a", hit_tokens=64), child("b", pending=True)).match(REQ, 0) == PENDING


@pytest.mark.parametrize(
    ("native", "child_hits", "answer", "winner", "dropped"),
    [
        ((32, 32.0), (16, 2.5), (16, True), 0, True),  # child 40 > native 32
        ((32, 32.0), (16, 2.0), (32, True), None, False),  # tie -> native
        ((32, 32.0), (16, 1.0), (32, True), None, False),  # native higher
        ((0, 0.0), (16, 0.1), (16, True), 0, True),  # only the child hits
        ((0, 0.0), (0, 1.0), (0, False), None, False),  # nobody hits
    ],
)
def test_choose_source_native_against_children(
    native: tuple[int, float], child_hits: tuple[int, float], answer: tuple[int, bool], winner: int | None,
    dropped: bool,
) -> None:
    fc = build(child("c", child_hits[1], hit_tokens=child_hits[0]))
    ours = FakeNative(*native)
    assert choose_source(ours, fc, REQ, 0) == answer
    assert fc.selected("r1") == winner and ours.dropped == dropped


def test_choose_source_pending_child_makes_the_answer_pending() -> None:
    fc = build(child("c", pending=True))
    ours = FakeNative(32, 32.0)
    assert choose_source(ours, fc, REQ, 0) == (None, False)
    assert ours.dropped and fc.selected("r1") is None


def test_real_scheduler_score_and_drop(tmp_path: Path) -> None:
    """OffloadScheduler.load_score is (tokens beyond computed) x weight; a dropped load is not
    planned by update_state_after_alloc."""
    w = World(make_spec(8, 8), 8, (cpu_config(weight=1.5),))
    try:
        tokens = prompt(44)
        w.hold("cpu", w.chunk_keys(tokens, range(4)))  # 32 tokens loadable
        req = FakeRequest("r1", tokens)
        assert w.sched.get_num_new_matched_tokens(req, 8) == (24, True)
        assert w.sched.load_score("r1") == 24 * 1.5
        assert w.sched.load_score("unknown") == 0.0
        fc = build(child("c", 2.0, hit_tokens=24))  # 48 > 36: the child wins
        assert choose_source(w.sched, fc, req, 8) == (24, True)
        assert w.sched.load_score("r1") == 0.0
        w.sched.update_state_after_alloc(req, ([1] * 6, [2] * 6), 24)
        assert w.sched.build_connector_meta(_empty_step()).loads == []
    finally:
        w.close()


def _empty_step() -> SimpleNamespace:
    cached = SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_block_ids=[], num_computed_tokens=[])
    return SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=cached, num_scheduled_tokens={})


# ---- routing ------------------------------------------------------------------------------
def test_update_state_after_alloc_routes_the_count_to_the_selected_child() -> None:
    fc = build(child("a"), child("b"), child("c"))
    blocks = object()
    fc.select("r1", 1)
    fc.update_state_after_alloc(REQ, blocks, 48)
    assert [hooks(recorder(fc, i), "update_state_after_alloc") for i in range(3)] == [
        [("r1", blocks, 0)],
        [("r1", blocks, 48)],
        [("r1", blocks, 0)],
    ]
    assert fc.snapshot() == {"a": {"loaded_tokens": 0}, "b": {"loaded_tokens": 48}, "c": {"loaded_tokens": 0}}
    fc.select("r1", None)
    fc.update_state_after_alloc(REQ, blocks, 48)  # native loads: every child sees 0
    assert [hooks(recorder(fc, i), "update_state_after_alloc")[-1][2] for i in range(3)] == [0, 0, 0]


def test_loaded_groups_and_hit_sources_follow_the_selected_child() -> None:
    fc = build(child("a"), child("b"), groups=3)
    assert fc.loaded_group_ids(REQ) is None and fc.cache_hit_sources(REQ, 8) is None
    fc.select("r1", 1)
    assert fc.loaded_group_ids(REQ) == (0, 1, 2)
    assert sum(fc.cache_hit_sources(REQ, 8).values()) == 8


# ---- metadata split and merge -------------------------------------------------------------
def test_scheduler_metadata_reaches_each_child_worker() -> None:
    sched = build(child("a"), child("b"))
    worker = build(child("a"), child("b"), role=WORKER)
    sched.select("r1", 0)
    sched.update_state_after_alloc(REQ, object(), 16)
    metas, extra = sched.build_meta(_empty_step())
    worker.bind_metadata(HybridMetadata(OffloadMetadata(), metas, extra))
    a, b = recorder(worker, 0), recorder(worker, 1)
    assert hooks(a, "bind_connector_metadata") == [(metas[0],)] and hooks(b, "bind_connector_metadata") == [
        (metas[1],)
    ]
    assert isinstance(metas[0], RecordingMetadata) and metas[0].loads == {"r1": 16} and metas[1].loads == {}
    worker.clear_metadata()
    assert not a.has_connector_metadata() and hooks(b, "clear_connector_metadata")


def test_worker_metadata_aggregates_per_child_and_is_split_back() -> None:
    ours = OffloadWorkerMetadata(stored={"cpu": ["k1"]})
    one = HybridWorkerMetadata(ours, (RecordingWorkerMetadata(), None))
    two = HybridWorkerMetadata(None, (RecordingWorkerMetadata(2), RecordingWorkerMetadata()))
    merged = one.aggregate(two)
    assert isinstance(merged, HybridWorkerMetadata)
    assert merged.native.stored == {"cpu": ["k1"]}
    assert merged.children == (RecordingWorkerMetadata(3), RecordingWorkerMetadata(1))
    assert not merged.is_empty()
    assert HybridWorkerMetadata(OffloadWorkerMetadata(), (None, None)).is_empty()

    sched = build(child("a"), child("b"))
    output = SimpleNamespace(kv_connector_worker_meta=merged)
    sched.update_connector_output(output, merged.children)
    assert output.kv_connector_worker_meta is merged  # restored
    got = [hooks(recorder(sched, i), "update_connector_output")[0][0] for i in range(2)]
    assert got == list(merged.children)
    sched.update_connector_output(output, None)
    assert hooks(recorder(sched, 0), "update_connector_output")[-1] == (None,)


# ---- finished sets ------------------------------------------------------------------------
def test_finished_sets_are_unions_and_shared_async_saves_report_once() -> None:
    sched = build(child("a", async_save=True), child("b", async_save=True), child("c"))
    assert sched.request_finished_all_groups(REQ, ([1], [2])) == (True, None)
    _, extra = sched.build_meta(_empty_step())
    assert extra == {"r1": 1}  # two children save r1: one extra finished-sending to swallow

    worker = build(child("a", finished_sending=["r1", "r2"]), child("b"), child("c"), role=WORKER)
    worker.bind_metadata(HybridMetadata(OffloadMetadata(), (RecordingMetadata(1),) * 3, extra))
    recorder(worker, 2)._loading.add("r9")
    first = worker.transfer_results({"r1", "r2"})
    assert first.finished_sending == {"r2"}  # r1: the first of its two savers is swallowed
    assert first.finished_recving == {"r9"}
    assert worker.transfer_results({"r1"}).finished_sending == set()
    recorder(worker, 1).finished_sending.add("r1")
    assert worker.transfer_results({"r1"}).finished_sending == {"r1"}  # the second one counts


def test_request_finished_goes_to_every_child_and_forgets_the_selection() -> None:
    fc = build(child("a"), child("b", async_save=True))
    fc.select("r1", 0)
    assert fc.request_finished(REQ, [5, 6]) == (True, None)
    assert fc.selected("r1") is None
    assert hooks(recorder(fc, 0), "request_finished") == [("r1",)]
    assert hooks(recorder(fc, 1), "request_finished") == [("r1",)]


def test_worker_hooks_reach_every_child() -> None:
    fc = build(child("a"), child("b"), role=WORKER)
    fc.register_kv_caches({"layer.0": object()})
    fc.start_load_kv(object())
    fc.wait_for_layer_load("layer.0")
    fc.save_kv_layer("layer.0", object(), object())
    fc.wait_for_save()
    assert fc.worker_meta() == (RecordingWorkerMetadata(), RecordingWorkerMetadata())
    fc.shutdown()
    for i in range(2):
        called = {hook for hook, _ in recorder(fc, i).calls}
        assert {"register_kv_caches", "start_load_kv", "wait_for_layer_load", "save_kv_layer",
                "wait_for_save", "build_connector_worker_meta", "shutdown"} <= called


def test_hooks_are_recorded_to_a_file(tmp_path: Path) -> None:
    record = tmp_path / "record.txt"
    fc = build(child("a", record_path=str(record)))
    fc.match(REQ, 0)
    fc.match(REQ, 0)
    lines = record.read_text().splitlines()
    assert [line.split()[:2] for line in lines] == [
        ["scheduler", "init"],
        ["scheduler", "get_num_new_matched_tokens"],
    ]


# ---- config -------------------------------------------------------------------------------
def test_config_accepts_connectors_next_to_or_instead_of_backends() -> None:
    cfg = parse_offload_config({"backends": [{"type": "cpu", "name": "cpu"}], "connectors": [child("x", 2)]})
    assert [b.name for b in cfg.backends] == ["cpu"]
    (x,) = cfg.connectors
    assert (x.name, x.load_weight) == ("x", 2.0)
    assert "name" not in x.kv_transfer_config and "load_weight" not in x.kv_transfer_config
    assert x.kv_transfer_config["kv_connector_module_path"] == "foreign_connectors"
    only = parse_offload_config({"connectors": [{"kv_connector": "A"}, {"kv_connector": "A"}]})
    assert only.backends == () and [c.name for c in only.connectors] == ["A0", "A1"]
    assert [c.load_weight for c in only.connectors] == [1.0, 1.0]
    assert parse_offload_config({"backends": [{"type": "cpu"}]}).connectors == ()


C = f"{ROOT}.connectors"


@pytest.mark.parametrize(
    ("extra", "key", "words"),
    [
        ({"backends": [], "connectors": []}, f"{ROOT}.backends", ("non-empty", "connectors")),
        ({"connectors": {"kv_connector": "A"}}, C, ("list",)),
        ({"connectors": ["A"]}, f"{C}[0]", ("'A'",)),
        ({"connectors": [{"kv_connector": "A"}, {"name": "b"}]}, f"{C}[1].kv_connector", ("missing",)),
        ({"connectors": [{"kv_connector": ""}]}, f"{C}[0].kv_connector", ()),
        ({"connectors": [{"kv_connector": "A", "load_weight": 0}]}, f"{C}[0].load_weight", ("0",)),
        ({"connectors": [{"kv_connector": "A", "load_weight": "2"}]}, f"{C}[0].load_weight", ("'2'",)),
        ({"connectors": [{"kv_connector": "A", "load_weight": True}]}, f"{C}[0].load_weight", ()),
        ({"connectors": [{"kv_connector": "A", "load_weight": float("inf")}]}, f"{C}[0].load_weight", ()),
        ({"connectors": [{"kv_connector": "A", "name": ""}]}, f"{C}[0].name", ()),
        ({"connectors": [{"kv_connector": "A", "name": 3}]}, f"{C}[0].name", ()),
        ({"connectors": [{"kv_connector": "A", "name": "x"}, {"kv_connector": "B", "name": "x"}]},
         f"{C}[1].name", ("duplicate", "'x'")),
        ({"backends": [{"type": "cpu", "name": "fast"}],
          "connectors": [{"kv_connector": "A", "name": "fast"}]},
         f"{C}[0].name", ("duplicate", "'fast'", "backends")),
        ({"backends": [{"type": "cpu"}], "connectors": [{"kv_connector": "A", "name": "cpu0"}]},
         f"{C}[0].name", ("duplicate",)),
        ({"connectors": [{"kv_connector": "A", "kv_connector_module_path": ""}]},
         f"{C}[0].kv_connector_module_path", ()),
        ({"connectors": [{"kv_connector": "A", "kv_connector_extra_config": []}]},
         f"{C}[0].kv_connector_extra_config", ()),
    ],
)
def test_bad_connectors_config_names_the_key(extra: dict[str, Any], key: str, words: tuple[str, ...]) -> None:
    with pytest.raises(ConfigError) as info:
        parse_offload_config(extra)
    message = str(info.value)
    assert key in message, message
    for word in words:
        assert word in message, (word, message)


def test_child_match_defaults() -> None:
    assert ChildMatch(None, 0) == NO_MATCH and NO_MATCH.score == 0.0 and PENDING.tokens is None

