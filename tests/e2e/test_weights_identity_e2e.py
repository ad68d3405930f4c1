"""End to end (issue 14 H3, issue 45 N3): weights replaced in place are a new model, never
served old pages; weights written after the engine started are bound to nothing another engine
shares.

vLLM's default multi-process engine runs a chat (turns carry the generated replies) on a
float32 model and stores it on disk, with pages signed under a cache secret. The weights file
is then rewritten in the same directory with another model's weights (config.json unchanged,
same tensor names, shapes and file size). A new engine on the same disk and secret must load
nothing the old engine stored (its first wave, identical prompts, gets 0 tokens from the
cache) and produce its own model's tokens, which differ from the old model's.
"""

from __future__ import annotations

import json
import os
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
    """Tokens loaded in ``wave`` (a request that skipped the cache has no report)."""
    return sum((r["report"] or {}).get("served_tokens", 0) for r in run["workloads"]["chat"]["waves"][wave])


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


#: imported by every Python process of the engine (``PYTHONPATH``): writes the file named in
#: ``HYBRID_OFFLOAD_TEST_REWRITE`` again in place, the same bytes, when the process starts and
#: in a forked child, i.e. after each process started and before vLLM loads the weights
REWRITE_HOOK = """
import os

_PATH = os.environ.get("HYBRID_OFFLOAD_TEST_REWRITE")


def _rewrite():
    try:
        with open(_PATH, "r+b") as f:
            data = f.read()
            f.seek(0)
            f.write(data)
    except OSError:
        pass


if _PATH:
    _rewrite()
    os.register_at_fork(after_in_child=_rewrite)
"""


def test_weights_written_after_the_engine_started_share_no_pages(model_dir, tmp_path: Path) -> None:
    """Issue 45 N3: the connector identifies the weights after vLLM loaded them (and profiled),
    so a file written after the engine process started may hold other bytes than the engine
    runs. Here the weights file is rewritten with its own bytes as each engine process starts:
    the engine cannot tell, so its weights are unbound and it skips the cache. Run after an
    engine that stored pages of the same prompts from the same files, it loads none of them
    (the former identity, the files' content, shared them), stores none, and generates the same
    tokens."""
    model = tmp_path / "model"
    shutil.copytree(model_dir(ARCH), model)
    spec = {
        "model": str(model), "dtype": "float32", "max_model_len": 8192,
        "workloads": [{"name": "chat", "seed": 3, "size": CHAT}],
        "connector": {"backends": [{"type": "disk", "name": "disk", "path": str(tmp_path / "disk")}]},
    }
    settled = run_engine_subprocess(spec)
    waves = len(settled["workloads"]["chat"]["waves"])
    assert waves >= 2 and sum(served(settled, w) for w in range(1, waves)) > 0

    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(REWRITE_HOOK)
    path = os.pathsep.join(p for p in (str(hook), os.environ.get("PYTHONPATH")) if p)
    rewritten = run_engine_subprocess(
        spec, env={"PYTHONPATH": path, "HYBRID_OFFLOAD_TEST_REWRITE": str(model / "model.safetensors")})
    assert served(rewritten, 0) == 0  # the first engine stored these prompts from these files
    assert "cannot tell which bytes" in rewritten["log"]
    assert outputs(rewritten, 0) == outputs(settled, 0)  # the same weights: the miss is the binding
    assert sum(served(rewritten, w) for w in range(waves)) == 0  # no cache: nothing stored, nothing served
    assert "not bound to what this engine loaded" in rewritten["log"]
