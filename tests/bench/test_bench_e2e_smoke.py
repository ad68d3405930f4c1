"""Smoke test of `hybrid-offload bench e2e --quick`: the real CLI, two real engine processes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybrid_offload.tools.cli.main import main

pytestmark = pytest.mark.e2e


def test_bench_e2e_quick_writes_rows_per_scenario_and_plots(model_dir, tmp_path: Path) -> None:
    model = model_dir("qwen3_next")  # the quick model: default layers and hidden size
    code = main(["bench", "e2e", "--quick", "--out", str(tmp_path), "--model-dir", str(model)])
    assert code == 0

    doc = json.loads((tmp_path / "e2e-quick.json").read_text())
    assert doc["bench"] == "e2e" and doc["quick"] is True
    assert "load_average_1m" in doc["machine"]
    lengths = doc["args"]["lengths"]
    rows = {(r["scenario"], r["length"]): r for r in doc["rows"]}
    for scenario in ("cold", "vllm", "cpu", "disk"):
        for length in lengths:
            row = rows[(scenario, length)]
            assert row["ttft_s"] > 0 and row["prefill_tok_s"] > 0, row
            assert row["speedup_vs_cold"] is not None
    for length in lengths:
        assert rows[("cold", length)]["hit_tokens"] == 0
        for scenario in ("vllm", "cpu", "disk"):
            assert rows[(scenario, length)]["hit_tokens"] > 0, (scenario, length)
        for scenario in ("cpu", "disk"):  # loads carry attention pages and Mamba/GDN state
            assert rows[(scenario, length)]["attn_bytes"] > 0 and rows[(scenario, length)]["mamba_bytes"] > 0
    for scenario in ("cpu", "disk"):  # bytes computed from page sizes = the worker's counters
        summary = doc["scenarios"][scenario]
        assert summary["worker"]["bytes_loaded"] == summary["computed_bytes_loaded"] > 0
        assert summary["loaded_tokens"][scenario] == summary["external_tokens"] > 0
    assert doc["ratios"]["speedup_vs_cold"]["disk"]
    in_engine = {r["tier"]: r for r in doc["in_engine"]}
    assert set(in_engine) == {"cpu", "disk"}
    for tier, row in in_engine.items():  # loads timed inside the engine, next to a same-run ceiling
        assert row["loads"] > 0 and row["engine_gbps"] > 0 and row["ceiling_gbps"] > 0, row
        assert row["ms_total"] >= row["ms_read"] > 0 and row["ms_write"] > 0, row
        assert doc["scenarios"][tier]["ceiling"]["objects_per_call"] >= 1
    stores = {r["tier"]: r for r in doc["in_engine_stores"]}  # the cold pass stored into both tiers
    assert set(stores) == {"copy_out", "cpu", "disk"}
    assert stores.pop("copy_out")["store_gbps"] > 0
    for row in stores.values():
        assert row["store_calls"] > 0 and row["pages_per_call"] >= 1 and row["KiB_per_page"] > 0, row
        assert row["store_gbps"] > 0 and row["ceiling_gbps"] > 0 and row["store_vs_ceiling"] > 0, row
    for suffix in ("ttft", "throughput", "speedup"):
        png = tmp_path / f"e2e-quick-{suffix}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
