"""End to end: on real traffic the cache serves the reusable prefix, in vLLM's default engine.

vLLM's default multi-process engine (scheduler in its EngineCore process, the connector's
worker side in a worker process) runs a multi-turn chat whose turns carry the generated
replies (two conversations at once) and prompts of random lengths (1k-6k tokens, up to beyond
``max_num_batched_tokens``) asked twice: with async scheduling on (falcon_h1), off and vLLM's
prefix caching off too (zamba2: Mamba cache mode ``none``, the connector's own stops) and
pipeline parallel (nemotron_h at PP=2, its stages each storing and loading their layers, against
a PP=1 engine's tokens); LFM2 and LFM2-MoE (short-conv state) are checked by logprobs, see
:func:`test_short_conv_states_are_restored_bit_for_bit`. vLLM's own prefix cache is reset
before every wave, so every cached token is the connector's. The reusable prefix of a request
is what the prompts and outputs of earlier waves share with it, floored to the chunk (128
tokens here), below its length (``hybrid_offload.tools.bench.traffic``); the connector must
serve >= 95 % of it, and, for the float32 archs, the greedy tokens of an engine without the
connector.
"""

from __future__ import annotations

from typing import Any

import pytest
from engine_runs import two_core_env

from hybrid_offload.tools.bench.traffic import SIZES
from hybrid_offload.tools.bench.workload_run import run_engine_subprocess
from hybrid_offload.tools.bench.workloads_report import coverage, identical

pytestmark = pytest.mark.e2e

CHUNK = 128
TRAFFIC = [{"name": name, "seed": 7, "size": SIZES["small"][name]} for name in ("chat", "random")]


def connector() -> dict[str, Any]:
    return {"backends": [{"type": "cpu", "name": "cpu", "capacity_bytes": "2GiB"}]}


def check(ours: dict[str, Any], base: dict[str, Any] | None) -> None:
    for name, run in ours["workloads"].items():
        cov = coverage(run["waves"], CHUNK)
        assert cov["reusable"] > 0, name
        assert cov["ratio"] >= 0.95, (name, cov["served"], cov["reusable"], cov["per_request"])
        if base is not None:
            assert identical(base["workloads"][name]["waves"], run["waves"]), name
    reports = [r["report"] for run in ours["workloads"].values() for wave in run["waves"] for r in wave]
    assert all(r is not None and r["served_tokens"] <= r["reusable_tokens"] for r in reports)


#: two pipeline stages, one core each (vLLM's V1 runner turns async scheduling off at PP > 1)
PP2 = {"pipeline_parallel_size": 2, "distributed_executor_backend": "mp"}


@pytest.mark.parametrize(("arch", "engine"),
                         [("falcon_h1", "async"), ("nemotron_h", "pp2"), ("zamba2", "sync-no-pc")])
def test_float32_traffic_is_served_with_identical_tokens(arch: str, engine: str, model_dir) -> None:
    spec = {"model": str(model_dir(arch)), "dtype": "float32", "max_model_len": 8192, "workloads": TRAFFIC}
    base = run_engine_subprocess({**spec, "connector": None})
    llm_kwargs: dict[str, Any] = {"async_scheduling": engine == "async"}
    env = None
    if engine == "sync-no-pc":  # vLLM's prefix caching off
        llm_kwargs["enable_prefix_caching"] = False
    if engine == "pp2":
        llm_kwargs, env = PP2, two_core_env("the PP=2 stages")
    ours = run_engine_subprocess({**spec, "connector": connector(), "llm_kwargs": llm_kwargs}, env=env)
    if engine == "pp2":
        assert "layers of 2 pipeline stages known" in ours["log"]
    check(ours, base)


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5"])
def test_gdn_traffic_is_served(arch: str, model_dir) -> None:
    """GDN kernels on CPU need bf16 ("CPU GDN attention requires BF16" for Qwen3.5 too), where
    vLLM flips near-tied tokens between batch shapes even without a connector: hits are checked,
    not tokens (tokens: test_connector_e2e.py, short prompts, and its negative control)."""
    spec = {"model": str(model_dir(arch)), "dtype": "bfloat16", "max_model_len": 8192,
            "workloads": TRAFFIC, "llm_kwargs": {"async_scheduling": True}}
    check(run_engine_subprocess({**spec, "connector": connector()}), None)


@pytest.mark.parametrize(("arch", "engine"), [("lfm2", "sync"), ("lfm2_moe", "async")])
def test_short_conv_states_are_restored_bit_for_bit(arch: str, engine: str, model_dir) -> None:
    """LFM2's output in vLLM shifts with where a prefill is cut into steps (float32, no
    connector, measured: first-token logprobs move up to 0.09 between max_num_batched_tokens 256
    and the default, 0.003-0.018 between prefix caching on and off, on prompts nothing served),
    and the connector cuts prefills at its checkpoints: tokens against an engine without it would
    differ for reasons that are not the cache. A zeroed conv state, on the other hand, leaves
    greedy tokens unchanged (``test_wrong_mamba_state_changes_output[lfm2]``). So: hits as above,
    and every prompt asked again, served from the cache, gives the first token's logprobs of its
    first ask (cold, cut at the same places) bit for bit. One request at a time (a batch's shape
    changes float32 sums)."""
    spec = {"model": str(model_dir(arch)), "dtype": "float32", "max_model_len": 8192, "workloads": TRAFFIC,
            "sequential": True, "logprobs": 20, "llm_kwargs": {"async_scheduling": engine == "async"}}
    ours = run_engine_subprocess({**spec, "connector": connector()})
    check(ours, None)
    rows = {r["label"]: r for wave in ours["workloads"]["random"]["waves"] for r in wave}
    again = [label for label in rows if label.endswith(".again")]
    assert again and all(rows[label]["cached"] > 0 for label in again)
    for label in again:
        first = rows[label.replace(".again", ".first")]
        assert rows[label]["first_logprobs"] == first["first_logprobs"], label
