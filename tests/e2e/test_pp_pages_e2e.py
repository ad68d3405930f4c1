"""Issue 17 end to end: page sets shared by real engines at PP=2 (TP=1 and 2), PP=1/TP=2 and
PP=1/TP=1.

Every engine sets ``layer_parts: 2``: page sets split into two layer parts, each PP=2 stage
writes and reads its own, PP=1 engines all of them. On one shared tier (falcon_h1: disk,
nemotron_h: a NIXL cache peer), per arch:

1. a PP=2/TP=2 engine (falcon_h1; its four workers two to a core) or a PP=1/TP=1 engine
   (nemotron_h) recomputes the first prompts and stores them;
2. a PP=2/TP=1 engine loads them (>= 99 % of the aligned prompt, the writer's tokens), then
   recomputes and stores the second prompts;
3. PP=1/TP=2 and PP=1/TP=1 engines load those (>= 99 %) with the PP=2 engine's tokens.

float32 (in bf16 vLLM's own PP/TP outputs already differ at near-tied logits). vLLM's CPU
build runs the PP=2 stages and the TP=2 ranks bound to one core each (``"0|1"``; four workers:
``"0|1|0|1"``); PP=2 in eager mode needs the ``cpu_pp_eager`` patch, nemotron_h at PP=2 also
``pp_kv_layouts`` and ``pp_hybrid_block_size`` (test_pp_engine_e2e.py).
"""

from __future__ import annotations

import contextlib
import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from engine_runs import VOCAB, hit_rate, tokens, two_core_env

from hybrid_offload.testing.services import start_peer
from hybrid_offload.testing.session import run_session_subprocess

pytestmark = pytest.mark.e2e

PP2 = {"pipeline_parallel_size": 2, "distributed_executor_backend": "mp", "dtype": "float32"}
TP2 = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp", "dtype": "float32"}
PP2_TP2 = {**PP2, "tensor_parallel_size": 2}
TP1 = {"dtype": "float32"}
#: the first writer of each arch
WRITER = {"falcon_h1": PP2_TP2, "nemotron_h": TP1}


def prompts(seed: int) -> list[list[int]]:
    """Three prompts of no common prefix and arbitrary lengths (2 to 5 chunks and a tail)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(300, 700))] for _ in range(3)]


#: the shared tier of each arch
TIER = {"falcon_h1": "disk", "nemotron_h": "peer"}


def run(base: dict[str, Any], layout: dict[str, Any], prompts: list[list[list[int]]]) -> dict[str, Any]:
    env = None if layout is TP1 else two_core_env("the PP=2 stages or TP=2 ranks")
    if layout is PP2_TP2:  # four workers: two on each core
        env = {"VLLM_CPU_OMP_THREADS_BIND": "|".join([env["VLLM_CPU_OMP_THREADS_BIND"]] * 2)}
    spec = {**base, "llm_kwargs": layout, "passes": len(prompts), "pass_prompts": prompts}
    result = run_session_subprocess(spec, env=env, timeout=600)
    assert "not shared with other engines" not in result["log"]  # scheduler and workers agree
    assert all(p["scheduler"]["failed_loads"] == 0 for p in result["passes"])  # every load landed
    return result


@pytest.mark.parametrize("arch", ["falcon_h1", "nemotron_h"])
def test_page_sets_written_at_one_pp_x_tp_layout_load_at_the_others(
    arch: str, model_dir, tmp_path: Path
) -> None:
    with contextlib.ExitStack() as stack:
        if TIER[arch] == "disk":
            tier, cli_args = {"type": "disk", "path": str(tmp_path)}, ["--disk", str(tmp_path)]
        else:
            peer = start_peer(512 << 20)
            stack.callback(peer.kill)
            tier, cli_args = {"type": "nixl_peer", "peers": [peer.address]}, ["--peer", peer.address]
        backend = {**tier, "name": TIER[arch], "capacity_bytes": "512MiB"}
        share_across_layouts(arch, model_dir, {"backends": [backend], "layer_parts": 2})
        check_with_cache_cli(cli_args)


def share_across_layouts(arch: str, model_dir: Any, connector: dict[str, Any]) -> None:
    first, second, name = prompts(1), prompts(2), TIER[arch]
    base = {"model": str(model_dir(arch)), "max_tokens": 12, "reset_prefix_cache": "request",
            "connector": connector}  # fmt: skip

    writer = run(base, WRITER[arch], [first])
    assert hit_rate(writer, 0, name) == 0
    expected_first = tokens(writer, 0)

    pp2 = run(base, PP2, [first, second])
    assert "PP rank 1 of 2" in pp2["log"] and "layers of 2 pipeline stages known" in pp2["log"]
    assert "intermediate tensors allocated" in pp2["log"]  # cpu_pp_eager
    assert ("stage without attention layers" in pp2["log"]) == (arch == "nemotron_h")  # pp_hybrid_block_size
    assert hit_rate(pp2, 0, name) >= 0.99
    assert tokens(pp2, 0) == expected_first
    assert hit_rate(pp2, 1, name) == 0
    expected_second = tokens(pp2, 1)

    for layout in (TP2, TP1):
        reader = run(base, layout, [second])
        assert hit_rate(reader, 0, name) >= 0.99, layout
        assert tokens(reader, 0) == expected_second, layout


def check_with_cache_cli(target: list[str]) -> None:
    """Every page verifies, and every page set the cache holds is complete: both layer parts,
    every shard."""
    verify = subprocess.run([sys.executable, "-m", "hybrid_offload", "cache", "verify", *target],
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert verify.returncode == 0, verify.stdout + verify.stderr
    stats = subprocess.run([sys.executable, "-m", "hybrid_offload", "cache", "stats", *target, "--json"],
                           capture_output=True, text=True, timeout=300, check=True)  # fmt: skip
    (model,) = json.loads(stats.stdout)["fingerprints"]
    for group in model["groups"]:
        assert group["sets_complete"] > 0 and group["sets_incomplete"] == 0, group
    assert {tuple(p) for g in model["groups"] for p in g["parts"]} == {(0, 2), (1, 2)}
