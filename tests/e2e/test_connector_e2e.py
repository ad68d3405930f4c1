"""End to end: real offline vLLM (CPU) with the connector, real cpu and disk tiers.

For each arch: a baseline engine without the connector; engine A (cpu + disk) runs the prompts
twice (the second pass must load >= 99 % of the chunk-aligned prefix from the cpu tier); then
engine B, a new process on the same disk directory with an empty cpu tier (a restart), must load
>= 99 % from disk (one case with the disk's segment layout), promoting what it loads into its cpu
tier, and in its second pass serve from the cpu tier what it promoted (a lookup before the
worker's report of the promotion still loads from disk). Every pass must give the baseline's greedy
tokens. vLLM's own prefix cache is reset before every request, so hits can only come from the
connector. Async scheduling is on in engine A and off in engine B (and the other way round for
qwen3_next and llama).

Shared engines: the baseline of an arch (:data:`BASELINES`, a reference engine of
``engine_runs``: one engine per arch and xdist worker, shared with the other modules that
declare the same engine, see there) serves both ``test_cpu_then_disk_after_restart[arch]``
(expected tokens) and ``test_wrong_mamba_state_changes_output[arch]`` (tokens the zeroed state
must change) for qwen3_next and qwen3_5, whose two tests share an ``xdist_group``; LFM2's
negative control compares logprobs within its own run and starts no baseline.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from engine_runs import CHUNK_TOKENS, hit_rate, reference, shared_prefix_prompts, tokens

from hybrid_offload.testing.session import ENGINE_ENV, run_session_subprocess

pytestmark = pytest.mark.e2e

#: archs whose baseline both tests use: their tests run on one xdist worker, sharing it
SHARED_BASELINE = ("qwen3_next", "qwen3_5")


def same_worker(arch: str, *values: Any) -> Any:
    """A parameter set of ``arch``, grouped with the arch's other tests where they share its
    baseline engine."""
    marks = [pytest.mark.xdist_group(f"connector-e2e-{arch}")] if arch in SHARED_BASELINE else []
    return pytest.param(arch, *values, marks=marks)


def base_spec(arch: str, model_dir) -> dict[str, Any]:
    """Prompts and sampling of every run of ``arch`` here. LFM2: a wrong short-conv state leaves
    greedy tokens as they are (see test_short_conv_states_are_restored_bit_for_bit): its check is
    the logprobs (float32)."""
    prompts = shared_prefix_prompts(CHUNK_TOKENS[arch])
    base: dict[str, Any] = {"model": str(model_dir(arch)), "prompts": prompts, "max_tokens": 12,
                            "reset_prefix_cache": "request", "llm_kwargs": {}}  # fmt: skip
    if arch == "lfm2":
        base.update(logprobs=20, llm_kwargs={"dtype": "float32"})
    return base


#: per arch, the prompts of :func:`base_spec` without the connector (the same engine settings)
BASELINES = {
    arch: reference(arch, shared_prefix_prompts(CHUNK_TOKENS[arch]), max_tokens=12,
                    **({"logprobs": 20, "dtype": "float32"} if arch == "lfm2" else {}))
    for arch in ("qwen3_next", "qwen3_5", "falcon_h1", "llama", "lfm2")
}  # fmt: skip


def connector(disk: Path, with_cpu: bool, layout: str = "files") -> dict[str, Any]:
    backends: list[dict[str, Any]] = [
        {"type": "disk", "name": "disk", "path": str(disk), "capacity_bytes": "1GiB", "load_weight": 0.5,
         "layout": layout}
    ]  # fmt: skip
    if with_cpu:
        backends.insert(0, {"type": "cpu", "name": "cpu", "capacity_bytes": "256MiB"})
    return {"backends": backends}


@pytest.mark.parametrize(
    ("arch", "async_a", "layout"),
    [
        same_worker("qwen3_next", False, "segments"),
        same_worker("qwen3_5", True, "files"),
        same_worker("falcon_h1", True, "files"),
        same_worker("llama", False, "files"),
        same_worker("lfm2", True, "files"),
    ],
)
def test_cpu_then_disk_after_restart(
    arch: str, async_a: bool, layout: str, model_dir, reference_run, tmp_path: Path
) -> None:
    base = base_spec(arch, model_dir)
    # LFM2's logprobs: bit for bit those of engine A's cold pass (the same step cuts)
    dtype = base.pop("llm_kwargs")
    expected = tokens(reference_run(BASELINES[arch]), 0)

    disk = tmp_path / "disk"
    engine_a = run_session_subprocess(
        {
            **base,
            "connector": connector(disk, True, layout),
            "passes": 2,
            "llm_kwargs": {"async_scheduling": async_a, **dtype},
        }
    )
    assert f"chunk_tokens={CHUNK_TOKENS[arch]}" in engine_a["log"]
    assert tokens(engine_a, 0) == expected
    assert tokens(engine_a, 1) == expected
    assert hit_rate(engine_a, 1, "cpu") >= 0.99

    engine_b = run_session_subprocess(
        {
            **base,
            "connector": connector(disk, True, layout),
            "passes": 2,
            "llm_kwargs": {"async_scheduling": not async_a, **dtype},
        }
    )
    assert tokens(engine_b, 0) == expected
    assert tokens(engine_b, 1) == expected
    # after the restart the disk serves, and what it served is promoted: the later prompt of a
    # document (in the same pass) and the second pass are served from the cpu tier
    assert hit_rate(engine_b, 0, "disk") > 0
    for index in range(2):
        assert hit_rate(engine_b, index, "cpu") + hit_rate(engine_b, index, "disk") >= 0.99
    assert hit_rate(engine_b, 1, "cpu") >= 0.5
    worker = engine_b["passes"][1]["worker_total"]
    assert worker["bad_pages"] == 0 and worker["missing_pages"] == 0
    assert worker["pages_promoted"] > 0 and worker["promotions_dropped"] == 0
    if "logprobs" in base:
        cold = logprobs(engine_a, 0)
        assert logprobs(engine_a, 1) == cold
        assert logprobs(engine_b, 0) == cold and logprobs(engine_b, 1) == cold


def logprobs(result: dict[str, Any], index: int) -> list[list[dict[str, float]]]:
    return [r["logprobs"] for r in result["passes"][index]["requests"]]


ZEROING_CHILD = """
import sys
import torch
from hybrid_offload.connector.worker import page_codec
from hybrid_offload.engine.kv_layout import MambaGroupLayout
real_scatter = page_codec.PageCodec.scatter
def zero_scatter(self, layout, page, shard, payload):
    if isinstance(layout, MambaGroupLayout):
        payload = torch.zeros_like(payload)
    real_scatter(self, layout, page, shard, payload)
page_codec.PageCodec.scatter = zero_scatter
from hybrid_offload.testing.session import main
main(sys.argv[1:])
"""


@pytest.mark.parametrize("arch", [same_worker(arch) for arch in ("qwen3_next", "qwen3_5", "lfm2")])
def test_wrong_mamba_state_changes_output(arch: str, model_dir, reference_run, tmp_path: Path) -> None:
    """Negative control: the e2e comparison is sensitive to the Mamba/GDN state we restore.

    A child engine loads the same pages but writes zeros instead of the recurrent state; its
    output must differ from the baseline, or the identical-output tests above prove nothing.
    LFM2's short-conv state (2 tokens of context) leaves greedy tokens unchanged when zeroed:
    there the logprobs of the loaded pass must differ from the cold pass's, which they equal bit
    for bit when the state is restored (test_cpu_then_disk_after_restart[lfm2]).
    """
    spec = {**base_spec(arch, model_dir), "connector": connector(tmp_path / "disk", True), "passes": 2}
    spec_path, out_path = tmp_path / "spec.json", tmp_path / "out.json"
    spec_path.write_text(json.dumps(spec))
    subprocess.run(
        [sys.executable, "-c", ZEROING_CHILD, str(spec_path), str(out_path)],
        env={**os.environ, **ENGINE_ENV},
        check=True,
        capture_output=True,
        timeout=900,
    )
    result = json.loads(out_path.read_text())
    assert hit_rate(result, 1, "cpu") >= 0.99
    if arch == "lfm2":
        assert logprobs(result, 1) != logprobs(result, 0)
    else:
        assert tokens(result, 1) != tokens(reference_run(BASELINES[arch]), 0)
