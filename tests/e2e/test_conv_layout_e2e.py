"""Engines that keep Mamba/GDN conv states in vLLM's DS layout share pages with SD engines
(issue 17).

``VLLM_SSM_CONV_STATE_LAYOUT=DS`` makes vLLM keep each conv state ``(dim, state_len)``; pages
hold it as SD ``(state_len, dim)``, the connector copying through a transposed view. An SD
engine stores, a DS engine loads those pages and stores its own, an SD engine loads the DS
engine's: the greedy tokens of every load are those the writer computed, and the whole aligned
prompt loads.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_runs import CHUNK_TOKENS, hit_rate, shared_prefix_prompts, tokens

from hybrid_offload.testing.session import run_session_subprocess

pytestmark = pytest.mark.e2e


#: float32 where vLLM's CPU kernels allow it (its GDN attention needs bfloat16)
DTYPES = {"falcon_h1": "float32", "qwen3_next": "bfloat16"}


def run(model: str, disk: Path, layout: str, pass_prompts: list[list[list[int]]], dtype: str) -> dict:
    spec = {
        "model": model, "pass_prompts": pass_prompts, "passes": len(pass_prompts), "max_tokens": 8,
        "reset_prefix_cache": "request", "llm_kwargs": {"dtype": dtype},
        "connector": {"backends": [{"type": "disk", "name": "disk", "path": str(disk)}]},
    }  # fmt: skip
    return run_session_subprocess(spec, env={"VLLM_SSM_CONV_STATE_LAYOUT": layout})


@pytest.mark.parametrize("arch", sorted(DTYPES))
def test_sd_and_ds_engines_load_each_others_pages(model_dir, tmp_path: Path, arch: str) -> None:
    model = str(model_dir(arch))
    chunk = CHUNK_TOKENS[arch]
    first, second = shared_prefix_prompts(chunk, seed=1), shared_prefix_prompts(chunk, seed=2)
    sd = run(model, tmp_path, "SD", [first], DTYPES[arch])
    ds = run(model, tmp_path, "DS", [first, second], DTYPES[arch])  # loads SD pages, stores its own
    assert "Setting SSM conv state layout to DS" in ds["log"]
    assert tokens(ds, 0) == tokens(sd, 0)
    assert hit_rate(ds, 0, "disk") >= 0.99
    again = run(model, tmp_path, "SD", [second], DTYPES[arch])
    assert tokens(again, 0) == tokens(ds, 1)
    assert hit_rate(again, 0, "disk") >= 0.99
