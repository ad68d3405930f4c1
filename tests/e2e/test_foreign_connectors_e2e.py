"""End to end: foreign child connectors (``kv_connector_extra_config.connectors``) in a real
offline vLLM engine (CPU, tiny Falcon-H1, vLLM's prefix cache reset before every request).

(a) ``HybridMultiConnector``: native cpu backend (weight 1.0) + our own connector as a child
    loaded by module path with a disk backend (weight 2.0) + the recording test connector: pass
    2 loads from the child (both hit the same tokens, the child scores twice as high), output
    equals a no-connector run, and the recording child saw the hooks of both roles.
(b) a pure vLLM MultiConnector config (``kv_connector: "MultiConnector"``, only ``connectors``)
    switched to ours by the module path: it runs and hits.
(c) a child without HMA support fails at startup with our error naming the child.
(d) at PP=2 our side and our own connector as a child each get every stage's layers.

Shared engines: (a)'s run without the connector is a reference engine of ``engine_runs``
(:data:`BASELINE`), the same engine as test_connector_e2e.py's falcon_h1 baseline: one start
per xdist worker serves both.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from engine_runs import CHUNK_TOKENS, reference, shared_prefix_prompts, tokens, two_core_env

from hybrid_offload.testing.session import CONNECTOR_MODULE, kv_transfer_config, run_session_subprocess

pytestmark = pytest.mark.e2e

ARCH = "falcon_h1"
TESTS_DIR = Path(__file__).resolve().parents[1]
#: the engine process imports ``foreign_connectors`` from tests/
ENV = {"PYTHONPATH": os.pathsep.join(p for p in (str(TESTS_DIR), os.environ.get("PYTHONPATH")) if p)}
#: (a)'s prompts without any connector
BASELINE = reference(ARCH, shared_prefix_prompts(CHUNK_TOKENS[ARCH]), max_tokens=12)


def our_child(name: str, disk: Path, weight: float) -> dict[str, Any]:
    """Our own connector as a foreign child: a full kv_transfer_config plus name / load_weight."""
    backend = {"type": "disk", "name": f"{name}-disk", "path": str(disk), "capacity_bytes": "1GiB"}
    return {
        **kv_transfer_config({"backends": [backend]}),
        "name": name,
        "load_weight": weight,
    }


def recording_child(record: Path, hma: bool = True) -> dict[str, Any]:
    return {
        "kv_connector": "RecordingConnector" if hma else "NonHmaRecordingConnector",
        "kv_connector_module_path": "foreign_connectors",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"record_path": str(record)},
        "name": "recorder",
    }


def child_hit_rate(result: dict[str, Any], index: int, child: str) -> float:
    sched = result["passes"][index]["scheduler"]
    return sched["children"][child]["loaded_tokens"] / sched["aligned_prompt_tokens"]


def base_spec(model_dir) -> dict[str, Any]:
    prompts = shared_prefix_prompts(CHUNK_TOKENS[ARCH])
    return {
        "model": str(model_dir(ARCH)),
        "prompts": prompts,
        "max_tokens": 12,
        "reset_prefix_cache": "request",
    }


def test_child_with_higher_weight_loads_and_output_is_unchanged(
    model_dir, reference_run, tmp_path: Path
) -> None:
    base = base_spec(model_dir)
    expected = tokens(reference_run(BASELINE), 0)
    record = tmp_path / "record.txt"
    extra = {
        "backends": [{"type": "cpu", "name": "cpu", "capacity_bytes": "256MiB", "load_weight": 1.0}],
        "connectors": [our_child("ours", tmp_path / "disk", 2.0), recording_child(record)],
    }
    assert kv_transfer_config(extra)["kv_connector"] == "HybridMultiConnector"
    result = run_session_subprocess({**base, "connector": extra, "passes": 2}, env=ENV)
    assert tokens(result, 0) == expected
    assert tokens(result, 1) == expected
    assert child_hit_rate(result, 1, "ours") >= 0.99
    second = result["passes"][1]["scheduler"]
    assert second["backends"]["cpu"]["hit_tokens"] > 0  # the native side hit too ...
    assert second["backends"]["cpu"]["loaded_tokens"] == 0  # ... and lost on score
    assert second["children"]["recorder"]["loaded_tokens"] == 0
    assert "child connectors [('ours', 'HybridOffloadConnector', 2.0)" in result["log"]

    seen = {tuple(line.split()[:2]) for line in record.read_text().splitlines()}
    for role, hook in [
        ("scheduler", "get_num_new_matched_tokens"),
        ("scheduler", "update_state_after_alloc"),
        ("scheduler", "build_connector_meta"),
        ("scheduler", "got-own-worker-meta"),
        ("scheduler", "request_finished_all_groups"),
        ("worker", "register_kv_caches"),
        ("worker", "bound-own-meta"),
        ("worker", "start_load_kv"),
        ("worker", "save_kv_layer"),
        ("worker", "wait_for_save"),
        ("worker", "get_finished"),
        ("worker", "build_connector_worker_meta"),
    ]:
        assert (role, hook) in seen, (role, hook, sorted(seen))


def test_multiconnector_config_switched_by_module_path(model_dir, tmp_path: Path) -> None:
    # 5 chunks: the prompts' last checkpoint (640) is no multiple of vLLM's block on any CPU
    # (256 with AVX2, 384 with AVX-512), so the child's states land there only if the
    # composition passes the child's prefill stops on to vLLM's scheduler.
    base = {**base_spec(model_dir), "prompts": shared_prefix_prompts(CHUNK_TOKENS[ARCH], chunks=5)}
    child = our_child("a", tmp_path / "disk", 1.0)
    del child["name"], child["load_weight"]
    config = {  # exactly what vLLM's MultiConnector takes, plus the module path
        "kv_connector": "MultiConnector",
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"connectors": [child]},
    }
    result = run_session_subprocess(
        {**base, "connector": None, "passes": 2, "llm_kwargs": {"kv_transfer_config": config}}, env=ENV
    )
    assert tokens(result, 1) == tokens(result, 0)
    assert child_hit_rate(result, 1, "HybridOffloadConnector0") >= 0.99


def test_child_without_hma_support_is_rejected_naming_it(model_dir, tmp_path: Path) -> None:
    base = base_spec(model_dir)
    config = {
        "kv_connector": "MultiConnector",
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "backends": [{"type": "cpu"}],
            "connectors": [recording_child(tmp_path / "record.txt", hma=False)],
        },
    }
    spec = {**base, "connector": None, "warmup": False, "llm_kwargs": {"kv_transfer_config": config}}
    with pytest.raises(RuntimeError) as info:
        run_session_subprocess(spec, env=ENV)
    message = str(info.value)
    assert "kv_connector_extra_config.connectors[0] ('recorder')" in message, message[-3000:]
    assert "NonHmaRecordingConnector does not support" in message


def test_a_pipeline_parallel_composition_hands_each_side_its_handshake(model_dir, tmp_path: Path) -> None:
    """PP=2: our side and its child (our own connector, which needs the stages' layers too)
    each learn every stage's layers through the one handshake vLLM carries; the child's pages
    load in the second pass, with the first pass's tokens (float32)."""
    base = {**base_spec(model_dir), "llm_kwargs": {"pipeline_parallel_size": 2, "dtype": "float32",
                                                  "distributed_executor_backend": "mp"}}  # fmt: skip
    extra = {
        "backends": [{"type": "cpu", "name": "cpu", "capacity_bytes": "256MiB", "load_weight": 1.0}],
        "connectors": [our_child("ours", tmp_path / "disk", 2.0)],
    }
    env = {**ENV, **two_core_env("the PP=2 stages")}
    result = run_session_subprocess({**base, "connector": extra, "passes": 2}, env=env)
    assert result["log"].count("layers of 2 pipeline stages known") == 2  # ours and the child
    assert child_hit_rate(result, 1, "ours") >= 0.95
    assert tokens(result, 1) == tokens(result, 0)
