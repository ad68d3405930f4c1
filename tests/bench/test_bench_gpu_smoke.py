"""``bench gpu`` on the CPU taking the GPU's code paths (``--device cpu+gpu-path --quick``): the
benchmark the device run relies on stays runnable here, its rows identical, the whole-path
figures present and the churn case (loads against concurrent re-stores) free of bad pages."""

from __future__ import annotations

import json
from pathlib import Path

from hybrid_offload.tools.bench.gpu import main


def test_a_quick_run_on_the_gpu_paths(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr("sys.argv", ["gpu", "--device", "cpu+gpu-path", "--quick", "--layouts", "LBNHC",
                                     "--out", str(tmp_path)])
    assert main() == 0
    result = json.loads((tmp_path / "gpu-quick.json").read_text())
    assert result["rows"] and all(row["identical"] for row in result["rows"])
    for row in result["rows"]:
        assert row["load_runner_cpu_ms"] >= 0 and row["store_step_runner_cpu_ms"] > 0
    churn = result["churn"]
    assert churn["loads"] == 4 and churn["failed"] == 0 and churn["bad_pages"] == 0
