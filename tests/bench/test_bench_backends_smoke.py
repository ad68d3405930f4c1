"""Smoke test: `hybrid-offload bench backends --quick` through the real CLI writes JSON + PNGs."""

from __future__ import annotations

import json
import os
from pathlib import Path

from hybrid_offload.tools.cli.main import main

OURS = {"cpu", "disk[io_threads=1]", "disk[io_threads=4]", "disk[segments]", "redis", "nixl_peer"}
CEILINGS = {"numpy copy", "pwritev/preadv", "redis-py pipeline", "redis-benchmark", "raw NIXL"}
LMCACHE = {"LMCache cpu", "LMCache disk", "LMCache redis"}


def test_bench_backends_quick(tmp_path: Path) -> None:
    leaked_before = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    assert main(["bench", "backends", "--quick", "--out", str(tmp_path)]) == 0
    # LMCache's metrics logger must not leave its shared directory to every later child process
    assert os.environ.get("PROMETHEUS_MULTIPROC_DIR") == leaked_before
    doc = json.loads((tmp_path / "backends-quick.json").read_text())
    systems = {(r["system"], r["op"]) for r in doc["rows"]}
    for system in OURS | CEILINGS | LMCACHE:
        assert (system, "store") in systems and (system, "load") in systems, system
    measured = [r for r in doc["rows"] if r["role"] in ("ours", "ceiling")]
    assert all(r["gbps"] and r["gbps"] > 0 for r in measured)
    restart = {r["system"]: r["fraction"] for r in doc["cross_restart"]}
    assert restart["cpu"] == 0 and restart["disk[io_threads=4]"] == 1 and restart["redis"] == 1
    assert restart["disk[segments]"] == 1 and restart["nixl_peer"] == 1
    assert doc["ratios"] and doc["summary"]
    pngs = sorted(p.name for p in tmp_path.glob("backends-quick-*.png"))
    assert any("gbps" in n for n in pngs) and any("latency" in n for n in pngs), pngs
