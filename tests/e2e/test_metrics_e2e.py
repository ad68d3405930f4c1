"""End to end: connector stats through a real offline vLLM engine's own metrics pipeline.

A child process runs a session (falcon_h1, cpu tier, two passes over prompts that share
chunk-aligned prefixes) with vLLM's stat logging on: vLLM then calls the connector's
``get_kv_connector_stats`` on both roles every step, aggregates scheduler and worker stats,
and feeds them to its PrometheusStatLogger, whose registry the child scrapes at the end. The
child also records every payload the connector returned. No server is started.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from engine_runs import CHUNK_TOKENS, hit_rate, shared_prefix_prompts, tokens
from prometheus_client.parser import text_string_to_metric_families

from hybrid_offload.testing.session import ENGINE_ENV

pytestmark = pytest.mark.e2e

METRICS_CHILD = """
import json
import os
import sys

from prometheus_client import generate_latest

from hybrid_offload.connector import HybridOffloadConnector
from hybrid_offload.testing.session import run_session

exported = []
original = HybridOffloadConnector.get_kv_connector_stats


def recording(self):
    stats = original(self)
    if stats is not None:
        role = "scheduler" if self.scheduler is not None else "worker"
        exported.append({"role": role, "data": stats.to_dict()})
    return stats


HybridOffloadConnector.get_kv_connector_stats = recording
result = run_session(json.loads(open(sys.argv[1]).read()))
result["exported"] = exported
result["metrics"] = generate_latest().decode()
with open(sys.argv[2], "w") as out:
    out.write(json.dumps(result))
sys.stdout.flush()
os._exit(0)
"""


def run_child(spec: dict[str, Any], tmp_path: Path) -> dict[str, Any]:
    spec_path, out_path = tmp_path / "spec.json", tmp_path / "out.json"
    spec_path.write_text(json.dumps(spec))
    proc = subprocess.run(
        [sys.executable, "-c", METRICS_CHILD, str(spec_path), str(out_path)],
        env={**os.environ, **ENGINE_ENV},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=900,
        check=False,
    )
    assert proc.returncode == 0 and out_path.exists(), proc.stdout[-6000:]
    return json.loads(out_path.read_text())


def summed(exported: list[dict[str, Any]], backend: str, key: str) -> float:
    entries = (e["data"].get("backends", {}).get(backend, {}) for e in exported)
    return sum(entry.get("counters", {}).get(key, 0) for entry in entries)


def scraped(text: str, name: str, **labels: str) -> float:
    """The value of the one sample ``name`` whose labels include ``labels``."""
    found = [
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and labels.items() <= s.labels.items()
    ]
    assert len(found) == 1, (name, labels, found)
    return found[0]


def test_connector_stats_reach_vllms_prometheus_logger(model_dir, tmp_path: Path) -> None:
    arch = "falcon_h1"
    spec = {
        "model": str(model_dir(arch)),
        "prompts": shared_prefix_prompts(CHUNK_TOKENS[arch]),
        "max_tokens": 4,
        "reset_prefix_cache": "request",
        "passes": 2,
        "connector": {"backends": [{"type": "cpu", "name": "cpu", "capacity_bytes": "256MiB"}]},
    }
    result = run_child(spec, tmp_path)
    assert tokens(result, 1) == tokens(result, 0)
    assert hit_rate(result, 1, "cpu") >= 0.99  # the repeated prompts load from the cpu tier

    exported = result["exported"]
    assert {e["role"] for e in exported} == {"scheduler", "worker"}
    scheduler_total = sum(p["scheduler"]["backends"]["cpu"]["loaded_tokens"] for p in result["passes"])
    lookups_total = sum(p["scheduler"]["backends"]["cpu"]["lookups"] for p in result["passes"])
    # deltas add up exactly to the in-process counters (no step lost or counted twice)
    assert summed(exported, "cpu", "loaded_tokens") == scheduler_total > 0
    assert summed(exported, "cpu", "loaded_pages") > 0
    assert summed(exported, "cpu", "stored_pages") > 0

    text = result["metrics"]
    cpu = {"backend": "cpu", "engine": "0"}
    assert scraped(text, "hybrid_offload_loaded_tokens_total", **cpu) == scheduler_total
    assert scraped(text, "hybrid_offload_lookups_total", **cpu) >= lookups_total > 0
    assert scraped(text, "hybrid_offload_loaded_pages_total", **cpu) > 0
    assert scraped(text, "hybrid_offload_stored_bytes_total", **cpu) > 0
    assert scraped(text, "hybrid_offload_load_seconds_count", **cpu) > 0
    assert scraped(text, "hybrid_offload_store_seconds_count", **cpu) > 0
    for group in ("0", "1"):  # falcon_h1: attention and Mamba groups both covered
        assert scraped(text, "hybrid_offload_group_hit_tokens_total", group=group, **cpu) > 0
    assert scraped(text, "hybrid_offload_backend_available", **cpu) == 1
    assert scraped(text, "hybrid_offload_capacity_bytes", **cpu) == 256 * 2**20
    assert 0 < scraped(text, "hybrid_offload_capacity_used_bytes", **cpu) <= 256 * 2**20
    assert scraped(text, "hybrid_offload_errors_total", kind="bad_page", **cpu) == 0
    assert scraped(text, "hybrid_offload_requests_total", engine="0") > 0
    assert scraped(text, "hybrid_offload_external_tokens_total", engine="0") == scheduler_total
    # coverage: every request admitted was served all that earlier requests shared with it
    served = sum(p["scheduler"]["served_tokens"] for p in result["passes"])
    assert served == scheduler_total
    assert scraped(text, "hybrid_offload_served_tokens_total", engine="0") == served
    assert scraped(text, "hybrid_offload_reusable_tokens_total", engine="0") == served
    for reason in ("no_state", "evicted", "backend_down"):
        assert scraped(text, "hybrid_offload_lost_tokens_total", reason=reason, engine="0") == 0
    # where the loads' time went: the phases add up to the total
    loads = scraped(text, "hybrid_offload_loads_written_total", engine="0")
    assert loads == result["passes"][-1]["worker_total"]["loads_written"] > 0
    phases = {
        phase: scraped(text, "hybrid_offload_load_phase_seconds_total", phase=phase, engine="0")
        for phase in ("queued", "prepare", "read", "verify", "ready", "write", "total")
    }
    assert phases["total"] > 0 and phases["read"] > 0 and phases["write"] > 0
    assert sum(v for k, v in phases.items() if k != "total") == pytest.approx(phases["total"], rel=1e-6)
