"""The composing connector (:class:`HybridMultiConnector`) without an engine, and the facade's
refusal of ``connectors``.

The composition is built through its own constructor with real recording children
(``tests/foreign_connectors.py``) and, as its own side, a :class:`FakeFacade` that records each
hook and answers what the test sets: how the two sides are routed is what is tested here (the
children's own rules: ``test_foreign_connectors.py``; a real facade inside a real engine:
``tests/e2e/test_foreign_connectors_e2e.py``).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from composition_world import (
    REQ,
    SCHED,
    WORKER,
    FakeNative,
    child,
    hooks,
    kv_cache_config,
    recorder,
    vllm_config,
)
from foreign_connectors import RecordingMetadata, RecordingWorkerMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    supports_hma,
)

import hybrid_offload.connector as connector_package
from hybrid_offload.connector import composite, facade
from hybrid_offload.connector.children import HybridMetadata, HybridWorkerMetadata
from hybrid_offload.connector.composite import ComposedHandshake, HybridMultiConnector
from hybrid_offload.connector.config import ROOT, ConfigError, OffloadConfig
from hybrid_offload.connector.facade import ACTIVE_CONNECTORS, HybridOffloadConnector
from hybrid_offload.connector.metadata import OffloadMetadata, OffloadWorkerMetadata, StageLayers

BACKENDS = [{"type": "cpu", "name": "cpu"}]


class FakeFacade:
    """Our side as the composition sees it: every hook is recorded in ``calls`` and returns
    ``answers[hook]`` (called with the hook's arguments when callable; None when unset)."""

    requires_kv_delivery = False

    def __init__(
        self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any, *, config: OffloadConfig
    ) -> None:
        self.config, self.role = config, role
        self.scheduler = FakeNative(0, 0.0) if role == SCHED else None
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.answers: dict[str, Any] = {
            "get_transfer_results": lambda ids: KVConnectorTransferResults(),
            "get_block_ids_with_load_errors": set,
            "request_finished": lambda request, blocks: (False, None),
            "request_finished_all_groups": lambda request, blocks: (False, None),
            "prefill_stop": lambda request, start, end, align: end,
            "take_events": tuple,
            "has_pending_block_frees": False,
            "has_pending_push_work": False,
            "reset_cache": True,
        }

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)

        def hook(*args: Any, **kwargs: Any) -> Any:
            self.calls.append((name, args))
            answer = self.answers.get(name)
            return answer(*args) if callable(answer) else answer

        return hook

    def got(self, name: str) -> list[tuple[Any, ...]]:
        return hooks(self, name)


@pytest.fixture
def fake_facade(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(composite, "HybridOffloadConnector", FakeFacade)
    yield


def compose(
    *children: dict[str, Any], role: KVConnectorRole = SCHED, groups: int = 2, backends: bool = True
) -> tuple[HybridMultiConnector, FakeFacade]:
    extra = {"backends": BACKENDS if backends else [], "connectors": list(children)}
    conn = HybridMultiConnector(vllm_config(extra), role, kv_cache_config(groups))
    assert isinstance(conn.native, FakeFacade)
    return conn, conn.native


# ---- building -----------------------------------------------------------------------------
def test_our_side_gets_the_config_without_connectors_and_the_children_theirs(fake_facade) -> None:
    conn, ours = compose(child("a"), child("b", 2.0))
    assert [b.name for b in ours.config.backends] == ["cpu"] and ours.config.connectors == ()
    assert conn.children.describe() == [("a", "RecordingConnector", 1.0), ("b", "RecordingConnector", 2.0)]
    assert conn.nested_connectors() == [ours, *conn.children.connectors]
    assert conn in ACTIVE_CONNECTORS
    only_children, ours = compose(child("a"), backends=False)
    assert ours.config.backends == () and len(only_children.nested_connectors()) == 2


def test_a_child_that_cannot_be_built_stops_us_before_our_side_opens(fake_facade, monkeypatch) -> None:
    made: list[FakeFacade] = []

    def remembered(*args: Any, **kwargs: Any) -> FakeFacade:
        made.append(FakeFacade(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(composite, "HybridOffloadConnector", remembered)
    with pytest.raises(ConfigError) as info:
        compose(child("fine"), child("old", hma=False))
    assert f"{ROOT}.connectors[1] ('old')" in str(info.value)
    assert made == []


def test_children_are_shut_down_when_our_side_cannot_start(monkeypatch) -> None:
    built: list[Any] = []
    real = composite.ForeignConnectors

    def remembered(*args: Any) -> Any:
        built.append(real(*args))
        return built[-1]

    def refused(*args: Any, **kwargs: Any) -> None:
        raise ConfigError(f"{ROOT}.tp_shards: refused")

    monkeypatch.setattr(composite, "ForeignConnectors", remembered)
    monkeypatch.setattr(composite, "HybridOffloadConnector", refused)
    with pytest.raises(ConfigError, match="tp_shards"):
        compose(child("a"), child("b"))
    assert [hooks(recorder(built[0], i), "shutdown") for i in range(2)] == [[()], [()]]


def test_counters_are_ours_plus_the_childrens_loads_on_the_scheduler(fake_facade) -> None:
    sched, ours = compose(child("a"))
    ours.answers["counters"] = lambda: {"requests": 2}
    assert sched.counters() == {"requests": 2, "children": {"a": {"loaded_tokens": 0}}}
    worker, ours = compose(child("a"), role=WORKER)
    ours.answers["counters"] = lambda: {"stored_pages": 3}
    assert worker.counters() == {"stored_pages": 3}


def test_the_composition_supports_hma_and_answers_to_multiconnector() -> None:
    assert supports_hma(HybridMultiConnector) and supports_hma(HybridOffloadConnector)
    assert connector_package.MultiConnector is HybridMultiConnector
    assert connector_package.HybridMultiConnector is HybridMultiConnector
    assert connector_package.HybridOffloadConnector is HybridOffloadConnector


# ---- the facade stays a facade ------------------------------------------------------------
def test_the_facade_refuses_connectors_naming_the_key_and_the_class() -> None:
    extra = {"backends": BACKENDS, "connectors": [child("a")]}
    config = vllm_config(extra, connector="HybridOffloadConnector")
    with pytest.raises(ConfigError) as info:
        HybridOffloadConnector(config, SCHED, kv_cache_config())
    message = str(info.value)
    assert message.startswith(f"{ROOT}.connectors: ") and "'HybridOffloadConnector'" in message
    assert "kv_connector 'HybridMultiConnector'" in message
    with pytest.raises(ConfigError, match="HybridMultiConnector"):  # only connectors: the same
        HybridOffloadConnector(vllm_config({"connectors": [child("a")]}), SCHED, kv_cache_config())


def test_the_facade_knows_nothing_of_children() -> None:
    source = inspect.getsource(facade)
    imported = {
        node.module for node in ast.walk(ast.parse(source)) if isinstance(node, ast.ImportFrom)
    }
    assert "hybrid_offload.connector.children" not in imported
    assert "hybrid_offload.connector.composite" not in imported
    assert "children" not in source and "ForeignConnectors" not in source
    assert HybridOffloadConnector.nested_connectors(object()) == []  # type: ignore[arg-type]


# ---- scheduler side -----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("native", "weight", "answer", "chosen"),
    [((16, 16.0), 2.5, (8, True), 0), ((16, 16.0), 2.0, (16, True), None)],  # 20 > 16; a tie
)
def test_one_source_loads_and_the_others_see_zero_tokens(
    fake_facade, native: tuple[int, float], weight: float, answer: tuple[int, bool], chosen: int | None
) -> None:
    conn, ours = compose(child("a", weight, hit_tokens=8), child("b"))
    ours.scheduler = FakeNative(*native)
    assert conn.get_num_new_matched_tokens(REQ, 0) == answer
    assert ours.scheduler.dropped == (chosen is not None)
    blocks = object()
    conn.update_state_after_alloc(REQ, blocks, answer[0])
    assert ours.got("update_state_after_alloc") == [(REQ, blocks, answer[0])]
    counts = [hooks(recorder(conn.children, i), "update_state_after_alloc")[0][2] for i in range(2)]
    assert counts == [answer[0] if chosen == 0 else 0, 0]


def test_without_children_our_side_answers_alone(fake_facade) -> None:
    conn, ours = compose()
    ours.scheduler = FakeNative(16, 16.0)
    assert conn.get_num_new_matched_tokens(REQ, 0) == (16, True) and not ours.scheduler.dropped
    ours.answers["request_finished"] = lambda request, blocks: (True, {"hybrid_offload": 1})
    assert conn.request_finished(REQ, [1]) == (True, {"hybrid_offload": 1})
    ours.answers["get_external_cache_hit_sources"] = {"ours": 16}
    assert conn.get_external_cache_hit_sources(REQ, 16) == {"ours": 16}
    ours.answers["counters"] = dict
    assert conn.counters() == {"children": {}} and not conn.requires_kv_delivery
    assert conn.reset_cache() is True and conn.get_handshake_metadata() is None


def test_hit_sources_and_loaded_groups_follow_the_source(fake_facade) -> None:
    conn, ours = compose(child("a"), groups=3)
    ours.answers["get_external_cache_hit_sources"] = {"ours": 8}
    ours.answers["get_loaded_kv_cache_group_ids"] = (0,)
    assert conn.get_external_cache_hit_sources(REQ, 8) == {"ours": 8}
    assert conn.get_loaded_kv_cache_group_ids(REQ) == (0,)
    conn.children.select("r1", 0)
    assert sum(conn.get_external_cache_hit_sources(REQ, 8).values()) == 8
    assert conn.get_loaded_kv_cache_group_ids(REQ) == (0, 1, 2)


def test_request_finished_delays_if_any_side_saves_and_merges_params(fake_facade) -> None:
    conn, ours = compose(child("a", async_save=True), child("b"))
    ours.answers["request_finished_all_groups"] = lambda request, blocks: (False, {"hybrid_offload": 1})
    assert conn.request_finished_all_groups(REQ, ([1], [2])) == (True, {"hybrid_offload": 1})
    assert ours.got("request_finished_all_groups") == [(REQ, ([1], [2]))]
    assert hooks(recorder(conn.children, 1), "request_finished_all_groups") == [("r1", ([1], [2]))]
    conn, ours = compose(child("a"))
    ours.answers["request_finished"] = lambda request, blocks: (True, None)
    assert conn.request_finished(REQ, [1]) == (True, None)


def test_metadata_goes_down_in_one_slice_per_side(fake_facade) -> None:
    sched, ours = compose(child("a"), child("b"))
    native_meta = OffloadMetadata()
    ours.answers["build_connector_meta"] = native_meta
    meta = sched.build_connector_meta(SimpleNamespace())
    assert isinstance(meta, HybridMetadata) and meta.native is native_meta
    assert [type(m) for m in meta.children] == [RecordingMetadata, RecordingMetadata]

    worker, ours = compose(child("a"), child("b"), role=WORKER)
    worker.bind_connector_metadata(meta)
    assert worker.has_connector_metadata() and ours.got("bind_connector_metadata") == [(native_meta,)]
    assert hooks(recorder(worker.children, 1), "bind_connector_metadata") == [(meta.children[1],)]
    worker.start_load_kv(object())
    worker.wait_for_save()
    worker.handle_preemptions(meta)
    assert ours.got("handle_preemptions") == [(native_meta,)]
    worker.handle_preemptions({"r1"})  # older vLLM: request ids, our side only
    assert ours.got("handle_preemptions")[-1] == ({"r1"},)
    worker.clear_connector_metadata()
    assert not worker.has_connector_metadata() and ours.got("clear_connector_metadata") == [()]
    for hook in ("start_load_kv", "wait_for_save"):
        assert ours.got(hook) and hooks(recorder(worker.children, 0), hook)


def test_worker_metadata_goes_up_and_each_side_reads_its_own(fake_facade) -> None:
    worker, ours = compose(child("a"), role=WORKER)
    mine = OffloadWorkerMetadata(stored={"cpu": ["k1"]})
    ours.answers["build_connector_worker_meta"] = mine
    up = worker.build_connector_worker_meta()
    assert up == HybridWorkerMetadata(mine, (RecordingWorkerMetadata(),))

    sched, ours = compose(child("a"))
    seen: list[Any] = []
    ours.answers["update_connector_output"] = lambda out: seen.append(out.kv_connector_worker_meta)
    output = SimpleNamespace(kv_connector_worker_meta=up, finished_recving=set(), failed_recving=set())
    sched.update_connector_output(output)
    assert seen == [mine] and output.kv_connector_worker_meta is up
    assert hooks(recorder(sched.children, 0), "update_connector_output") == [(RecordingWorkerMetadata(),)]
    output.kv_connector_worker_meta = None  # an empty step
    sched.update_connector_output(output)
    assert seen[-1] is None and hooks(recorder(sched.children, 0), "update_connector_output")[-1] == (None,)


def test_empty_worker_metadata_is_none(fake_facade, monkeypatch) -> None:
    worker, ours = compose(child("a"), role=WORKER)
    monkeypatch.setattr(recorder(worker.children, 0), "build_connector_worker_meta", lambda: None)
    ours.answers["build_connector_worker_meta"] = OffloadWorkerMetadata()
    assert worker.build_connector_worker_meta() is None


# ---- worker results -----------------------------------------------------------------------
def test_transfer_results_and_load_errors_are_unions(fake_facade) -> None:
    worker, ours = compose(child("a", finished_sending=["r2"]), role=WORKER)
    ours.answers["get_transfer_results"] = lambda ids: KVConnectorTransferResults({"r1"}, {"r3"}, {"r4"})
    ours.answers["get_block_ids_with_load_errors"] = lambda: {7}
    recorder(worker.children, 0)._loading.add("r5")
    results = worker.get_transfer_results({"r1", "r2"})
    assert (results.finished_sending, results.finished_recving, results.failed_recving) == (
        {"r1", "r2"}, {"r3", "r5"}, {"r4"}
    )
    assert worker.get_block_ids_with_load_errors() == {7}
    assert worker.get_finished(set()) == ({"r1"}, {"r3"})


def test_handshake_prefill_stops_and_step_questions(fake_facade) -> None:
    conn, ours = compose(child("a"), child("b"))
    assert conn.get_handshake_metadata() is None
    marker = object()
    recorder(conn.children, 1).get_handshake_metadata = lambda: marker  # type: ignore[method-assign]
    assert conn.get_handshake_metadata() is marker
    conn.set_xfer_handshake_metadata({0: marker})  # a child's: ours gets none of it
    assert ours.got("set_xfer_handshake_metadata") == [({},)]

    ours.answers["prefill_stop"] = lambda request, start, end, align: min(end, 640)
    assert conn.prefill_stop(REQ, 0, 1000) == 640 and conn.prefill_stop(REQ, 0, 500) == 500
    recorder(conn.children, 0).prefill_stop = lambda request, start, end, align: min(end, 384 * align)  # type: ignore[attr-defined]
    assert conn.prefill_stop(REQ, 0, 1000) == 384  # a child's (e.g. our own connector as a child)
    assert conn.prefill_stop(REQ, 0, 1000, 2) == 640 and ours.got("prefill_stop")[-1][3] == 2

    assert not conn.has_pending_push_work() and not conn.has_pending_block_frees()
    ours.answers["has_pending_push_work"] = True
    assert conn.has_pending_push_work()
    assert conn.requires_kv_delivery  # vLLM's default for the kv_both recording children
    assert conn.reset_cache() is True and ours.got("reset_cache") == [()]
    assert list(conn.take_events()) == []


def test_at_pp_our_side_gets_every_stages_layers_and_each_child_its_own_metadata(fake_facade) -> None:
    """At PP > 1 our side learns the stages' layers through vLLM's handshake metadata, which a
    child may need too (a NIXL connector's agent metadata): each worker sends both, and each
    side gets its own, keyed as vLLM keys them."""
    config = vllm_config({"backends": BACKENDS, "connectors": [child("a"), child("b")]})
    config.parallel_config.pipeline_parallel_size = 2
    conn = HybridMultiConnector(config, SCHED, kv_cache_config(2))
    layers = {rank: StageLayers(rank, ((f"model.layers.{rank}.attn",),)) for rank in (0, 1)}
    theirs = {rank: RecordingHandshake(f"agent {rank}") for rank in (0, 1)}
    conn.native.answers["get_handshake_metadata"] = layers[0]
    recorder(conn.children, 1).get_handshake_metadata = lambda: theirs[0]  # type: ignore[method-assign]
    delivered: list[tuple[int, Any]] = []
    for i in (0, 1):
        recorder(conn.children, i).set_xfer_handshake_metadata_pp_aware = (  # type: ignore[method-assign]
            lambda meta, i=i: delivered.append((i, meta)))
    sent = conn.get_handshake_metadata()
    assert sent == ComposedHandshake(layers[0], theirs[0])
    received = {(0, 0): sent, (1, 0): ComposedHandshake(layers[1], theirs[1])}
    conn.set_xfer_handshake_metadata_pp_aware(received)  # type: ignore[arg-type]
    ours = conn.native.got("set_xfer_handshake_metadata_pp_aware")
    assert ours == [({(0, 0): layers[0], (1, 0): layers[1]},)]
    assert delivered == [(i, {(0, 0): theirs[0], (1, 0): theirs[1]}) for i in (0, 1)]
    # one side without metadata: the other side's goes alone, unwrapped
    conn.native.answers["get_handshake_metadata"] = None
    assert conn.get_handshake_metadata() is theirs[0]
    conn = HybridMultiConnector(vllm_config({"backends": BACKENDS}), SCHED, kv_cache_config(2))
    conn.native.answers["get_handshake_metadata"] = layers[0]
    assert conn.get_handshake_metadata() is layers[0]


@dataclasses.dataclass(frozen=True)
class RecordingHandshake(KVConnectorHandshakeMetadata):
    agent: str


def test_shutdown_reaches_every_child_when_ours_fails(fake_facade) -> None:
    conn, ours = compose(child("a"), child("b"), role=WORKER)

    def boom() -> None:
        raise RuntimeError("ours failed")

    ours.answers["shutdown"] = boom
    with pytest.raises(RuntimeError, match="ours failed"):
        conn.shutdown()
    assert all(hooks(recorder(conn.children, i), "shutdown") == [()] for i in range(2))


def test_stats_are_ours(fake_facade) -> None:
    conn, ours = compose(child("a"))
    ours.answers["get_kv_connector_stats"] = "ours"
    assert conn.get_kv_connector_stats() == "ours"


def test_stats_and_metrics_classes_are_the_facades() -> None:
    stats = HybridMultiConnector.build_kv_connector_stats({"counters": {"requests": 1}})
    assert type(stats) is type(HybridOffloadConnector.build_kv_connector_stats({}))
    assert stats is not None and stats.data == {"counters": {"requests": 1}}


# ---- every hook vLLM's MultiConnector forwards --------------------------------------------
def test_every_hook_vllms_multiconnector_forwards_is_ours_too() -> None:
    """Read from vLLM's class: each base-class hook its MultiConnector overrides (to forward it
    to its children), the composition overrides as well; a hook a new vLLM adds is noticed."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, SupportsHMA
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

    hooks_of_base = set(dir(KVConnectorBase_V1)) | set(dir(SupportsHMA))
    forwarded = {n for n in vars(MultiConnector) if n in hooks_of_base and not n.startswith("__")}
    assert {"set_host_xfer_buffer_ops", "get_required_kvcache_layout", "get_finished_count"} <= forwarded
    assert sorted(forwarded - set(vars(HybridMultiConnector))) == []


def test_worker_hooks_reach_every_side(fake_facade) -> None:
    conn, ours = compose(child("a"), child("b"), role=WORKER)
    op, pool = object(), object()
    conn.set_host_xfer_buffer_ops(op)
    conn.reset_capture_state()
    conn.bind_gpu_block_pool(pool)
    for side in (ours, *conn.children.connectors):
        assert hooks(side, "set_host_xfer_buffer_ops") == [(op,)]
        assert hooks(side, "reset_capture_state") == [()]
        assert hooks(side, "bind_gpu_block_pool") == [(pool,)]


def test_the_block_pool_is_bound_once_per_side_with_the_cache_manager(fake_facade) -> None:
    conn, ours = compose(child("a"))
    manager = SimpleNamespace(block_pool=object())
    conn.bind_kv_cache_manager(manager)
    (side,) = conn.children.connectors
    assert hooks(side, "bind_gpu_block_pool") == [(manager.block_pool,)]
    assert ours.got("bind_kv_cache_manager") == [(manager,)] and ours.got("bind_gpu_block_pool") == []


def test_one_side_may_provide_the_memory_pool(fake_facade) -> None:
    conn, ours = compose(child("a"), child("b", mem_pool=True), role=WORKER)
    assert conn.get_mem_pool_context() is recorder(conn.children, 1).mem_pool
    ours.answers["get_mem_pool_context"] = "ours"
    with pytest.raises(ValueError, match=r"\['hybrid-offload', 'b'\]"):
        conn.get_mem_pool_context()


def test_finished_counts_follow_vllms_rule(fake_facade) -> None:
    conn, ours = compose(child("a", finished_count=2), child("b", finished_count=2), role=WORKER)
    assert conn.get_finished_count() is None  # our side expects none: vLLM's default
    ours.answers["get_finished_count"] = 2
    assert conn.get_finished_count() == 2
    recorder(conn.children, 1).finished_count = 3
    with pytest.raises(ValueError, match="different finished counts"):
        conn.get_finished_count()


def test_partial_tails_and_divergent_hits(fake_facade) -> None:
    conn, ours = compose(child("a"), child("b", partial_tail=True, divergent=True))
    request = SimpleNamespace(request_id=REQ)
    assert conn.register_finished_partial_tail(request, ([1],), [(0, 1, 2)]) is True
    assert all(hooks(c, "register_finished_partial_tail") == [(REQ,)] for c in conn.children.connectors)
    assert ours.got("register_finished_partial_tail") == [(request, ([1],), [(0, 1, 2)])]
    ours.supports_divergent_local_hybrid_hits = True
    assert conn.supports_divergent_local_hybrid_hits is False  # child "a" cannot
    recorder(conn.children, 0).divergent = True
    assert conn.supports_divergent_local_hybrid_hits is True


def test_class_level_hooks_ask_the_childrens_classes() -> None:
    """Asked before any connector is built: the KV cache layout a child requires (two that
    differ are refused) and whether one needs PIECEWISE CUDA graphs."""
    extra = {"backends": BACKENDS, "connectors": [child("a"), child("b", kvcache_layout="HND")]}
    assert HybridMultiConnector.get_required_kvcache_layout(vllm_config(extra)) == "HND"
    extra["connectors"].append(child("c", kvcache_layout="NHD"))
    with pytest.raises(ValueError, match="layout mismatch"):
        HybridMultiConnector.get_required_kvcache_layout(vllm_config(extra))
    assert HybridMultiConnector.get_required_kvcache_layout(vllm_config({"backends": BACKENDS})) is None
    piecewise = HybridMultiConnector.requires_piecewise_for_cudagraph
    assert not piecewise({"backends": BACKENDS, "connectors": [child("a")]})
    assert piecewise({"backends": BACKENDS, "connectors": [child("a"), child("b", piecewise=True)]})
