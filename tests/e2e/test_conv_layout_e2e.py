"""Engines that keep Mamba/GDN conv states in vLLM's DS layout share pages with SD engines
(issue 17).

``VLLM_SSM_CONV_STATE_LAYOUT=DS`` makes vLLM keep each conv state ``(dim, state_len)``; pages
hold it as SD ``(state_len, dim)``, the connector copying through a transposed view. An SD
engine stores, a DS engine loads those pages and stores its own, an SD engine loads the DS
engine's: the greedy tokens of every load are those the writer computed, and the whole aligned
prompt loads.

Shared engines: two engine lifetimes per arch, not three. The SD engine that stores the first
prompts waits at a pass barrier (the session's ``pass_barrier``) while the DS engine runs, then
loads the second prompts from the DS engine's pages (the disk tier sees other processes' pages
at once; the two prompt sets share no prefix, so none of its own pages serve them).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from engine_runs import CHUNK_TOKENS, hit_rate, release_pass, shared_prefix_prompts, tokens, wait_for_pass

from hybrid_offload.testing.session import run_session_subprocess

pytestmark = pytest.mark.e2e


#: float32 where vLLM's CPU kernels allow it (its GDN attention needs bfloat16)
DTYPES = {"falcon_h1": "float32", "qwen3_next": "bfloat16"}


def run(model: str, disk: Path, layout: str, pass_prompts: list[list[list[int]]], dtype: str,
        gate: Path | None = None) -> dict:  # fmt: skip
    """One engine through a pass per prompt set; with a ``gate`` (a directory), it waits there
    after each pass until the test releases it (``engine_runs.release_pass``)."""
    spec = {
        "model": model, "pass_prompts": pass_prompts, "passes": len(pass_prompts), "max_tokens": 8,
        "reset_prefix_cache": "request", "llm_kwargs": {"dtype": dtype},
        "connector": {"backends": [{"type": "disk", "name": "disk", "path": str(disk)}]},
    }  # fmt: skip
    if gate is not None:
        spec.update(pass_barrier=str(gate), barrier_timeout_s=900)
    return run_session_subprocess(spec, env={"VLLM_SSM_CONV_STATE_LAYOUT": layout})


@pytest.mark.parametrize("arch", sorted(DTYPES))
def test_sd_and_ds_engines_load_each_others_pages(model_dir, tmp_path: Path, arch: str) -> None:
    model = str(model_dir(arch))
    chunk = CHUNK_TOKENS[arch]
    first, second = shared_prefix_prompts(chunk, seed=1), shared_prefix_prompts(chunk, seed=2)
    disk, gate = tmp_path / "disk", tmp_path / "sd-gate"
    disk.mkdir()
    gate.mkdir()
    with ThreadPoolExecutor(1) as pool:
        try:
            sd_run = pool.submit(run, model, disk, "SD", [first, second], DTYPES[arch], gate)
            wait_for_pass(gate, 0, sd_run, timeout=900)  # the SD engine stored the first prompts
            ds = run(model, disk, "DS", [first, second], DTYPES[arch])  # loads SD pages, stores its own
        finally:  # the SD engine goes on (after a failure too, rather than wait out its barrier)
            release_pass(gate, 0)
        sd = sd_run.result()  # its second pass: loads the DS engine's pages
    assert "Setting SSM conv state layout to DS" in ds["log"]
    assert tokens(ds, 0) == tokens(sd, 0)
    assert hit_rate(ds, 0, "disk") >= 0.99
    assert tokens(sd, 1) == tokens(ds, 1)
    assert hit_rate(sd, 1, "disk") >= 0.99
