"""Issues 17 and 32 end to end: page sets shared by real engines at different PP x TP layouts,
with the shipped configs unchanged apart from paths (no ``layer_parts``).

Each engine writes its own layout (a PP=2 engine two layer parts, one per stage; others one)
and reads any layout's parts that hold its layers:

* nemotron_h through disk (``configs/disk.yaml``): a TP=2 engine writes, a PP=2 engine loads it
  (TP=2 -> PP=2) and writes more, which a TP=2 engine (PP=2 -> TP=2) and a TP=1 engine load
  (PP=2 -> TP=1), the TP=1 engine extends, and a PP=2 engine loads that (PP=1 -> PP=2; each
  stage reads its layers out of the one-part pages);
* falcon_h1 through a NIXL cache peer (``configs/nixl_peer.yaml``, its secret and token): a
  PP=2/TP=2 engine (its four workers two to a core) writes, a TP=2 engine loads (PP=2 -> TP=2).

Each reader: >= 95 % of the shared prefix loaded, the tokens of the engine that recomputed it.
float32 (in bf16 vLLM's own PP/TP outputs already differ at near-tied logits). vLLM's CPU
build runs the PP=2 stages and the TP=2 ranks bound to one core each (``"0|1"``; four workers:
``"0|1|0|1"``); PP=2 in eager
mode needs the ``cpu_pp_eager`` patch, nemotron_h at PP=2 also ``pp_kv_layouts`` and
``pp_hybrid_block_size`` (test_pp_engine_e2e.py).

Shared engines: the nemotron_h chain runs three engine lifetimes, not five. Engines wait at a
pass barrier (the session's ``pass_barrier``) while others run, and go on to load what those
wrote (the disk tier sees other processes' pages at once): the TP=2 engine writes the first
prompts, then loads the second ones the PP=2 engine wrote (PP=2 -> TP=2); the PP=2 engine loads
the first prompts (TP=2 -> PP=2) and writes the second, then loads the third ones the TP=1
engine wrote (PP=1 -> PP=2); the TP=1 engine loads the second prompts (PP=2 -> TP=1) and writes
the third. No engine's own pages serve it: the three prompt sets share no prefix.
"""

from __future__ import annotations

import json
import random
import secrets
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import yaml
from engine_runs import VOCAB, hit_rate, release_pass, tokens, two_core_env, wait_for_pass

from hybrid_offload.core.secrets import create_secret_file
from hybrid_offload.testing.services import start_peer
from hybrid_offload.testing.session import run_session_subprocess

pytestmark = pytest.mark.e2e

PP2 = {"pipeline_parallel_size": 2, "distributed_executor_backend": "mp", "dtype": "float32"}
TP2 = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp", "dtype": "float32"}
TP1 = {"dtype": "float32"}
PP2_TP2 = {**PP2, "tensor_parallel_size": 2}
CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def prompts(seed: int) -> list[list[int]]:
    """Three prompts of no common prefix and arbitrary lengths (2 to 5 chunks and a tail)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(300, 700))] for _ in range(3)]


def shipped(name: str) -> dict[str, Any]:
    """``configs/<name>.yaml``'s connector settings, as users get them."""
    return yaml.safe_load((CONFIGS / f"{name}.yaml").read_text())["kv_connector_extra_config"]


def run(base: dict[str, Any], layout: dict[str, Any], prompts: list[list[list[int]]],
        gate: Path | None = None) -> dict[str, Any]:  # fmt: skip
    """One engine of ``layout`` through a pass per prompt set; with a ``gate`` (a directory), it
    waits there after each pass until the test releases it (``engine_runs.release_pass``)."""
    env = None if layout is TP1 else two_core_env("the PP=2 stages or TP=2 ranks")
    if layout is PP2_TP2:  # four workers: two on each core
        env = {"VLLM_CPU_OMP_THREADS_BIND": "|".join([env["VLLM_CPU_OMP_THREADS_BIND"]] * 2)}
    spec = {**base, "llm_kwargs": layout, "passes": len(prompts), "pass_prompts": prompts}
    if gate is not None:  # it waits while other engines start and run
        spec.update(pass_barrier=str(gate), barrier_timeout_s=900)
    result = run_session_subprocess(spec, env=env, timeout=600 if gate is None else 1800)
    assert "not shared with other engines" not in result["log"]  # scheduler and workers agree
    failed = [p["scheduler"]["failed_loads"] for p in result["passes"]]
    assert not any(failed), f"failed loads per pass {failed}:\n{warnings(result['log'])}"  # every load landed
    return result


def warnings(log: str) -> str:
    """The log's warnings and errors (why a load failed or a store was dropped), last 40."""
    return "\n".join([line for line in log.splitlines() if "WARNING" in line or "ERROR" in line][-40:])


def test_nemotron_h_pages_load_across_pp_and_tp_layouts_through_disk(model_dir, tmp_path: Path) -> None:
    connector = shipped("disk")
    (backend,) = connector["backends"]
    backend["path"] = str(tmp_path / "cache")
    base = {"model": str(model_dir("nemotron_h")), "max_tokens": 12, "reset_prefix_cache": "request",
            "connector": connector}  # fmt: skip
    first, second, third = prompts(1), prompts(2), prompts(3)
    tp2_gate, pp2_gate = tmp_path / "tp2-gate", tmp_path / "pp2-gate"
    tp2_gate.mkdir()
    pp2_gate.mkdir()
    release_pass(pp2_gate, 0)  # the PP=2 engine goes on from its first prompts to its second

    with ThreadPoolExecutor(2) as pool:
        try:
            tp2_run = pool.submit(run, base, TP2, [first, second], tp2_gate)
            wait_for_pass(tp2_gate, 0, tp2_run, timeout=900)  # the TP=2 engine wrote the first prompts
            pp2_run = pool.submit(run, base, PP2, [first, second, third], pp2_gate)
            wait_for_pass(pp2_gate, 1, pp2_run, timeout=900)  # loaded (TP=2 -> PP=2), wrote the second
            release_pass(tp2_gate, 0)
            tp2 = tp2_run.result()  # PP=2 -> TP=2 (a PP=2 prefill engine, a TP=2 decode engine)
            tp1 = run(base, TP1, [second, third])  # PP=2 -> TP=1, and writes the third prompts
            release_pass(pp2_gate, 1)
            pp2 = pp2_run.result()  # PP=1 -> PP=2: each stage reads its layers of one-part pages
        finally:  # a failure: let the waiting engines finish rather than wait out their barrier
            for gate in (tp2_gate, pp2_gate):
                for index in range(2):
                    release_pass(gate, index)

    # the TP=2 engine's first pass: the writer
    assert hit_rate(tp2, 0, "disk") == 0
    # the PP=2 engine's first two passes: TP=2 -> PP=2, then its own pages
    assert "PP rank 1 of 2" in pp2["log"] and "layers of 2 pipeline stages known" in pp2["log"]
    assert "stage without attention layers" in pp2["log"]  # pp_hybrid_block_size
    assert hit_rate(pp2, 0, "disk") >= 0.95 and tokens(pp2, 0) == tokens(tp2, 0)
    assert hit_rate(pp2, 1, "disk") == 0
    # the TP=2 engine's second pass: PP=2 -> TP=2
    assert hit_rate(tp2, 1, "disk") >= 0.95 and tokens(tp2, 1) == tokens(pp2, 1)
    # the TP=1 engine: PP=2 -> TP=1
    assert hit_rate(tp1, 0, "disk") >= 0.95 and tokens(tp1, 0) == tokens(pp2, 1)
    assert hit_rate(tp1, 1, "disk") == 0
    # the PP=2 engine's third pass: PP=1 -> PP=2
    assert hit_rate(pp2, 2, "disk") >= 0.95 and tokens(pp2, 2) == tokens(tp1, 1)
    check_with_cache_cli(["--disk", backend["path"]], {(0, 4), (0, 2), (2, 4)})


def test_falcon_h1_pages_written_at_pp2_tp2_load_at_tp2_through_a_peer(model_dir, tmp_path: Path) -> None:
    token = secrets.token_hex(16)
    with start_peer(512 << 20, token=token) as peer:
        connector = shipped("nixl_peer")
        connector["secret_file"] = str(tmp_path / "cache-secret")
        create_secret_file(connector["secret_file"])
        (backend,) = connector["backends"]
        backend["peers"], backend["token_file"] = [peer.address], str(peer.token_path)
        base = {"model": str(model_dir("falcon_h1")), "max_tokens": 12, "reset_prefix_cache": "request",
                "connector": connector}  # fmt: skip
        writer = run(base, PP2_TP2, [prompts(4)])
        assert "layers of 2 pipeline stages known" in writer["log"] and hit_rate(writer, 0, "peer") == 0
        # the PP=2 engine's pages and model card, as the cache CLI describes them
        target = ["--peer", peer.address, "--peer-token-file", str(peer.token_path),
                  "--secret-file", connector["secret_file"]]  # fmt: skip
        model = check_with_cache_cli(target, {(0, 1), (1, 2)}, warnings(writer["log"]))
        assert model["model"] == str(model_dir("falcon_h1")), model
        reader = run(base, TP2, [prompts(4)])  # PP=2 -> TP=2: each rank reads both stages' parts
        assert hit_rate(reader, 0, "peer") >= 0.95 and tokens(reader, 0) == tokens(writer, 0)


def check_with_cache_cli(target: list[str], parts: set[tuple[int, int]], writers: str = "") -> dict[str, Any]:
    """Every page verifies, and every page set the cache holds is complete in some layout;
    ``cache stats``' entry of the one model. ``writers``: their warnings, shown on a failure."""
    verify = subprocess.run([sys.executable, "-m", "hybrid_offload", "cache", "verify", *target],
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert verify.returncode == 0, verify.stdout + verify.stderr
    stats = subprocess.run([sys.executable, "-m", "hybrid_offload", "cache", "stats", *target, "--json"],
                           capture_output=True, text=True, timeout=300, check=True)  # fmt: skip
    (model,) = json.loads(stats.stdout)["fingerprints"]
    for group in model["groups"]:
        assert group["sets_complete"] > 0 and group["sets_incomplete"] == 0, f"{group}\n{writers}"
    assert {tuple(p) for g in model["groups"] for p in g["parts"]} == parts
    return model
