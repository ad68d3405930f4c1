"""Plain-data metrics: counters -> delta payloads, merging, cleaning, thread safety."""

from __future__ import annotations

import copy
import math
import re
import threading
from pathlib import Path
from typing import Any

import pytest

from hybrid_offload.core.metrics import (
    GAUGE_REFRESH_S,
    MAX_SAMPLES,
    Locked,
    SchedulerCounters,
    StatsDelta,
    WorkerCounters,
    clean_payload,
    merge_payloads,
    payload_is_empty,
    summarize,
)


def test_take_reports_deltas_since_the_previous_take() -> None:
    stats = Locked(SchedulerCounters())
    delta = StatsDelta(stats)
    assert delta.take() == {}
    with stats.lock:
        stats.counters.requests += 2
        stats.counters.backend("cpu").record_lookup(256, 384, {"0": 256, "1": 128})
    first = delta.take()
    assert first["counters"] == {"requests": 2}
    cpu = first["backends"]["cpu"]
    assert cpu["counters"] == {"lookups": 1, "hit_tokens": 256, "miss_tokens": 128}
    assert cpu["group_hit_tokens"] == {"0": 256, "1": 128}
    assert delta.take() == {}  # nothing new
    with stats.lock:
        stats.counters.requests += 1
        stats.counters.backend("cpu").record_lookup(0, 384, {"0": 0, "1": 0})
    second = delta.take()
    assert second["counters"] == {"requests": 1}
    assert second["backends"]["cpu"]["counters"] == {"lookups": 1, "miss_tokens": 384}
    assert "group_hit_tokens" not in second["backends"]["cpu"]  # zero deltas are left out
    assert stats.snapshot()["requests"] == 3  # the cumulative counters are untouched


def test_errors_and_latency_samples_go_out_once() -> None:
    stats = Locked(WorkerCounters())
    delta = StatsDelta(stats)
    stats.record_error("redis", "put")
    stats.record_error("redis", "skipped", 3)
    stats.record_call("redis", "store", 0.002)
    stats.record_call("redis", "load", 0.001)
    stats.record_call("redis", "load", 0.003)
    redis = delta.take()["backends"]["redis"]
    assert redis["errors"] == {"put": 1, "skipped": 3}
    assert redis["samples"] == {"load_seconds": [0.001, 0.003], "store_seconds": [0.002]}
    assert redis["counters"]["load_calls"] == 2 and redis["counters"]["store_calls"] == 1
    assert math.isclose(redis["counters"]["load_seconds"], 0.004)
    assert delta.take() == {}
    assert stats.snapshot()["backends"]["redis"]["errors"] == {"put": 1, "skipped": 3}


def test_latency_samples_are_bounded_between_takes() -> None:
    stats = Locked(WorkerCounters())
    for i in range(MAX_SAMPLES + 10):
        stats.record_call("cpu", "load", float(i))
    payload = StatsDelta(stats).take()
    samples = payload["backends"]["cpu"]["samples"]["load_seconds"]
    assert len(samples) == MAX_SAMPLES and samples[-1] == MAX_SAMPLES + 9  # the newest kept
    assert payload["backends"]["cpu"]["counters"]["load_calls"] == MAX_SAMPLES + 10  # all counted


def test_gauges_go_out_on_change_with_other_data_and_on_refresh() -> None:
    clock = [0.0]
    stats = Locked(WorkerCounters())
    delta = StatsDelta(stats, clock=lambda: clock[0])
    stats.update_backend("cpu", available=1, capacity_bytes=1000)
    assert delta.take() == {"backends": {"cpu": {"gauges": {"available": 1, "capacity_bytes": 1000}}}}
    assert delta.take() == {}  # unchanged, not due
    stats.update_backend("cpu", used_bytes=10)
    assert delta.take()["backends"]["cpu"]["gauges"]["used_bytes"] == 10
    stats.record_error("cpu", "get")
    gauges = delta.take()["backends"]["cpu"]["gauges"]
    assert gauges == {"available": 1, "used_bytes": 10, "capacity_bytes": 1000}
    clock[0] += GAUGE_REFRESH_S
    assert delta.take()["backends"]["cpu"]["gauges"]["available"] == 1  # periodic refresh
    stats.update_backend("cpu", used_bytes=None)  # None leaves the value as it is
    assert stats.snapshot()["backends"]["cpu"]["used_bytes"] == 10


def test_evictions_follow_the_backends_count_and_never_go_down() -> None:
    stats = Locked(WorkerCounters())
    delta = StatsDelta(stats)
    stats.update_backend("cpu", evictions=5)
    assert delta.take()["backends"]["cpu"]["counters"] == {"evictions": 5}
    stats.update_backend("cpu", evictions=3)  # e.g. a re-created backend object
    assert delta.take() == {}
    stats.update_backend("cpu", evictions=7)
    assert delta.take()["backends"]["cpu"]["counters"] == {"evictions": 2}


def test_a_counter_going_backwards_reports_nothing_and_rebases() -> None:
    stats = Locked(SchedulerCounters())
    delta = StatsDelta(stats)
    with stats.lock:
        stats.counters.requests = 10
    delta.take()
    with stats.lock:
        stats.counters.requests = 4
    assert delta.take() == {}
    with stats.lock:
        stats.counters.requests = 6
    assert delta.take()["counters"] == {"requests": 2}


def scheduler_payload() -> dict[str, Any]:
    stats = Locked(SchedulerCounters())
    with stats.lock:
        stats.counters.requests = 2
        stats.counters.external_tokens = 256
        cpu = stats.counters.backend("cpu")
        cpu.record_lookup(256, 384, {"0": 256})
        cpu.loaded_tokens = 256
    stats.record_error("cpu", "skipped")
    stats.update_backend("cpu", available=1, capacity_bytes=1 << 20)
    return StatsDelta(stats).take()


def worker_payload(available: int, used: int) -> dict[str, Any]:
    stats = Locked(WorkerCounters())
    with stats.lock:
        stats.counters.stores_dropped = 1
        cpu = stats.counters.backend("cpu")
        cpu.loaded_pages, cpu.loaded_bytes = 4, 4096
    stats.record_error("cpu", "skipped")
    stats.record_call("cpu", "load", 0.01)
    stats.update_backend("cpu", available=available, used_bytes=used, capacity_bytes=1 << 20)
    return StatsDelta(stats).take()


def test_merge_scheduler_and_several_workers() -> None:
    sched, w0, w1 = scheduler_payload(), worker_payload(1, 100), worker_payload(0, 300)
    inputs = copy.deepcopy([sched, w0, w1])
    merged = merge_payloads(merge_payloads(w0, w1), sched)
    assert [sched, w0, w1] == inputs  # inputs untouched
    assert merged["counters"] == {"requests": 2, "external_tokens": 256, "stores_dropped": 2}
    cpu = merged["backends"]["cpu"]
    assert cpu["counters"]["loaded_tokens"] == 256 and cpu["counters"]["lookups"] == 1
    assert cpu["counters"]["loaded_pages"] == 8 and cpu["counters"]["loaded_bytes"] == 8192
    assert cpu["errors"] == {"skipped": 3}
    assert cpu["group_hit_tokens"] == {"0": 256}
    assert cpu["samples"]["load_seconds"] == [0.01, 0.01]
    # down anywhere is down; sizes are not summed (a shared backend reports the same usage twice)
    assert cpu["gauges"] == {"available": 0, "used_bytes": 300, "capacity_bytes": 1 << 20}
    assert merge_payloads(w1, merge_payloads(w0, sched)) == merged  # order does not matter


def test_merge_with_empty_and_unknown_gauge() -> None:
    payload = {"backends": {"x": {"gauges": {"new_gauge": 3}}}}
    assert merge_payloads({}, payload) == payload
    assert merge_payloads(payload, {"backends": {"x": {"gauges": {"new_gauge": 5}}}}) == {
        "backends": {"x": {"gauges": {"new_gauge": 5}}}
    }
    assert merge_payloads({}, {}) == {}


@pytest.mark.parametrize(
    "junk",
    [
        None,
        [],
        "counters",
        42,
        {"counters": "x", "backends": ["cpu"]},
        {"counters": {"requests": -3, "x": "7", "y": float("nan"), "z": float("inf"), 5: 1}},
        {"backends": {"cpu": None, 7: {"counters": {"lookups": 1}}}},
        {"backends": {"cpu": {"counters": [1, 2], "errors": {"get": -1}, "samples": {"load_seconds": "x"}}}},
        {"backends": {"cpu": {"samples": {"load_seconds": [None, -1.0, float("nan"), "0.1"]}}}},
    ],
)
def test_malformed_payloads_clean_to_nothing(junk: Any) -> None:
    assert clean_payload(junk) == {}
    assert payload_is_empty(clean_payload(junk))
    assert merge_payloads(junk if isinstance(junk, dict) else {}, {}) == {}


def test_clean_keeps_good_values_and_unknown_names_from_newer_peers() -> None:
    raw = {
        "version": 9,  # unknown section: dropped
        "counters": {"requests": 1, "future_counter": 2, "bad": -1},
        "backends": {
            "cpu": {
                "counters": {"lookups": 1, "future": 1.5, "flag": True},
                "errors": {"get": 2, "future_kind": 1},
                "gauges": {"available": 0, "used_bytes": "12"},
                "samples": {"load_seconds": [0.1, "x", 0.2], "future_seconds": [1.0]},
                "future_section": {"a": 1},
            }
        },
    }
    assert clean_payload(raw) == {
        "counters": {"requests": 1, "future_counter": 2},
        "backends": {
            "cpu": {
                "counters": {"lookups": 1, "future": 1.5, "flag": 1},
                "errors": {"get": 2, "future_kind": 1},
                "gauges": {"available": 0},
                "samples": {"load_seconds": [0.1, 0.2], "future_seconds": [1.0]},
            }
        },
    }


def test_concurrent_updates_while_taking_give_exact_totals_and_no_negative_deltas() -> None:
    stats = Locked(WorkerCounters())
    delta = StatsDelta(stats)
    threads, per_thread = 4, 1000  # 4000 samples < MAX_SAMPLES: none may be dropped
    start = threading.Barrier(threads + 1)

    def work(i: int) -> None:
        start.wait()
        for _ in range(per_thread):
            with stats.lock:
                stats.counters.pages_loaded += 1
                stats.counters.backend("cpu").loaded_bytes += 10
            stats.record_call("cpu", "load", 0.001)
            stats.record_error("cpu", "get")
            stats.update_backend("cpu", used_bytes=i, evictions=i)

    workers = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for t in workers:
        t.start()
    payloads = []
    start.wait()
    while any(t.is_alive() for t in workers):
        payloads.append(delta.take())
    for t in workers:
        t.join()
    payloads.append(delta.take())

    totals: dict[str, float] = {}
    samples = 0
    for p in payloads:
        cpu = p.get("backends", {}).get("cpu", {})
        for key, value in [*p.get("counters", {}).items(), *cpu.get("counters", {}).items()]:
            assert value > 0
            totals[key] = totals.get(key, 0) + value
        for value in cpu.get("errors", {}).values():
            assert value > 0
            totals["errors"] = totals.get("errors", 0) + value
        samples += len(cpu.get("samples", {}).get("load_seconds", []))
    n = threads * per_thread
    assert totals["pages_loaded"] == n and totals["loaded_bytes"] == 10 * n
    assert totals["load_calls"] == n and totals["errors"] == n and samples == n
    assert totals.get("evictions", 0) == threads - 1
    assert len(payloads) > 2  # stats were really taken while the threads ran


def test_summarize_for_the_log_line() -> None:
    merged = merge_payloads(scheduler_payload(), worker_payload(1, 100))
    summary = summarize(merged)
    assert summary["requests"] == 2 and summary["external_tokens"] == 256
    assert summary["cpu loaded_tokens"] == 256 and summary["cpu lookups"] == 1
    assert summary["cpu avg load ms"] == 10.0 and summary["cpu errors"] == 2
    assert summary["cpu available"] == 1
    assert summarize({}) == {}


def test_counters_change_through_locked_methods() -> None:
    stats = Locked(WorkerCounters())
    stats.add(pages_loaded=2, bytes_loaded=10)
    stats.add_backend("cpu", stored_pages=3, store_failures=1)
    stats.update(lambda c: c.add_loaded("disk", 1, 5))
    snap = stats.snapshot()
    assert (snap["pages_loaded"], snap["bytes_loaded"]) == (3, 15)
    assert snap["backends"]["cpu"]["stored_pages"] == 3 and snap["backends"]["cpu"]["store_failures"] == 1
    assert snap["backends"]["disk"]["loaded_bytes"] == 5
    with pytest.raises(AttributeError):
        stats.add(no_such_counter=1)


def _counters_at_call_sites(root: Path) -> list[str]:
    """Lines outside core/metrics.py that take a stats lock themselves."""
    out = []
    for path in sorted([*(root / "hybrid_offload").rglob("*.py"), *(root / "backends").rglob("*.py")]):
        if path.name == "metrics.py" and path.parent.name == "core":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"\bstats\.lock\b", line):
                out.append(f"{path.relative_to(root)}:{n}: {line.strip()}")
    return out


def test_no_counters_at_call_sites(tmp_path: Path) -> None:
    """Issue 46: counters change through :class:`Locked`'s methods, which take its lock."""
    root = Path(__file__).resolve().parents[2]
    assert _counters_at_call_sites(root) == []
    (tmp_path / "hybrid_offload").mkdir()
    (tmp_path / "backends").mkdir()
    (tmp_path / "hybrid_offload" / "x.py").write_text("with self.ctx.stats.lock:\n    pass\n")
    assert _counters_at_call_sites(tmp_path) == ["hybrid_offload/x.py:1: with self.ctx.stats.lock:"]
