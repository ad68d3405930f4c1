"""``hybrid-offload bench load``: the workload generators (fast) and a real ``--quick`` run (e2e).

The quick run starts one real server (``cpu+disk``) through the CLI entry point, sends a
dozen shared-prefix and a dozen distinct streaming requests with 4 clients, and must write
``load-quick.json`` (no errors, a row per workload of each configuration, hit-rate fields)
and its three PNG plots into the given ``--out`` directory.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from hybrid_offload.tools.bench.load import QUICK_CONFIGS, backends_for, empty_disk_tiers
from hybrid_offload.tools.bench.load_client import WorkloadShape, distinct_workload, shared_prefix_workload
from hybrid_offload.tools.cli.main import main

SHAPE = WorkloadShape(docs=2, chats=2)


def test_shared_workload_is_seeded_and_repeats_prefixes() -> None:
    a = shared_prefix_workload(20, seed=1, shape=SHAPE)
    assert a == shared_prefix_workload(20, seed=1, shape=SHAPE)
    assert a != shared_prefix_workload(20, seed=2, shape=SHAPE)
    docs = [p for kind, p in a if kind == "doc"]
    chats = [p for kind, p in a if kind == "chat"]
    assert len(docs) == len(chats) == 10
    assert len({tuple(p[: SHAPE.doc_tokens]) for p in docs}) <= SHAPE.docs  # documents repeat
    system = chats[0][: SHAPE.system_tokens]
    assert all(p[: SHAPE.system_tokens] == system for p in chats)  # one shared system prompt
    assert all(len(p) <= 2048 for _, p in a)


def test_a_reused_workdir_starts_each_configuration_with_an_empty_disk_tier(tmp_path: Path) -> None:
    """Found running the committed benchmark twice with one --workdir: the second run's
    cpu+disk servers hit the first run's pages (93 % external hits on `distinct`)."""
    [disk] = [t for t in backends_for("cpu+disk", tmp_path, None) or [] if t["type"] == "disk"]
    old_page = Path(disk["path"]) / "ns" / "page"
    old_page.parent.mkdir(parents=True)
    old_page.write_bytes(b"an earlier run's page")
    empty_disk_tiers("cpu+disk", tmp_path)
    assert not Path(disk["path"]).exists()
    empty_disk_tiers("none", tmp_path)  # no connector, no disk: nothing to do


def test_distinct_workload_shares_nothing() -> None:
    shared = shared_prefix_workload(20, seed=3, shape=SHAPE)
    distinct = distinct_workload(20, seed=3, shape=SHAPE)
    assert [len(p) for _, p in distinct] == [len(p) for _, p in shared]
    assert len({tuple(p[:16]) for _, p in distinct}) == 20


@pytest.mark.e2e
def test_quick_run_writes_results(tmp_path: Path) -> None:
    began = time.monotonic()
    code = main(["bench", "load", "--quick", "--out", str(tmp_path)])
    elapsed = time.monotonic() - began
    doc = json.loads((tmp_path / "load-quick.json").read_text())
    assert code == 0, doc["rows"]
    assert doc["bench"] == "load" and doc["quick"] is True
    assert {r["config"] for r in doc["rows"]} == set(QUICK_CONFIGS)
    for config in QUICK_CONFIGS:
        workloads = sorted(r["workload"] for r in doc["rows"] if r["config"] == config)
        assert workloads == ["distinct", "shared"]
    for row in doc["rows"]:
        assert row["errors"] == 0, row["first_error"]
        assert row["requests"] == 12 and row["concurrency"] == 4
        assert row["req_per_s"] > 0 and row["ttft_p50_ms"] > 0 and row["out_tok_per_s"] > 0
        assert row["server_prompt_tokens"] > 0 and 0.0 <= row["ext_hit_rate"] <= 1.0
    for name in ("throughput", "ttft_p50", "ttft_p99"):
        png = tmp_path / f"load-quick-{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
    print(f"bench load --quick: {elapsed:.1f}s")
