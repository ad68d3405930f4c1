"""End to end (issue 14 H3, issue 45 N3): weights replaced in place are a new model, never
served old pages; weights written after the engine started are bound to nothing another engine
shares.

vLLM's default multi-process engine runs a chat (turns carry the generated replies) on a
float32 model and stores it on disk, with pages signed under a cache secret. The weights file
is then rewritten in the same directory with another model's weights (config.json unchanged,
same tensor names, shapes and file size). A new engine on the same disk and secret must load
nothing the old engine stored (its first wave, identical prompts, gets 0 tokens from the
cache) and produce its own model's tokens, which differ from the old model's.

Shared engines (:func:`engines`, three engine lifetimes for both tests, one after another on one
model directory, disk and secret):

* ``stored``: the model's own weights; stores the chat. The old engine of
  :func:`test_weights_replaced_in_place_get_no_hits` and the engine that stored the same prompts
  from the same files before :func:`test_weights_written_after_the_engine_started_share_no_pages`.
* ``rewritten``: the weights file written again with its own bytes as each engine process
  starts (:func:`test_weights_written_after_the_engine_started_share_no_pages`); it stores
  nothing, so the disk is as ``stored`` left it.
* ``replaced``: after the weights file was rewritten in place with another model's
  (:func:`test_weights_replaced_in_place_get_no_hits`).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from typing import Any

import pytest

from hybrid_offload.testing.models import build_model
from hybrid_offload.tools.bench.traffic import SIZES
from hybrid_offload.tools.bench.workload_run import run_engine_subprocess

#: one worker runs both tests: they share the module's engines
pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("weights-identity")]

ARCH = "falcon_h1"
#: two turns are enough to show pages that load (the next turn) and pages that must not
CHAT = {**SIZES["small"]["chat"], "turns": 2, "reply": 32}
WEIGHTS = "model.safetensors"


def served(run: dict, wave: int) -> int:
    """Tokens loaded in ``wave`` (a request that skipped the cache has no report)."""
    return sum((r["report"] or {}).get("served_tokens", 0) for r in run["workloads"]["chat"]["waves"][wave])


def outputs(run: dict, wave: int) -> list[list[int]]:
    return [r["output"] for r in run["workloads"]["chat"]["waves"][wave]]


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


@pytest.fixture(scope="module")
def engines(model_dir, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The module's three engine runs (module docstring), the same chat and connector each, and
    the files they ran on (``root``: the model copy ``model``, ``other``'s weights, the
    ``secret``, the ``disk``)."""
    root = tmp_path_factory.mktemp("weights-identity")
    model = root / "model"
    shutil.copytree(model_dir(ARCH), model)
    other = build_model(ARCH, root / "other", seed=1)
    secret = root / "secret"
    secret.write_text("e2e cache secret\n")
    secret.chmod(0o600)
    spec = {
        "model": str(model), "dtype": "float32", "max_model_len": 8192,
        "workloads": [{"name": "chat", "seed": 3, "size": CHAT}],
        "connector": {"secret_file": str(secret),
                      "backends": [{"type": "disk", "name": "disk", "path": str(root / "disk")}]},
    }  # fmt: skip
    stored = run_engine_subprocess(spec)

    hook = root / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(REWRITE_HOOK)
    path = os.pathsep.join(p for p in (str(hook), os.environ.get("PYTHONPATH")) if p)
    rewritten = run_engine_subprocess(
        spec, env={"PYTHONPATH": path, "HYBRID_OFFLOAD_TEST_REWRITE": str(model / WEIGHTS)})

    sizes = ((model / WEIGHTS).stat().st_size, (other / WEIGHTS).stat().st_size)
    shutil.copyfile(other / WEIGHTS, model / WEIGHTS)  # rewritten in place
    replaced = run_engine_subprocess(spec)
    return {"stored": stored, "rewritten": rewritten, "replaced": replaced, "sizes": sizes,
            "model": model, "other": other, "secret": secret, "disk": root / "disk"}  # fmt: skip


def test_weights_replaced_in_place_get_no_hits(engines: dict[str, Any]) -> None:
    model, other, secret = engines["model"], engines["other"], engines["secret"]
    assert (other / "config.json").read_bytes() == (model / "config.json").read_bytes()
    old, new = engines["stored"], engines["replaced"]
    waves = len(old["workloads"]["chat"]["waves"])
    assert waves >= 2 and sum(served(old, w) for w in range(1, waves)) > 0  # signed pages load

    old_size, other_size = engines["sizes"]
    assert old_size == other_size  # the same file size: only the bytes tell the models apart
    assert served(new, 0) == 0  # the same first prompts the old engine stored
    assert outputs(new, 0) != outputs(old, 0)  # the weights matter: the test is not vacuous
    assert sum(served(new, w) for w in range(1, waves)) > 0  # its own pages still serve it
    # the CLI with the engines' secret finds every page signed under it and stored under its key
    disk = str(engines["disk"])
    cmd = [sys.executable, "-m", "hybrid_offload", "cache", "verify", "--disk", disk]
    report = subprocess.run([*cmd, "--secret-file", str(secret), "--json"], capture_output=True, text=True,
                            timeout=300, check=False)  # fmt: skip
    assert report.returncode == 0, report.stdout + report.stderr
    assert json.loads(report.stdout)["ok"] > 0
    other_secret = secret.with_name("other-secret")
    other_secret.write_text("another secret\n")
    forged = subprocess.run([*cmd, "--secret-file", str(other_secret), "--json"],
                            capture_output=True, text=True, timeout=300, check=False)  # fmt: skip
    assert forged.returncode == 1 and json.loads(forged.stdout)["ok"] == 0


def test_weights_written_after_the_engine_started_share_no_pages(engines: dict[str, Any]) -> None:
    """Issue 45 N3: the connector identifies the weights after vLLM loaded them (and profiled),
    so a file written after the engine process started may hold other bytes than the engine
    runs. Here the weights file is rewritten with its own bytes as each engine process starts:
    the engine cannot tell, so its weights are unbound and it skips the cache. Run after an
    engine that stored pages of the same prompts from the same files, it loads none of them
    (the former identity, the files' content, shared them), stores none, and generates the same
    tokens."""
    settled, rewritten = engines["stored"], engines["rewritten"]
    waves = len(settled["workloads"]["chat"]["waves"])
    assert waves >= 2 and sum(served(settled, w) for w in range(1, waves)) > 0

    assert served(rewritten, 0) == 0  # the first engine stored these prompts from these files
    assert "cannot tell which bytes" in rewritten["log"]
    assert outputs(rewritten, 0) == outputs(settled, 0)  # the same weights: the miss is the binding
    assert sum(served(rewritten, w) for w in range(waves)) == 0  # no cache: nothing stored, nothing served
    assert "not bound to what this engine loaded" in rewritten["log"]
