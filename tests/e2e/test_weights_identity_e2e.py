"""End to end (issue 14 H3): weights replaced in place are a new model, never served old pages.

vLLM's default multi-process engine runs a chat (turns carry the generated replies) on a
float32 model and stores it on disk, with pages signed under a cache secret. The weights file
is then rewritten in the same directory with another model's weights (config.json unchanged,
same tensor names, shapes and file size). A new engine on the same disk and secret must load
nothing the old engine stored (its first wave, identical prompts, gets 0 tokens from the
cache) and produce its own model's tokens, which differ from the old model's.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hybrid_offload.testing.models import build_model
from hybrid_offload.tools.bench.traffic import SIZES
from hybrid_offload.tools.bench.workload_run import run_engine_subprocess

pytestmark = pytest.mark.e2e

ARCH = "falcon_h1"
#: two turns are enough to show pages that load (the next turn) and pages that must not
CHAT = {**SIZES["small"]["chat"], "turns": 2, "reply": 32}


def served(run: dict, wave: int) -> int:
    return sum(r["report"]["served_tokens"] for r in run["workloads"]["chat"]["waves"][wave])


def outputs(run: dict, wave: int) -> list[list[int]]:
    return [r["output"] for r in run["workloads"]["chat"]["waves"][wave]]


def test_weights_replaced_in_place_get_no_hits(model_dir, tmp_path: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(model_dir(ARCH), model)
    other = build_model(ARCH, tmp_path / "other", seed=1)
    assert (other / "config.json").read_bytes() == (model / "config.json").read_bytes()
    secret = tmp_path / "secret"
    secret.write_text("e2e cache secret\n")
    secret.chmod(0o600)
    spec = {
        "model": str(model), "dtype": "float32", "max_model_len": 8192,
        "workloads": [{"name": "chat", "seed": 3, "size": CHAT}],
        "connector": {"secret_file": str(secret),
                      "backends": [{"type": "disk", "name": "disk", "path": str(tmp_path / "disk")}]},
    }
    old = run_engine_subprocess(spec)
    waves = len(old["workloads"]["chat"]["waves"])
    assert waves >= 2 and sum(served(old, w) for w in range(1, waves)) > 0  # signed pages load

    for name in ("model.safetensors",):
        assert (model / name).stat().st_size == (other / name).stat().st_size
        shutil.copyfile(other / name, model / name)  # rewritten in place
    new = run_engine_subprocess(spec)
    assert served(new, 0) == 0  # the same first prompts the old engine stored
    assert outputs(new, 0) != outputs(old, 0)  # the weights matter: the test is not vacuous
    assert sum(served(new, w) for w in range(1, waves)) > 0  # its own pages still serve it
    # the CLI with the engines' secret finds every page signed under it and stored under its key
    disk = str(tmp_path / "disk")
    cmd = [sys.executable, "-m", "hybrid_offload", "cache", "verify", "--disk", disk]
    report = subprocess.run([*cmd, "--secret-file", str(secret), "--json"], capture_output=True, text=True,
                            timeout=300, check=False)  # fmt: skip
    assert report.returncode == 0, report.stdout + report.stderr
    assert json.loads(report.stdout)["ok"] > 0
    (tmp_path / "other-secret").write_text("another secret\n")
    forged = subprocess.run([*cmd, "--secret-file", str(tmp_path / "other-secret"), "--json"],
                            capture_output=True, text=True, timeout=300, check=False)  # fmt: skip
    assert forged.returncode == 1 and json.loads(forged.stdout)["ok"] == 0
