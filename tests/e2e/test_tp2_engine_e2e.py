"""Issue 7 at start-up: a TP=2 engine whose shard count cannot be written by its ranks.

vLLM's CPU build runs TP=2 here with its ranks bound to one core each (its automatic binding
wants a NUMA node per rank). Pages shared between TP=1 and TP=2 engines (each rank reading only
its shards, the greedy output of a recomputing engine, every set complete in ``cache stats``)
are tested with pipeline-parallel engines in test_pp_pages_e2e.py: falcon_h1 pages written at
TP=2 load in the TP=1 stages of a PP=2 engine, whose pages load at TP=2 and TP=1.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from engine_runs import two_core_env

from hybrid_offload.testing.session import run_session_subprocess

pytestmark = pytest.mark.e2e

TP2 = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp", "dtype": "float32"}
TP1 = {"dtype": "float32"}


def tp2_env() -> dict[str, str]:
    return two_core_env("the TP=2 ranks")


def disk(path: Path) -> dict[str, Any]:
    return {"backends": [{"type": "disk", "name": "disk", "path": str(path), "capacity_bytes": "1GiB"}]}


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
