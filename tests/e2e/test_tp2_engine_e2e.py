"""Issue 7 end to end: real vLLM engines at tensor_parallel_size 1 and 2 share one disk cache.

vLLM's CPU build runs TP=2 here with its ranks bound to one core each (its automatic binding
wants a NUMA node per rank). A TP=1 engine stores; a TP=2 engine loads its pages (each rank
only its shards) with the greedy output of an engine that recomputes; then the other way
round. float32: in bf16, vLLM's own TP=1 and TP=2 outputs already differ at near-tied logits
(all-reduce order), with or without a connector.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from engine_runs import CHUNK_TOKENS, hit_rate, shared_prefix_prompts, tokens, two_core_env

from hybrid_offload.testing.session import run_session_subprocess

pytestmark = pytest.mark.e2e

TP2 = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp", "dtype": "float32"}
TP1 = {"dtype": "float32"}


def tp2_env() -> dict[str, str]:
    return two_core_env("the TP=2 ranks")


def disk(path: Path) -> dict[str, Any]:
    return {"backends": [{"type": "disk", "name": "disk", "path": str(path), "capacity_bytes": "1GiB"}]}


def test_tp1_pages_load_at_tp2_and_tp2_pages_at_tp1(model_dir, tmp_path: Path) -> None:
    env = tp2_env()
    model = model_dir("falcon_h1")
    prompts = shared_prefix_prompts(CHUNK_TOKENS["falcon_h1"])
    base = {"model": str(model), "prompts": prompts, "max_tokens": 12, "reset_prefix_cache": "request"}
    expected = tokens(run_session_subprocess({**base, "connector": None, "llm_kwargs": TP1}), 0)

    # TP=1 writes, TP=2 reads
    run_session_subprocess({**base, "connector": disk(tmp_path / "a"), "llm_kwargs": TP1})
    tp2 = run_session_subprocess({**base, "connector": disk(tmp_path / "a"), "llm_kwargs": TP2}, env=env)
    assert "TP rank 0 of 2" in tp2["log"] and "TP rank 1 of 2" in tp2["log"]
    assert "not shared with other engines" not in tp2["log"]  # scheduler and ranks agree
    assert hit_rate(tp2, 0, "disk") >= 0.99
    assert tokens(tp2, 0) == expected

    # TP=2 writes (its second pass loads its own shards back), TP=1 reads
    writer = run_session_subprocess(
        {**base, "connector": disk(tmp_path / "b"), "llm_kwargs": TP2, "passes": 2}, env=env
    )
    assert hit_rate(writer, 1, "disk") >= 0.99
    assert tokens(writer, 0) == tokens(writer, 1) == expected
    tp1 = run_session_subprocess({**base, "connector": disk(tmp_path / "b"), "llm_kwargs": TP1})
    assert hit_rate(tp1, 0, "disk") >= 0.99
    assert tokens(tp1, 0) == expected
    worker = tp1["passes"][0]["worker_total"]
    assert worker["bad_pages"] == 0 and worker["missing_pages"] == 0
    check_with_cache_cli(tmp_path / "a", tmp_path / "b")


def check_with_cache_cli(*dirs: Path) -> None:
    """The cache CLI on both caches: every page verifies under its key's fingerprint, and the
    caches written at TP=1 and TP=2 hold one model, in the same complete shard sets."""
    seen = []
    for path in dirs:
        verify = subprocess.run([sys.executable, "-m", "hybrid_offload", "cache", "verify",
                                 "--disk", str(path)], capture_output=True, text=True, timeout=300)
        assert verify.returncode == 0, verify.stdout + verify.stderr
        stats = subprocess.run([sys.executable, "-m", "hybrid_offload", "cache", "stats",
                                "--disk", str(path), "--json"], capture_output=True, text=True,
                               timeout=300, check=True)
        (model,) = json.loads(stats.stdout)["fingerprints"]
        shards = {g["kind"]: sorted({tuple(s) for s in g["shards"]}) for g in model["groups"]}
        seen.append((model["fingerprint"], shards))
    assert seen[0] == seen[1]
    assert seen[0][1] == {"full_attention": [(0, 2), (1, 2)], "mamba": [(p, 8) for p in range(8)]}


def test_shard_count_below_the_tp_size_is_refused_naming_tp_shards(model_dir, tmp_path: Path) -> None:
    """tp_shards: 1 (one page per set) cannot be written by two ranks: the engine does not
    start, and the error names the key and what would work."""
    env = tp2_env()
    spec = {"model": str(model_dir("falcon_h1")), "prompts": [[5, 6, 7]], "max_tokens": 1,
            "connector": {**disk(tmp_path / "c"), "tp_shards": 1}, "llm_kwargs": TP2}
    with pytest.raises(RuntimeError) as failed:
        run_session_subprocess(spec, env=env, timeout=300)
    log = str(failed.value)
    assert "kv_connector_extra_config.tp_shards (tensor_parallel_size=2)" in log
    assert "multiple of the TP size" in log
