"""Connector metrics through vLLM's hooks: the stats class, the Prometheus adapter (real
prometheus_client, scraped with generate_latest), and the counters the scheduler and worker
keep at their backend call sites."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from scheduler_world import (
    FakeRequest,
    cpu_config,
    flaky_disk,
    make_spec,
    prompt,
    start_load,
)
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging, KVConnectorProm
from worker_world import MAMBA, attn_page_len, cpu, first_page_len, load_job, stored_world, unavailable
from worker_world import make_spec as make_worker_spec

from hybrid_offload.backends import BackendUnavailableError
from hybrid_offload.connector import HybridOffloadConnector
from hybrid_offload.connector.metadata import StoreJob
from hybrid_offload.connector.prometheus import HybridOffloadPromMetrics, HybridOffloadStats
from hybrid_offload.connector.worker.page_codec import PageCodec
from hybrid_offload.core.metrics import ERROR_KINDS, StatsDelta
from hybrid_offload.testing.session import kv_transfer_config

LABELNAMES = ["model_name", "engine"]
ENGINES = {0: ["tiny", "0"], 1: ["tiny", "1"]}
EXTRA = {"backends": [{"type": "cpu", "name": "cpu", "capacity_bytes": "1MiB"}]}


def vllm_config(extra: dict[str, Any] | None = None) -> SimpleNamespace:
    """The part of a VllmConfig that vLLM's connector metric classes read."""
    return SimpleNamespace(kv_transfer_config=KVTransferConfig(**kv_transfer_config(extra or EXTRA)))


def scrape() -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every hybrid_offload_* sample in the default registry: (name, sorted labels) -> value."""
    out = {}
    for family in text_string_to_metric_families(generate_latest(REGISTRY).decode()):
        for s in family.samples:
            if s.name.startswith("hybrid_offload_") and not s.name.endswith("_created"):
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def labels(engine: str = "0", **more: str) -> tuple[tuple[str, str], ...]:
    return tuple(sorted({"model_name": "tiny", "engine": engine, **more}.items()))


PAYLOAD = {
    "counters": {"requests": 2, "aligned_prompt_tokens": 768, "external_tokens": 384, "stores_dropped": 1},
    "backends": {
        "cpu": {
            "counters": {
                "lookups": 2,
                "hit_tokens": 384,
                "miss_tokens": 384,
                "loaded_tokens": 384,
                "loaded_bytes": 4096,
                "loaded_pages": 2,
                "stored_bytes": 8192,
                "stored_pages": 4,
                "evictions": 1,
                "load_calls": 1,
            },
            "errors": {"get": 1, "bad_page": 2},
            "group_hit_tokens": {"0": 384, "1": 256},
            "gauges": {"available": 1, "used_bytes": 8192, "capacity_bytes": 1 << 20},
            "samples": {"load_seconds": [0.0004, 0.02], "store_seconds": [0.003]},
        }
    },
}


@pytest.fixture
def prom() -> KVConnectorProm:
    """vLLM's KVConnectorProm resolving our connector class from kv_transfer_config, as the
    API server's PrometheusStatLogger does."""
    built = KVConnectorProm(vllm_config(), LABELNAMES, ENGINES)
    assert isinstance(built.prom_metrics, HybridOffloadPromMetrics)
    return built


def test_prometheus_names_labels_and_values(prom: KVConnectorProm) -> None:
    prom.observe(PAYLOAD, engine_idx=1)
    got = scrape()
    cpu1 = labels("1", backend="cpu")
    expected = {
        "hybrid_offload_lookups_total": 2,
        "hybrid_offload_hit_tokens_total": 384,
        "hybrid_offload_miss_tokens_total": 384,
        "hybrid_offload_loaded_tokens_total": 384,
        "hybrid_offload_loaded_bytes_total": 4096,
        "hybrid_offload_loaded_pages_total": 2,
        "hybrid_offload_stored_bytes_total": 8192,
        "hybrid_offload_stored_pages_total": 4,
        "hybrid_offload_evictions_total": 1,
        "hybrid_offload_backend_available": 1,
        "hybrid_offload_capacity_used_bytes": 8192,
        "hybrid_offload_capacity_bytes": 1 << 20,
        "hybrid_offload_load_seconds_count": 2,
        "hybrid_offload_store_seconds_count": 1,
    }
    for name, value in expected.items():
        assert got[(name, cpu1)] == value, name
    assert got[("hybrid_offload_load_seconds_sum", cpu1)] == pytest.approx(0.0204)
    assert got[("hybrid_offload_load_seconds_bucket", labels("1", backend="cpu", le="0.0005"))] == 1
    assert got[("hybrid_offload_errors_total", labels("1", backend="cpu", kind="get"))] == 1
    assert got[("hybrid_offload_errors_total", labels("1", backend="cpu", kind="bad_page"))] == 2
    assert got[("hybrid_offload_group_hit_tokens_total", labels("1", backend="cpu", group="1"))] == 256
    assert got[("hybrid_offload_requests_total", labels("1"))] == 2
    assert got[("hybrid_offload_aligned_prompt_tokens_total", labels("1"))] == 768
    assert got[("hybrid_offload_external_tokens_total", labels("1"))] == 384
    assert got[("hybrid_offload_stores_dropped_total", labels("1"))] == 1
    assert got[("hybrid_offload_failed_loads_total", labels("1"))] == 0
    # engine 0 saw nothing: its configured series exist at 0, its gauges are not invented
    assert got[("hybrid_offload_lookups_total", labels("0", backend="cpu"))] == 0
    for kind in ERROR_KINDS:
        assert got[("hybrid_offload_errors_total", labels("0", backend="cpu", kind=kind))] == 0
    assert ("hybrid_offload_backend_available", labels("0", backend="cpu")) not in got
    # only our prefix, counters end in _total
    counters = {n for n, _ in got if n.endswith("_total")}
    assert "hybrid_offload_load_calls_total" not in counters  # internal counters stay internal


def test_counters_add_deltas_gauges_keep_the_last_value(prom: KVConnectorProm) -> None:
    prom.observe(PAYLOAD)
    prom.observe({"backends": {"cpu": {"counters": {"lookups": 3}, "gauges": {"available": 0}}}})
    prom.observe({"backends": {"cpu": {"counters": {"loaded_tokens": 1}}}})
    got = scrape()
    cpu0 = labels(backend="cpu")
    assert got[("hybrid_offload_lookups_total", cpu0)] == 5
    assert got[("hybrid_offload_loaded_tokens_total", cpu0)] == 385
    assert got[("hybrid_offload_backend_available", cpu0)] == 0
    assert got[("hybrid_offload_capacity_used_bytes", cpu0)] == 8192  # not in the later payloads


@pytest.mark.parametrize(
    "junk",
    [
        {},
        {"counters": None},
        {"backends": {"cpu": {"counters": {"lookups": -5, "loaded_tokens": "9"}}}},
        {"backends": {"cpu": {"gauges": {"available": float("nan")}, "samples": {"load_seconds": [-1]}}}},
        {"backends": ["cpu"]},
        {"backends": {"cpu": {"counters": {"brand_new_counter": 5}}}},
    ],
)
def test_malformed_or_unknown_payloads_change_nothing_and_never_raise(prom: KVConnectorProm, junk) -> None:
    before = scrape()
    prom.observe(junk)
    prom.observe(junk, engine_idx=7)  # an engine without labels
    assert scrape() == before


def test_a_second_stat_logger_in_the_same_process_registers_again() -> None:
    first = KVConnectorProm(vllm_config(), LABELNAMES, ENGINES)
    second = KVConnectorProm(vllm_config(), LABELNAMES, ENGINES)  # no "Duplicated timeseries"
    second.observe({"counters": {"requests": 1}})
    first.observe({"counters": {"requests": 5}})  # the replaced logger's metrics are unregistered
    assert scrape()[("hybrid_offload_requests_total", labels())] == 1


def test_unreadable_connector_config_still_gives_metrics() -> None:
    prom = KVConnectorProm(vllm_config({"backends": "nonsense"}), LABELNAMES, ENGINES)
    prom.observe({"backends": {"redis": {"counters": {"lookups": 1}}}})
    got = scrape()
    assert got[("hybrid_offload_lookups_total", labels(backend="redis"))] == 1
    assert ("hybrid_offload_lookups_total", labels(backend="cpu")) not in got


def test_stats_class_aggregate_reduce_reset_and_rebuild() -> None:
    worker = HybridOffloadConnector.build_kv_connector_stats(PAYLOAD)
    sched = HybridOffloadConnector.build_kv_connector_stats({"counters": {"requests": 1}, "junk": 1})
    assert isinstance(worker, HybridOffloadStats) and isinstance(sched, HybridOffloadStats)
    merged = worker.aggregate(sched)
    assert merged.to_dict()["counters"]["requests"] == 3
    assert worker.to_dict()["counters"]["requests"] == 2  # inputs untouched
    assert merged.reduce()["cpu loaded_tokens"] == 384
    empty = HybridOffloadConnector.build_kv_connector_stats(None)
    assert empty is not None and empty.is_empty() and empty.reduce() == {}
    assert not merged.is_empty()
    merged.reset()
    assert merged.is_empty() and merged.to_dict() == {}
    assert HybridOffloadStats(data="garbage").is_empty()  # type: ignore[arg-type]


def test_vllm_log_line_uses_reduce() -> None:
    logging = KVConnectorLogging(vllm_config().kv_transfer_config)
    logging.observe(PAYLOAD)
    logging.observe({"counters": {"requests": 1}})
    lines: list[str] = []
    logging.log(lambda fmt, *args: lines.append(fmt % args))
    assert len(lines) == 1 and "requests=3" in lines[0] and "cpu loaded_tokens=384" in lines[0]


# ---- what the connector sides count --------------------------------------------------------
def test_scheduler_counts_lookups_hits_misses_groups_and_loads(worlds) -> None:
    w = worlds(make_spec(8, 8), 8)
    delta = StatsDelta(w.sched.stats)
    tokens = prompt(28)  # aligned prefix: 24 tokens (3 chunks)
    w.hold("cpu", w.chunk_keys(tokens, range(2), groups=(0,)) + w.chunk_keys(tokens, range(1), groups=(1,)))
    assert w.sched.get_num_new_matched_tokens(FakeRequest("a", tokens), 0) == (8, True)
    w.hold("cpu", w.chunk_keys(tokens, range(3)))
    start_load(w, FakeRequest("b", tokens), 0, ([1, 2, 3], [4, 5, 6]))
    w.sched.refresh_gauges()
    payload = delta.take()
    assert payload["counters"].pop("lookup_calls") == 2
    assert payload["counters"].pop("lookup_seconds") > 0  # timed (see test_connector_scheduler)
    assert payload["counters"] == {
        "requests": 2,
        "aligned_prompt_tokens": 48,
        "external_tokens": 24,
        "group_disagreements": 1,  # request a: attention could load 16 tokens, Mamba 8
        "served_tokens": 24,  # request b, admitted: all of what earlier traffic shared
        "reusable_tokens": 24,
    }
    cpu = payload["backends"]["cpu"]
    assert cpu["counters"] == {"lookups": 2, "hit_tokens": 32, "miss_tokens": 16, "loaded_tokens": 24}
    # group 0 (attention) alone could load 16 then 24 tokens, group 1 (Mamba) 8 then 24
    assert cpu["group_hit_tokens"] == {"0": 40, "1": 32}
    assert cpu["gauges"] == {"available": 1, "capacity_bytes": 1 << 30}


def test_scheduler_counts_lookup_errors_and_skips(worlds, tmp_path: Path) -> None:
    w = worlds(make_spec(8, 8), 8, backends=(cpu_config(), flaky_disk(tmp_path / "r")))
    delta = StatsDelta(w.sched.stats)
    w.faulty("redis").fail("contains_batch", times=None)
    w.sched.get_num_new_matched_tokens(FakeRequest("r1", prompt(28)), 0)
    w.sched.get_num_new_matched_tokens(FakeRequest("r2", prompt(28)), 0)  # skipped: backing off
    w.sched.refresh_gauges()
    redis = delta.take()["backends"]["redis"]
    assert redis["errors"] == {"lookup": 1, "skipped": 1}
    assert redis["gauges"]["available"] == 0


def test_worker_counts_stores_loads_latency_usage_and_evictions(world) -> None:
    spec = make_worker_spec()
    mamba_len = first_page_len(PageCodec(spec, spec.groups[MAMBA], 8))
    small = cpu(capacity=2 * attn_page_len() + mamba_len)  # 3 attention + 1 Mamba page stored: 1 evicted
    w, pages, _ = stored_world(world, small)  # stored deepest first: the Mamba page goes first
    delta = StatsDelta(w.worker.stats)
    w.worker.start_loads([load_job((pages[0], pages[1]), "cpu", "r")])
    assert w.finish("r") == ({"r"}, set())
    w.worker.refresh_gauges()
    cpu_entry = delta.take()["backends"]["cpu"]
    counters = cpu_entry["counters"]
    assert counters["stored_pages"] == 4 and counters["evictions"] >= 1
    assert counters["loaded_pages"] == 2 and counters["loaded_bytes"] > 0
    assert counters["store_calls"] == 1 and counters["load_calls"] == 1
    assert len(cpu_entry["samples"]["store_seconds"]) == 1 and len(cpu_entry["samples"]["load_seconds"]) == 1
    gauges = cpu_entry["gauges"]
    assert gauges["available"] == 1 and gauges["capacity_bytes"] == small.capacity_bytes
    assert 0 < gauges["used_bytes"] <= small.capacity_bytes


def test_worker_counts_errors_by_kind(world) -> None:
    w, pages, _ = stored_world(world, unavailable("flaky"))
    delta = StatsDelta(w.worker.stats)
    w.backend("flaky").delete_batch([pages[0].key])
    w.worker.start_loads([load_job((pages[0],), "flaky", "missing")])
    assert w.finish("missing") == ({"missing"}, {"missing"})
    w.faulty("flaky").fail(times=None, error=BackendUnavailableError("down"))
    w.worker.start_loads([load_job((pages[1],), "flaky", "down")])
    assert w.finish("down") == ({"down"}, {"down"})
    w.worker.copy_out([StoreJob(pages[1], ("flaky",))])  # skipped: backing off
    w.worker.flush(10)
    w.worker.refresh_gauges()
    entry = delta.take()["backends"]["flaky"]
    assert entry["errors"] == {"missing_page": 1, "get": 1, "skipped": 1}
    assert entry["gauges"]["available"] == 0


def test_facade_returns_stats_objects_of_deltas_and_none_when_idle(world) -> None:
    w, _, _ = stored_world(world)
    conn = object.__new__(HybridOffloadConnector)  # the facade's stats path without a vLLM config
    conn._side, conn._stats_delta = w.worker, StatsDelta(w.worker.stats)
    first = conn.get_kv_connector_stats()
    assert isinstance(first, HybridOffloadStats)
    assert first.to_dict()["backends"]["cpu"]["counters"]["stored_pages"] == 4
    assert conn.get_kv_connector_stats() is None

    def broken() -> None:
        raise RuntimeError("boom")

    conn._side = SimpleNamespace(refresh_gauges=broken)
    assert conn.get_kv_connector_stats() is None  # logged, never raised into vLLM


def test_worker_counts_store_batches_that_fail_unexpectedly(world, caplog) -> None:
    """A store batch that raises something no backend should (a bug, not a BackendError) is
    logged and counted (``store_batch_errors``, exported as
    hybrid_offload_store_batch_errors_total); the store thread goes on storing."""
    w, pages, _ = stored_world(world, unavailable("flaky"))
    delta = StatsDelta(w.worker.stats)
    w.faulty("flaky").fail(times=None, error=RuntimeError("a bug in a backend"))
    w.worker.copy_out([StoreJob(pages[0], ("flaky",))])
    w.worker.flush(10)
    assert "store batch failed" in caplog.text
    assert delta.take()["counters"]["store_batch_errors"] == 1
    w.faulty("flaky").heal()
    w.worker.copy_out([StoreJob(pages[1], ("flaky",))])  # the store thread survived
    w.worker.flush(10)
    assert delta.take()["backends"]["flaky"]["counters"]["stored_pages"] == 1


def test_store_batch_errors_reach_prometheus(prom: KVConnectorProm) -> None:
    prom.observe({"counters": {"store_batch_errors": 2}}, engine_idx=0)
    assert scrape()[("hybrid_offload_store_batch_errors_total", labels())] == 2
